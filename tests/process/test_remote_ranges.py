"""How a remote load and fetch cut a checkpoint into ranged GETs, and what they refuse.

A load cuts a data file's wanted bytes into equal ranges wherever chunks begin and end
(store/_object_reader.ranges): a GET feeds the end of one tensor and the start of the next, and
a tensor split across GETs is hashed when its last piece lands. A fetch hashes every byte as it
downloads it and commits only when every checksum is the manifest's. Here the part size is
shrunk to a few hundred bytes after the upload, so that a small checkpoint crosses every case
(tensors split, grouped, staged through another dtype, skipped), against the real S3 server.
"""

from __future__ import annotations

import os
import random

import boto3
import pytest
import torch

import unbroken
from unbroken import CorruptCheckpointError
from unbroken.errors import RemoteStoreError
from unbroken.store import CheckpointReader
from unbroken.store.remote import _object_reader, _s3
from unbroken.store.remote._bucket import RemoteStore
from unbroken.store.remote._object_reader import ranges


@pytest.fixture
def small_parts(monkeypatch):
    def use(part: int, gap: int = _object_reader.MAX_GAP) -> None:
        monkeypatch.setattr(_s3, "PART_BYTES", part)
        monkeypatch.setattr(_object_reader, "MAX_GAP", gap)

    return use


def saved(tmp_path, url):
    """A committed local checkpoint of tensors of many sizes, uploaded to ``url``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 30)).sum().backward()
    opt.step()
    run = unbroken.Run(str(tmp_path / "src"), model=model, optimizer=opt, handle_signals=False)
    for i in range(3):
        run.step(loss=float(i))  # a metrics log to upload with it
    path = run.save()
    run.close()
    RemoteStore(url).upload(path, metrics_log=str(tmp_path / "src" / "metrics.jsonl"))
    return path


def local_tensors(path):
    reader = CheckpointReader(path)
    out = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in reader.tensor_infos().items()}
    reader.load_tensors(out)
    return out


def chunk_of(reader, fqn):
    reader.tensor_infos()  # parses the table
    (chunk,) = reader._table[fqn].chunks
    return chunk


def flip(bucket, key, at):
    c = boto3.session.Session().client("s3")
    raw = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[at] ^= 1
    c.put_object(Bucket=bucket, Key=key, Body=bytes(raw))


def test_ranges_read_every_wanted_byte_once_in_bounded_gets(small_parts):
    rnd = random.Random(0)
    for _ in range(500):
        part, gap = rnd.choice([8, 16, 100]), rnd.choice([0, 3, 50])
        small_parts(part, gap)
        spans, pos = [], rnd.randint(0, 20)
        for _ in range(rnd.randint(0, 12)):
            pos += rnd.choice([0, 0, 1, 5, 60, 200])
            n = rnd.randint(1, 300)
            spans.append((pos, n))
            pos += n
        seen: set[tuple[int, int]] = set()
        for start, parts in ranges(spans):
            at = start
            for k, lo, hi in parts:
                begin = spans[k][0] + lo
                assert 0 <= begin - at <= gap  # in file order; only small gaps read through
                at = spans[k][0] + hi
                new = {(k, b) for b in range(lo, hi)}
                assert not new & seen
                seen |= new
            assert at - start <= part
        assert seen == {(k, b) for k, (_, n) in enumerate(spans) for b in range(n)}


def test_a_load_cut_across_tensors_fills_each_one_exactly(s3, tmp_path, small_parts):
    path = saved(tmp_path, s3.url)
    want = local_tensors(path)
    small_parts(300)
    s3.proxy.reset()
    reader = RemoteStore(s3.url).latest()
    assert reader is not None
    direct = {k: torch.full_like(t, -1.0) for k, t in want.items()}
    reader.load_tensors(direct)
    staged = {k: torch.zeros(t.shape, dtype=torch.float64) for k, t in want.items()}
    reader.load_tensors(staged)  # another dtype: through a staging tensor, then copied
    for k, t in want.items():
        assert torch.equal(direct[k], t), k
        assert torch.equal(staged[k], t.to(torch.float64)), k
    data = sum(c.nbytes for e in reader._table.values() for c in e.chunks)
    gets = s3.proxy.requests(r"^GET .*tensors-r00000.bin")
    assert len(gets) >= 2 * -(-data // 300)  # two loads, no GET over a part


def test_a_load_of_a_few_tensors_skips_the_bytes_between_them(s3, tmp_path, small_parts):
    path = saved(tmp_path, s3.url)
    want = local_tensors(path)
    small_parts(300, gap=0)
    reader = RemoteStore(s3.url).latest()
    assert reader is not None
    names = ["model/0.bias", "optimizer/state/1.weight/exp_avg_sq"]
    assert all(n in want for n in names)
    got = {n: torch.empty_like(want[n]) for n in names}
    reader.load_tensors(got)
    for n in names:
        assert torch.equal(got[n], want[n]), n


def test_a_flipped_byte_in_a_tensor_split_across_gets_names_it(s3, tmp_path, small_parts):
    saved(tmp_path, s3.url)
    reader = RemoteStore(s3.url).latest()
    assert reader is not None
    small_parts(300)
    chunk = chunk_of(reader, "model/0.weight")
    assert chunk.nbytes > 2 * 300
    flip(s3.bucket, f"run/checkpoints/step-{reader.step:09d}/{chunk.file}", chunk.offset + 400)
    targets = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in reader.tensor_infos().items()}
    with pytest.raises(CorruptCheckpointError, match="model/0.weight"):
        reader.load_tensors(targets)


@pytest.mark.parametrize(
    "name", ["tensors-r00000.bin", "state.json", "rank-00000.json", "metrics.jsonl"]
)
def test_a_fetch_that_downloads_a_flipped_byte_commits_nothing(s3, tmp_path, small_parts, name):
    path = saved(tmp_path, s3.url)
    manifest = CheckpointReader(path).manifest
    small_parts(300)
    step = manifest["step"]
    listed = RemoteStore(s3.url).open(step).manifest["files"]
    assert name in listed
    at = listed[name]["size"] // 2
    if name.startswith("tensors-"):
        chunk = chunk_of(CheckpointReader(path), "model/0.weight")
        at = chunk.offset + 400  # inside a tensor split across GETs
    flip(s3.bucket, f"run/checkpoints/step-{step:09d}/{name}", at)
    run_dir = tmp_path / "fresh"
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        RemoteStore(s3.url).fetch(step, str(run_dir))
    assert os.listdir(run_dir / "checkpoints") == []  # neither committed nor left half-made
    assert not os.path.exists(run_dir / "metrics.jsonl")


def test_a_fetch_cut_across_tensors_commits_the_same_bytes(s3, tmp_path, small_parts):
    path = saved(tmp_path, s3.url)
    small_parts(300)
    s3.proxy.fail_next(2, 500, match=r"^GET .*tensors-r00000.bin")  # retried
    step = CheckpointReader(path).step
    got = RemoteStore(s3.url).fetch(step, str(tmp_path / "fresh"))
    for name in sorted(set(os.listdir(path)) - {"manifest.json"}):  # remote's lists the log
        with open(os.path.join(path, name), "rb") as a, open(os.path.join(got, name), "rb") as b:
            assert a.read() == b.read(), name
    CheckpointReader(got).verify(checksums=True)
    assert all(times == 0 for _, _, times in s3.proxy.fail), "a fault point was not reached"


def test_a_fetch_from_a_failing_store_names_it_and_commits_nothing(s3, tmp_path, small_parts):
    path = saved(tmp_path, s3.url)
    small_parts(300)
    s3.proxy.fail_next(1000, 503, match=r"^GET .*tensors-r00000.bin")
    run_dir = tmp_path / "fresh"
    with pytest.raises(RemoteStoreError, match="ServiceUnavailable"):
        RemoteStore(s3.url).fetch(CheckpointReader(path).step, str(run_dir))
    assert os.listdir(run_dir / "checkpoints") == []
