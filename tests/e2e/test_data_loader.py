"""The resumable loaders: O(1) resume, batch-size and world-size changes, per-sample seeding,
global RNG hygiene, errors, the IterableLoader's Stateful protocol and worker signals.

Datasets here mostly return their own index, so a batch *is* the list of indices it holds and
the stream can be checked against ``epoch_order`` directly.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import unbroken
from tests.golden import ROOT
from unbroken import ConfigError, DataError
from unbroken.data import _seeding, epoch_order

N_BIG = 200_000


def order(seed: int, epoch: int, n: int) -> list[int]:
    return epoch_order(seed, epoch, n, True).tolist()


class Ints:
    """Sample i is the int i; counts the per-sample calls made in this process."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        return i


class ProtoInts(Ints):
    """The same through the ``get_sample(index, generator)`` protocol."""

    def __getitem__(self, i: int) -> int:
        raise AssertionError("a get_sample dataset is never indexed")

    def get_sample(self, i: int, generator: torch.Generator) -> int:
        self.calls += 1
        return i


class ProtoAug:
    """Augmentation from the generator unbroken hands over."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get_sample(self, i: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(3, generator=generator, dtype=torch.float64) + i


class GlobalAug:
    """Augmentation from the process's global torch, Python and NumPy streams."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = [random.random(), float(np.random.rand())]
        return torch.cat([torch.randn(2, dtype=torch.float64), torch.tensor(noise)]) + i


class Stream:
    """A Stateful iterable: ``pos`` is the next item; a finished pass starts over."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield (self.pos - 1) * 10
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.pos = state_dict["pos"]


# ---- O(1) resume ------------------------------------------------------------------------------


@pytest.fixture
def permutations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Records every epoch permutation the loader computes."""
    calls: list[tuple[Any, ...]] = []
    real = _seeding.epoch_order

    def counting(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_seeding, "epoch_order", counting)
    return calls


@pytest.mark.parametrize("cls", [Ints, ProtoInts], ids=["getitem", "get_sample"])
def test_resume_fetches_one_batch_whatever_the_position(cls, permutations):
    src = unbroken.MapLoader(cls(N_BIG), batch_size=10, seed=3)
    it = iter(src)
    next(it)
    near = src.state_dict()
    src.batch_size = 99_990
    next(it)
    far = src.state_dict()
    it.close()
    assert (near["position"], far["position"]) == (10, 100_000)
    later = {**far, "epoch": 4}

    for state in (near, far, later):
        ds = cls(N_BIG)
        loader = unbroken.MapLoader(ds, batch_size=16, seed=3)
        permutations.clear()
        loader.load_state_dict(state)
        assert ds.calls == 0 and permutations == [], "load_state_dict only stores the position"
        batch = next(iter(loader))
        assert ds.calls == 16, f"resume at {state['position']} replayed samples"
        assert len(permutations) == 1
        p = state["position"]
        assert batch.tolist() == order(3, state["epoch"], N_BIG)[p : p + 16]
        assert loader.state_dict()["position"] == p + 16


def test_resume_with_workers_starts_at_the_saved_position():
    for epoch, pos in ((0, 10), (2, 100_000)):
        loader = unbroken.MapLoader(Ints(N_BIG), batch_size=16, seed=3, num_workers=2)
        loader.load_state_dict({**loader.state_dict(), "epoch": epoch, "position": pos})
        it = iter(loader)
        first, second = next(it), next(it)
        it.close()
        expect = order(3, epoch, N_BIG)[pos : pos + 32]
        assert first.tolist() + second.tolist() == expect
        assert loader.state_dict()["position"] == pos + 32


# ---- batch-size changes -----------------------------------------------------------------------

SIZES = [4, 7, 3, 10, 5, 1, 8, 6]


def consume(
    make: Callable[[int], unbroken.MapLoader],
    sizes: list[int],
    epochs: int,
    restart_at: tuple[int, ...] = (),
) -> list[tuple[int, list[int], int]]:
    """(epoch, indices, batch size asked for) of each batch over ``epochs`` epochs.

    Before step k the batch size is ``sizes[k % len(sizes)]``, set mid-iteration. After each step
    in ``restart_at`` the loader is replaced by a fresh one, built with that next size, which
    loads the old one's state.
    """
    loader = make(sizes[0])
    out: list[tuple[int, list[int], int]] = []
    while True:
        for batch in loader:
            assert batch.tolist() == loader.last_indices
            out.append((loader.epoch, loader.last_indices, loader.batch_size))
            size = sizes[len(out) % len(sizes)]
            if len(out) in restart_at:
                state = loader.state_dict()
                loader.close()
                loader = make(size)
                loader.load_state_dict(state)
                break
            loader.batch_size = size
        else:
            if loader.epoch == epochs - 1:
                loader.close()
                return out


def by_epoch(batches: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for epoch, idx, _ in batches:
        out.setdefault(epoch, []).extend(idx)
    return out


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep_last", "drop_last"])
def test_batch_size_changes_skip_and_repeat_nothing(workers, drop_last):
    n, seed, epochs = 61, 5, 3

    def make(batch_size: int) -> unbroken.MapLoader:
        return unbroken.MapLoader(
            Ints(n), batch_size, seed=seed, drop_last=drop_last, num_workers=workers
        )

    reference = by_epoch(consume(make, [8], epochs))
    batches = consume(make, SIZES, epochs, restart_at=(3, 9, 17, 22))
    assert {len(idx) for _, idx, _ in batches} >= {1, 3, 10}, "the schedule was not followed"
    for _, idx, asked in batches:
        assert len(idx) == asked or (not drop_last and len(idx) < asked)
    got = by_epoch(batches)
    assert sorted(got) == sorted(reference) == list(range(epochs))
    for e in range(epochs):
        full = order(seed, e, n)
        if drop_last:
            assert reference[e] == full[:56]
            assert got[e] == full[: len(got[e])], f"epoch {e}: skipped or repeated a sample"
            assert n - len(got[e]) < max(SIZES)
        else:
            assert reference[e] == full
            assert got[e] == full, f"epoch {e}: skipped or repeated a sample"


def test_a_state_saved_at_an_epoch_end_yields_that_end_first():
    src = unbroken.MapLoader(Ints(12), batch_size=4, seed=1)
    it = iter(src)
    assert [len(next(it)) for _ in range(3)] == [4, 4, 4]  # the last batch, not yet the end
    resumed = unbroken.MapLoader(Ints(12), batch_size=4, seed=1)
    resumed.load_state_dict(src.state_dict())
    # The epoch had not been seen to end when the state was taken, so the consumer sees it end.
    assert list(resumed) == [] and resumed.epoch == 0
    assert sum((b.tolist() for b in resumed), []) == order(1, 1, 12)
    resumed.set_epoch(1)
    assert list(resumed) == [], "set_epoch on the finished epoch in progress yields nothing"
    resumed.set_epoch(3)
    assert sum((b.tolist() for b in resumed), []) == order(1, 3, 12)
    after_end = unbroken.MapLoader(Ints(12), batch_size=4, seed=1)
    after_end.load_state_dict(resumed.state_dict())  # taken after the pass ended
    assert sum((b.tolist() for b in after_end), []) == order(1, 4, 12)


# ---- augmentation -----------------------------------------------------------------------------

CONFIGS = {
    "w0": dict(num_workers=0),
    "w1": dict(num_workers=1),
    "w2": dict(num_workers=2),
    "w2-persistent": dict(num_workers=2, persistent_workers=True),
}


def samples(loader: unbroken.MapLoader, out: dict, stop: int | None = None, epochs: int = 2):
    """Record each sample by (epoch, index) until ``epochs`` epochs end or ``stop`` batches."""
    count = 0
    while True:
        for batch in loader:
            for i, row in zip(loader.last_indices, batch, strict=True):
                assert (loader.epoch, i) not in out
                out[(loader.epoch, i)] = row
            count += 1
            if count == stop:
                return loader.state_dict()
        if loader.epoch == epochs - 1:
            return None


def assert_same_samples(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    diff = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not diff, f"samples differ: {diff[:5]}"


@pytest.mark.parametrize("cls", [ProtoAug, GlobalAug], ids=["get_sample", "global_rng"])
def test_augmentation_is_the_same_for_any_workers_and_resume_point(cls):
    n = 24

    def make(batch_size: int, config: str) -> unbroken.MapLoader:
        return unbroken.MapLoader(cls(n), batch_size, seed=9, **CONFIGS[config])

    ref: dict = {}
    samples(make(5, "w0"), ref)
    assert len(ref) == 2 * n
    assert not torch.equal(ref[(0, 3)], ref[(1, 3)]), "epochs must draw different noise"
    for k, config in enumerate(CONFIGS):
        torch.manual_seed(100 + k)  # the global stream must not matter
        got: dict = {}
        loader = make(5, config)
        samples(loader, got)
        loader.close()
        assert_same_samples(ref, got)
    # Resume mid-epoch, at the epoch boundary (24/5 -> 5 batches) and in epoch 1, with another
    # worker count and batch size.
    for stop, (before, after) in zip(
        (1, 3, 5, 7),
        (("w0", "w2"), ("w2", "w1"), ("w1", "w0"), ("w2", "w2-persistent")),
        strict=True,
    ):
        got = {}
        first = make(5, before)
        state = samples(first, got, stop=stop)
        first.close()
        second = make(3, after)
        second.load_state_dict(state)
        samples(second, got)
        second.close()
        assert_same_samples(ref, got)


def rng_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0], "Python's global random state changed"
    assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=True)), "NumPy's changed"
    assert torch.equal(a[2], b[2]), "torch's global CPU generator changed"


@pytest.mark.parametrize("cls", [ProtoAug, GlobalAug], ids=["get_sample", "global_rng"])
def test_main_process_iteration_leaves_global_rng_untouched(cls):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    before = rng_states()
    loader = unbroken.MapLoader(cls(20), batch_size=6, seed=2)
    samples(loader, {}, stop=2)
    loader.batch_size = 4
    samples(loader, {}, epochs=2)
    assert_same_rng(before, rng_states())


class ThreeStreams(tud.Dataset):
    """Each sample draws from all three global streams."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([random.random(), np.random.rand(), torch.rand(()).item()])


@pytest.mark.parametrize("streams", ["torch", ("python", "numpy")])
def test_reseed_globals_may_name_the_streams(streams):
    names = (streams,) if isinstance(streams, str) else streams
    cols = [i for i, n in enumerate(("python", "numpy", "torch")) if n in names]
    full = torch.cat(list(unbroken.MapLoader(ThreeStreams(), 4, seed=3)))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    before = rng_states()
    some = torch.cat(list(unbroken.MapLoader(ThreeStreams(), 4, seed=3, reseed_globals=streams)))
    # The named streams give the same values as a full reseed, and are put back afterwards;
    # the others are drawn from (not reseeded) and so move on.
    assert torch.equal(some[:, cols], full[:, cols])
    others = [i for i in range(3) if i not in cols]
    assert not torch.equal(some[:, others], full[:, others])
    after = rng_states()
    for i in range(3):
        same = (
            after[i] == before[i]
            if i == 0
            else all(np.array_equal(x, y) for x, y in zip(after[1], before[1], strict=True))
            if i == 1
            else torch.equal(after[2], before[2])
        )
        assert same is (i in cols), i
    with pytest.raises(ConfigError, match="unknown stream"):
        unbroken.MapLoader(ThreeStreams(), 4, reseed_globals=("torch", "cuda"))


def test_worker_iterators_draw_nothing_from_global_torch_rng():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    for persistent in (False, True):
        loader = unbroken.MapLoader(
            GlobalAug(20), batch_size=6, seed=2, num_workers=2, persistent_workers=persistent
        )
        it = iter(loader)
        next(it)
        loader.batch_size = 4  # a new inner iterator
        list(it)
        list(loader)  # and another epoch
        loader.close()
    assert torch.equal(before, torch.get_rng_state())


def _random_collate(items: list[int]) -> torch.Tensor:
    """Draws from all three global streams, as masking collators and random crops do."""
    noise = torch.rand(len(items)) + random.random() + float(np.random.rand())
    return torch.tensor(items, dtype=torch.float64) + noise


def test_a_collate_fn_draws_the_same_numbers_in_any_process_at_any_resume():
    # Each batch's collate runs with the streams seeded from the batch's keys: the same numbers
    # with 0 or 2 workers and from a resumed position; the main process's streams (the
    # training stream) are put back, as if no batch had been collated.
    torch.manual_seed(5)
    before = rng_states()
    full = torch.cat(list(unbroken.MapLoader(range(20), 4, seed=0, collate_fn=_random_collate)))
    assert_same_rng(before, rng_states())
    workers = unbroken.MapLoader(range(20), 4, seed=0, num_workers=2, collate_fn=_random_collate)
    assert torch.equal(torch.cat(list(workers)), full)
    resumed = unbroken.MapLoader(range(20), 4, seed=0, collate_fn=_random_collate)
    resumed.load_state_dict({**resumed.state_dict(), "position": 8})
    assert torch.equal(torch.cat(list(resumed)), full[8:])
    assert len(set((full - full.round()).tolist())) > 10  # random, not one number repeated
    # Opting out (reseed_globals=False): the collate draws from the process's own streams.
    loose = unbroken.MapLoader(
        range(20), 4, seed=0, collate_fn=_random_collate, reseed_globals=False
    )
    assert not torch.equal(torch.cat(list(loose)), full)


# ---- ranks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_each_global_batch(world):
    n, seed = 40, 11
    ref = unbroken.MapLoader(Ints(n), 6, seed=seed)
    ranks = [
        unbroken.MapLoader(Ints(n), 6, seed=seed, rank=r, world_size=world) for r in range(world)
    ]
    for _ in range(2):
        its = [iter(loader) for loader in ranks]
        for global_batch in ref:
            local = [next(it).tolist() for it in its]
            assert sum(local, []) == global_batch.tolist()
            assert max(map(len, local)) - min(map(len, local)) <= 1
            assert all(loader.last_indices == ref.last_indices for loader in ranks)
        assert all(next(it, None) is None for it in its)
        assert all(loader.state_dict() == ref.state_dict() for loader in ranks)


def test_a_state_saved_at_world_2_continues_at_world_3():
    n, seed = 45, 4

    def lockstep(loaders: list[unbroken.MapLoader], stop: int | None) -> list[list[int]]:
        """Global batches (the ranks' slices joined) until ``stop`` steps or epoch 1's end."""
        out: list[list[int]] = []
        while True:
            its = [iter(loader) for loader in loaders]
            for first in its[0]:
                local = [first.tolist()] + [next(it).tolist() for it in its[1:]]
                out.append(sum(local, []))
                if len(out) == stop:
                    return out
            assert all(next(it, None) is None for it in its[1:])
            if loaders[0].epoch == 1:
                return out

    two = [unbroken.MapLoader(Ints(n), 6, seed=seed, rank=r, world_size=2) for r in range(2)]
    stream = lockstep(two, stop=4)
    states = [loader.state_dict() for loader in two]
    assert states[0] == states[1] and states[0]["position"] == 24
    three = [unbroken.MapLoader(Ints(n), 9, seed=seed, rank=r, world_size=3) for r in range(3)]
    for loader in three:
        loader.load_state_dict(states[0])
    stream += lockstep(three, stop=None)
    assert [len(b) for b in stream[:6]] == [6, 6, 6, 6, 9, 9]
    assert sum(stream, []) == order(seed, 0, n) + order(seed, 1, n)


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,change",
    [("dataset_len", dict(n=31)), ("seed", dict(seed=1)), ("shuffle", dict(shuffle=False))],
)
def test_load_rejects_a_changed_stream(field, change):
    def make(n: int = 30, seed: int = 0, shuffle: bool = True) -> unbroken.MapLoader:
        return unbroken.MapLoader(Ints(n), 4, seed=seed, shuffle=shuffle)

    src = make()
    next(iter(src))
    state = src.state_dict()
    with pytest.raises(DataError, match=field):
        make(**change).load_state_dict(state)
    same = make()
    same.load_state_dict(state)  # the unchanged configuration loads
    assert same.position == 4


def test_load_rejects_an_unknown_version():
    loader = unbroken.MapLoader(Ints(8), 4)
    with pytest.raises(DataError, match="version"):
        loader.load_state_dict({**loader.state_dict(), "version": 99})


class LenStream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(5))

    def __len__(self) -> int:
        return 5


def test_bad_configurations_raise_config_error():
    with pytest.raises(ConfigError, match="batch_size"):
        unbroken.MapLoader(Ints(8), 0)
    loader = unbroken.MapLoader(Ints(8), 2, rank=1, world_size=2)
    with pytest.raises(ConfigError, match="batch_size"):
        loader.batch_size = 0
    with pytest.raises(ConfigError, match="divisible by world_size 2"):
        unbroken.MapLoader(Ints(8), 3, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="divisible"):
        loader.batch_size = 5
    assert loader.batch_size == 2
    with pytest.raises(ConfigError, match="rank"):
        unbroken.MapLoader(Ints(8), 2, rank=2, world_size=2)
    for iterable in (LenStream(), Stream(5)):
        with pytest.raises(ConfigError, match="IterableLoader"):
            unbroken.MapLoader(iterable, 2)
    with pytest.raises(ConfigError, match="state_dict"):
        unbroken.IterableLoader(range(5), 2)
    with pytest.raises(ConfigError, match="batch_size"):
        unbroken.IterableLoader(Stream(5), 0)


# ---- IterableLoader ---------------------------------------------------------------------------


def drive(loader: unbroken.IterableLoader, out: list, epochs: int, stop: int | None = None):
    """Record (epoch, batch) until ``epochs`` passes end or ``stop`` batches; the state then."""
    if stop == 0:
        return loader.state_dict()
    while True:
        for batch in loader:
            out.append((loader.epoch, batch.tolist()))
            if len(out) == stop:
                return loader.state_dict()
        if loader.epoch == epochs - 1:
            return None


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep_last", "drop_last"])
@pytest.mark.parametrize("stop", [0, 1, 4, 6, 7, 13])
def test_iterable_loader_resumes_mid_stream(stop, drop_last):
    # 23 items, batch 4: 6 batches a pass (5 with drop_last); stop 6 is just after a pass's last
    # batch, before the loader has seen the pass end.
    ref: list = []
    drive(unbroken.IterableLoader(Stream(23), 4, drop_last=drop_last), ref, epochs=3)
    per_pass = 5 if drop_last else 6
    assert len(ref) == 3 * per_pass
    assert [e for e, _ in ref] == [e for e in range(3) for _ in range(per_pass)]
    got: list = []
    state = drive(unbroken.IterableLoader(Stream(23), 4, drop_last=drop_last), got, 3, stop)
    assert state is not None and len(got) == stop
    resumed = unbroken.IterableLoader(Stream(23), 4, drop_last=drop_last)
    resumed.load_state_dict(state)
    drive(resumed, got, epochs=3)
    assert got == ref


# ---- workers and signals ----------------------------------------------------------------------


def test_workers_ignore_stop_signals():
    loader = unbroken.MapLoader(
        Ints(64), batch_size=4, seed=0, num_workers=2, persistent_workers=True
    )
    it = iter(loader)
    got = [next(it).tolist(), next(it).tolist()]  # one batch from each worker: both started
    workers = list(loader._inner._iterator._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        for w in workers:
            os.kill(w.pid, sig)
    time.sleep(0.5)
    assert all(w.is_alive() for w in workers), "a worker died of a stop signal"
    got += [b.tolist() for b in it]
    assert sum(got, []) == order(0, 0, 64)
    assert sum((b.tolist() for b in loader), []) == order(0, 1, 64)
    assert [w.pid for w in loader._inner._iterator._workers] == [w.pid for w in workers]
    loader.close()
    for w in workers:
        w.join(10)
    assert not any(w.is_alive() for w in workers), "close() left workers running"


EXIT_SCRIPT = """
import sys
import unbroken

class Ints:
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return i

loader = unbroken.MapLoader(Ints(), 4, num_workers=2, persistent_workers=True)
it = iter(loader)
next(it)
next(it)
if sys.argv[1] == "epoch":
    list(it)
print("exiting", flush=True)
if sys.argv[1] == "exit75":
    sys.exit(75)
"""


@pytest.mark.parametrize("how", ["mid", "epoch", "exit75"])
def test_exit_with_persistent_workers_does_not_hang(how):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), how],
            env=env,
            timeout=60,
            capture_output=True,
            text=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit with persistent workers")
    assert proc.stdout == "exiting\n", proc.stderr[-2000:]
    assert proc.returncode == (75 if how == "exit75" else 0), proc.stderr[-2000:]
