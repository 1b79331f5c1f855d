"""Sharded sources, the loader contract and the user's sampler, in-process (fast) checks.

The separate-process golden tests of the same sources are in test_data_stream_golden.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken
from tests._logs import logs_match
from tests.golden import ROOT
from unbroken import ConfigError, DataError
from unbroken.data import (
    IterableLoader,
    IterableShards,
    JsonlShards,
    Loader,
    MapLoader,
    SamplerLoader,
    ShardOrder,
)


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    out = []
    for k, n in enumerate([5, 9, 3, 7]):
        p = tmp_path / f"s{k}.jsonl"
        _write(p, [{"v": 100 * k + i} for i in range(n)])
        out.append(str(p))
    return out


def _values(batches) -> list[int]:
    return [int(v) for b in batches for v in b["v"]]


# ---- the order ------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle_lines", [True, False])
def test_shard_order_is_a_permutation_with_each_shard_contiguous(shuffle_lines: bool) -> None:
    sizes = np.array([5, 9, 3, 7, 1])
    base = np.concatenate([[0], np.cumsum(sizes)])
    full = ShardOrder(sizes, 3, 1, shuffle=True, shuffle_lines=shuffle_lines)[:]
    assert sorted(full.tolist()) == list(range(sizes.sum()))
    shard_of = np.searchsorted(base, full, side="right") - 1
    runs = [k for i, k in enumerate(shard_of) if i == 0 or k != shard_of[i - 1]]
    assert sorted(runs) == list(range(len(sizes)))  # every shard read as one run
    # Any cut into slices gives the same stream; slices by a fresh object too (resume).
    rng = np.random.default_rng(0)
    cuts = sorted(set(rng.integers(0, sizes.sum(), 6).tolist()) | {0, int(sizes.sum())})
    parts = [
        ShardOrder(sizes, 3, 1, shuffle=True, shuffle_lines=shuffle_lines)[a:b]
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    assert np.concatenate(parts).tolist() == full.tolist()
    other = ShardOrder(sizes, 3, 2, shuffle=True, shuffle_lines=shuffle_lines)[:]
    assert other.tolist() != full.tolist()  # another epoch, another order
    if not shuffle_lines:
        for k in range(len(sizes)):
            mine = full[shard_of == k]
            assert mine.tolist() == list(range(base[k], base[k + 1]))


def test_a_resume_permutes_only_the_shard_it_lands_in(files: list[str]) -> None:
    loader = MapLoader(JsonlShards(files), 4, seed=5)
    loader.load_state_dict({**loader.state_dict(), "position": 14})
    next(iter(loader))
    order = loader._order(0)
    assert isinstance(order, ShardOrder) and 1 <= len(order._inner) <= 2


# ---- resume in the main process and with workers ------------------------------------------


def test_jsonl_resume_with_other_workers_batch_size_and_world_size(files: list[str]) -> None:
    full = _values(MapLoader(JsonlShards(files), 4, seed=1))
    assert sorted(full) == sorted(100 * k + i for k, n in enumerate([5, 9, 3, 7]) for i in range(n))
    two = [MapLoader(JsonlShards(files), 4, seed=1, rank=r, world_size=2) for r in range(2)]
    its = [iter(x) for x in two]
    got = []
    for _ in range(3):
        got += sum((_values([next(it)]) for it in its), [])
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    three = [
        MapLoader(JsonlShards(files), 6, seed=1, rank=r, world_size=3, num_workers=1 if r else 0)
        for r in range(3)
    ]
    for x in three:
        x.load_state_dict(state)
    for parts in zip(*three, strict=True):
        got += sum((_values([p]) for p in parts), [])
    assert got == full


def test_augment_gets_a_generator_seeded_by_seed_epoch_index(files: list[str]) -> None:
    def noisy(rec, g):
        return torch.tensor([float(rec["v"]), torch.rand((), generator=g).item()])

    ref = torch.cat(list(MapLoader(JsonlShards(files, augment=noisy), 4, seed=2)))
    part = MapLoader(JsonlShards(files, augment=noisy), 5, seed=2, num_workers=2)
    part.load_state_dict({**part.state_dict(), "position": 8})
    assert torch.equal(torch.cat(list(part)), ref[8:])
    index = MapLoader(JsonlShards(files), 1, seed=2).state_dict()  # same order, 1 per batch
    assert index["dataset_len"] == 24


# ---- bad input ------------------------------------------------------------------------------


def _saved(files: list[str]) -> dict:
    loader = MapLoader(JsonlShards(files), 4, seed=0)
    next(iter(loader))
    return loader.state_dict()


def test_a_changed_shard_list_is_refused_naming_the_file(files: list[str], tmp_path: Path) -> None:
    state = _saved(files)
    extra = tmp_path / "s9.jsonl"
    _write(extra, [{"v": 1}])
    cases = {
        "added": ([*files, str(extra)], "s9.jsonl was added"),
        "removed": (files[:-1], "s3.jsonl was in the shard list when saved but is not now"),
    }
    for now, message in cases.values():
        with pytest.raises(DataError, match=message):
            MapLoader(JsonlShards(now), 4, seed=0).load_state_dict(state)
    with open(files[1], "a", encoding="utf-8") as f:
        f.write(json.dumps({"v": 999}) + "\n")
    with logs_match(r"s1\.jsonl changed since its index was built"):
        changed = JsonlShards(files)  # the index is rebuilt, and says so
    with pytest.raises(DataError, match=r"s1\.jsonl changed size since the save"):
        MapLoader(changed, 4, seed=0).load_state_dict(state)


def test_same_size_edit_and_reorder_are_refused(files: list[str]) -> None:
    state = _saved(files)
    text = Path(files[2]).read_text()
    Path(files[2]).write_text(text.replace("200", "299"))
    with logs_match(r"s2\.jsonl changed since its index was built"):
        edited = JsonlShards(files)
    with pytest.raises(DataError, match=r"s2\.jsonl changed content"):
        MapLoader(edited, 4, seed=0).load_state_dict(state)
    Path(files[2]).write_text(text)
    with logs_match(r"s2\.jsonl changed since its index was built"):
        reordered = JsonlShards(files[::-1])
    with pytest.raises(DataError, match="reordered"):
        MapLoader(reordered, 4, seed=0).load_state_dict(state)


def test_unreadable_shards_raise_data_error_naming_them(files: list[str], tmp_path: Path) -> None:
    link = tmp_path / "gone.jsonl"
    os.symlink(tmp_path / "nowhere.jsonl", link)  # a real dangling link
    with pytest.raises(DataError, match="gone.jsonl does not exist"):
        JsonlShards([*files, str(link)])
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match="dir.jsonl is not a regular file"):
        JsonlShards([str(folder)])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"v": 1}\n\xff\xfe\n')
    with pytest.raises(DataError, match=r"bad\.jsonl.*line 2 is not valid UTF-8"):
        JsonlShards([str(bad)])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"v": 1}\n{"v": \n')
    shards = JsonlShards([str(broken)])
    with pytest.raises(DataError, match=r"broken\.jsonl: line 2 is not valid JSON"):
        list(MapLoader(shards, 2, shuffle=False, num_workers=1))
    with pytest.raises(DataError, match="no shard file matches"):
        JsonlShards(str(tmp_path / "none-*.jsonl"))


def test_workers_without_shards_are_refused_naming_the_setting() -> None:
    class One:
        def __iter__(self):
            yield from range(3)

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(DataError, match=r"IterableLoader\(num_workers=2\)"):
        IterableLoader(One(), 2, num_workers=2)
    single = [lambda start: iter(range(start, 5))]
    with pytest.raises(DataError, match="num_workers=2 needs a source with several shards"):
        IterableShards(single, 2, num_workers=2)
    assert len(list(IterableShards(single, 2))) == 3  # fine without workers


# ---- generic sequential shards --------------------------------------------------------------


class Opener:
    """A shard that can only be read in order, opened at an offset (counts what it reads)."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n

    def __call__(self, start: int):
        return ({"v": 100 * self.k + i} for i in range(start, self.n))


def test_iterable_shards_resume_with_other_workers_and_batch_size() -> None:
    shards = [Opener(k, n) for k, n in enumerate([6, 4, 9, 5])]
    full = _values(IterableShards(shards, 4, seed=3))
    assert sorted(full) == sorted(100 * k + i for k, n in enumerate([6, 4, 9, 5]) for i in range(n))
    first = IterableShards(shards, 4, seed=3, num_workers=2)
    it = iter(first)
    head = _values([next(it) for _ in range(3)])
    state = first.state_dict()
    first.close()
    again = IterableShards(shards, 5, seed=3, num_workers=1)
    again.load_state_dict(state)
    assert head + _values(again) == full
    assert again.epoch == 0 and list(again) and again.epoch == 1


# ---- the loader contract and Run ------------------------------------------------------------


def test_every_loader_meets_the_protocol(files: list[str]) -> None:
    class S:
        def __iter__(self):
            return iter(range(4))

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    loaders = [
        MapLoader(list(range(8)), 2),
        IterableLoader(S(), 2),
        SamplerLoader(list(range(8)), sampler=S(), batch_size=2),
        IterableShards([Opener(0, 3), Opener(1, 3)], 2),
    ]
    assert all(isinstance(x, Loader) for x in loaders)
    assert not isinstance(torch.utils.data.DataLoader(list(range(8))), Loader)


def test_run_refuses_a_plain_torch_dataloader(tmp_path: Path) -> None:
    plain = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(
        ConfigError, match=r"'loader'.*torch.utils.data.DataLoader.*unbroken\.MapLoader"
    ):
        unbroken.Run(tmp_path / "run", loader=plain)


def test_run_checks_the_loaders_world_against_torch_distributed(tmp_path: Path) -> None:
    loader = MapLoader(list(range(8)), 2, rank=1, world_size=2)
    with pytest.raises(ConfigError, match="built for rank 1 of 2, but this process is rank 0 of 1"):
        unbroken.Run(tmp_path / "run", loader=loader)


def test_run_finds_a_loader_by_the_protocol_not_a_tag(tmp_path: Path) -> None:
    class Mine:
        """A third-party loader: the protocol's members, no kind tag."""

        def __init__(self):
            self.epoch = self.position = self.rank = 0
            self.world_size = 1
            self.yielded_batches = self.yielded_samples = 0

        def __iter__(self):
            for i in range(3):
                self.yielded_batches += 1
                self.yielded_samples += 1
                self.position += 1
                yield torch.tensor([float(i)])

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, sd):
            self.position = sd["position"]

    mine = Mine()
    run = unbroken.Run(tmp_path / "run", loader=mine, max_steps=2, handle_signals=False)
    assert run._loaders() == [mine]
    for _ in run.loop(mine):
        run.step()
    assert mine.yielded_batches == 2


# ---- the user's sampler ---------------------------------------------------------------------


class Stateful:
    """A user's sampler: a reversed order, keeping its own position."""

    def __init__(self, n: int) -> None:
        self.n, self.next, self.epoch = n, 0, 0

    def set_epoch(self, e: int) -> None:
        self.epoch = e

    def __iter__(self):
        while self.next < self.n:
            self.next += 1
            yield (self.n - self.next + self.epoch) % self.n
        self.next = 0

    def state_dict(self):
        return {"next": self.next, "epoch": self.epoch}

    def load_state_dict(self, sd):
        self.next, self.epoch = sd["next"], sd["epoch"]


def test_sampler_loader_rewinds_what_workers_prefetched() -> None:
    data = list(range(40, 60))
    full = [b.tolist() for b in SamplerLoader(data, sampler=Stateful(20), batch_size=3)]
    loader = SamplerLoader(data, sampler=Stateful(20), batch_size=3, num_workers=2)
    got = []
    for b in loader:
        got.append(b.tolist())
        if len(got) == 2:
            break  # the workers had prefetched more: the sampler is ahead
    got += [b.tolist() for b in loader]
    assert got == full


@pytest.mark.parametrize("n", [20, 21])  # the epoch's last batch short (20 = 6*3 + 2) or full
def test_sampler_loader_saved_after_the_last_batch_resumes_into_the_epoch_end(n: int) -> None:
    data = list(range(100, 100 + n))
    ref = SamplerLoader(data, sampler=Stateful(n), batch_size=3)
    want = [b.tolist() for b in ref] + [b.tolist() for b in ref]  # epochs 0 and 1
    loader = SamplerLoader(data, sampler=Stateful(n), batch_size=3, num_workers=1)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(-(-n // 3))]  # every batch; the end not seen yet
    state = loader.state_dict()
    resumed = SamplerLoader(data, sampler=Stateful(n), batch_size=3)
    resumed.load_state_dict(state)
    assert list(resumed) == [] and resumed.epoch == 0  # epoch 0 ends here, as it did
    got += [b.tolist() for b in resumed]
    assert got == want and resumed.epoch == 1


def test_a_sampler_without_state_is_refused_with_what_to_use() -> None:
    plain = torch.utils.data.RandomSampler(list(range(10)))
    with pytest.raises(ConfigError, match=r"RandomSampler has no state_dict.*unbroken\.MapLoader"):
        SamplerLoader(list(range(10)), sampler=plain, batch_size=2)


# ---- Hugging Face datasets (in-process) ----------------------------------------------------


def test_hf_dataset_is_map_style_in_unbroken_dataloader(files: list[str], tmp_path: Path) -> None:
    import datasets

    table = datasets.Dataset.from_json(files, cache_dir=str(tmp_path / "hf"))
    full = [int(v) for b in MapLoader(table, 4, seed=1) for v in b["v"]]
    part = MapLoader(table, 6, seed=1, num_workers=2)
    part.load_state_dict({**part.state_dict(), "position": 8})
    assert [int(v) for b in part for v in b["v"]] == full[8:]


# ---- exit with a pass abandoned mid-epoch --------------------------------------------------


def test_exit_with_an_abandoned_worker_pass_does_not_hang(tmp_path: Path) -> None:
    """Non-persistent workers of a pass left mid-epoch used to keep the interpreter from
    exiting (multiprocessing's exit hook waited for workers that ignore SIGTERM)."""
    script = tmp_path / "abandon.py"
    script.write_text(
        "import unbroken\n"
        "if __name__ == '__main__':\n"
        "    loader = unbroken.MapLoader(list(range(100)), 4, num_workers=2)\n"
        "    it = iter(loader)\n"
        "    next(it)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], env=env, timeout=60, capture_output=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_iterable_shards_and_sampler_loader_continue_at_another_world_size() -> None:
    shards = [Opener(k, n) for k, n in enumerate([6, 4, 9, 5])]
    full = _values(IterableShards(shards, 6, seed=1))
    two = [IterableShards(shards, 6, seed=1, rank=r, world_size=2) for r in range(2)]
    its = [iter(x) for x in two]
    got = []
    for _ in range(2):
        got += sum((_values([next(it)]) for it in its), [])
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    three = [IterableShards(shards, 6, seed=1, rank=r, world_size=3) for r in range(3)]
    for x in three:
        x.load_state_dict(state)
    for parts in zip(*three, strict=True):
        got += sum((_values([p]) for p in parts), [])
    assert got == full

    data = list(range(50, 74))
    whole = sum((b.tolist() for b in SamplerLoader(data, sampler=Stateful(24), batch_size=6)), [])
    pair = [
        SamplerLoader(data, sampler=Stateful(24), batch_size=6, rank=r, world_size=2)
        for r in range(2)
    ]
    its = [iter(x) for x in pair]
    seen = sum((next(it).tolist() for it in its), [])
    trio = [
        SamplerLoader(data, sampler=Stateful(24), batch_size=6, rank=r, world_size=3)
        for r in range(3)
    ]
    for x in trio:
        x.load_state_dict(pair[0].state_dict())
    for parts in zip(*trio, strict=True):
        seen += sum((p.tolist() for p in parts), [])
    assert seen == whole
