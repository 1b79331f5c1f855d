"""Watching the global streams (reseed_globals=True): the same bits as seeding all of them.

The default loader seeds only the global streams a dataset is seen drawing from. Whatever it
has or has not seen, every sample must be exactly what seeding all three streams for every
sample gives, in the main process and in workers, and the training stream must go on as if
nothing was fetched. The process-level golden tests (interrupted vs uninterrupted) are in
test_data_streams_golden.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import unbroken
from unbroken.data import _global_streams

ALL = ("python", "numpy", "torch")


class Draws(tud.Dataset):
    """Sample i draws from the global ``stream`` when ``uses(i)``, else from none."""

    def __init__(self, stream: str, n: int = 40, late: int | None = None) -> None:
        self.stream, self.n, self.late = stream, n, late

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.late is not None and i != self.late:
            return torch.tensor([float(i), 0.0])
        if self.stream == "python":
            v = random.random()
        elif self.stream == "numpy":
            v = float(np.random.randn())
        else:
            v = torch.randn(()).item()
        return torch.tensor([float(i), v])


def states() -> tuple:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def same_states(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and all(np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=True))
        and torch.equal(a[2], b[2])
    )


def epochs(loader: unbroken.MapLoader, n: int) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        out.extend(loader)
    return out


def late_index(seed: int, n: int, batch: int, at_batch: int) -> int:
    """An index first fetched in batch ``at_batch`` of epoch 0."""
    return int(unbroken.data.epoch_order(seed, 0, n, True)[at_batch * batch])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("late", [False, True], ids=["every_sample", "from_batch_3"])
@pytest.mark.parametrize("stream", ALL)
def test_watched_equals_seeding_every_stream(stream, late, workers):
    data = Draws(stream, late=late_index(5, 40, 4, 3) if late else None)
    ref = epochs(unbroken.MapLoader(data, 4, seed=5, reseed_globals=ALL), 2)
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    before = states()
    watched = unbroken.MapLoader(data, 4, seed=5, num_workers=workers)
    got = epochs(watched, 2)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert same_states(before, states()), "the training stream moved"
    if workers == 0:
        # Found by watching, and no other stream seeded for nothing.
        assert watched._inner.dataset.seeder.seeded == (stream,)


def test_numpy_cached_gaussian_is_seen():
    """NumPy caches the second Gaussian of a pair outside the MT words: a sample taking the
    cached one changes no MT byte, yet must get the seeded value."""
    data = Draws("numpy", n=8)
    ref = list(unbroken.MapLoader(data, 1, seed=2, shuffle=False, reseed_globals=ALL))
    np.random.seed(3)
    np.random.randn()  # the training code leaves a Gaussian cached
    before = np.random.get_state()
    assert before[3] == 1
    got = list(unbroken.MapLoader(data, 1, seed=2, shuffle=False))
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    after = np.random.get_state()
    assert after[3] == 1 and after[4] == before[4] and np.array_equal(after[1], before[1])


def test_numpy_state_put_back_from_its_bytes():
    """With no Gaussian cached the saved NumPy state is its MT bytes alone; putting it back
    from them gives the very state NumPy reports."""
    np.random.seed(11)
    np.random.random(5)
    want = np.random.get_state()
    saved = _global_streams._np_save()
    np.random.seed(12)
    _global_streams._np_put(saved)
    got = np.random.get_state()
    assert got[0] == want[0] and got[2:] == want[2:] and np.array_equal(got[1], want[1])
    assert not _global_streams._np_moved(saved)
    np.random.random()
    assert _global_streams._np_moved(saved)


def test_unseen_streams_are_not_seeded():
    """A dataset that draws nothing seeds nothing (the cost of a stream is paid only once it
    is seen), and the stream it never drew from keeps moving with the training code."""
    data = Draws("python", late=-1)  # never draws
    loader = unbroken.MapLoader(data, 4, seed=1)
    epochs(loader, 1)
    seeder = loader._inner.dataset.seeder
    assert seeder.seeded == () and seeder.watched == ALL


def test_named_streams_are_seeded_without_watching():
    loader = unbroken.MapLoader(Draws("torch"), 4, seed=1, reseed_globals="torch")
    seeder = loader._inner.dataset.seeder
    assert seeder.seeded == ("torch",) and seeder.watched == ()
    none = unbroken.MapLoader(Draws("torch"), 4, seed=1, reseed_globals=False)
    assert not none._inner.dataset.seeder.active
