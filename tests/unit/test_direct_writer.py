"""The pipelined writer of store/_direct.py across many stages.

The suite's states are a few MB, so every real save fits in the first stage; here the stages
are shrunk to a few KiB so that one file goes through dozens of them: tensors split across
stages, alignment gaps at a stage's end, the short first stage, the padded last one.
"""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from unbroken.store import _direct
from unbroken.store._format import ALIGN


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = [
        ("empty", torch.empty(0)),
        ("one_byte", torch.tensor([200], dtype=torch.uint8)),
        ("three", torch.randn(3, generator=g)),
        ("bigger_than_a_stage", torch.randn(5000, generator=g)),  # 20 000 bytes
        ("transposed", torch.randn(37, 53, generator=g, dtype=torch.float64).t()),
        ("odd_bf16", torch.randn(1001, generator=g).to(torch.bfloat16)),
        ("ints", torch.randint(-(2**40), 2**40, (777,), generator=g)),
    ]
    out += [(f"small{i}", torch.randn(i * 13 + 1, generator=g)) for i in range(40)]
    return out


@pytest.fixture
def small_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_direct, "STAGE_BYTES", 16 << 10)
    monkeypatch.setattr(_direct, "FIRST_BYTES", 4 << 10)
    monkeypatch.setattr(_direct, "STAGES", 3)
    monkeypatch.setattr(_direct, "_stages", _direct._Stages())


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_many_stages_round_trip(
    tmp_path: os.PathLike, small_stages: None, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not direct:
        monkeypatch.setattr(_direct, "_NO_DIRECT", {os.stat(tmp_path).st_dev})
    path = os.path.join(tmp_path, "data.bin")
    tensors = _tensors()
    if direct:
        fd, used = _direct._open_for_write(os.path.join(tmp_path, "probe"))
        os.close(fd)
        assert used, f"{tmp_path} refuses O_DIRECT: this test needs a disk-backed temp dir"
    placed, size = _direct.write_chunks(path, tensors)

    raw = open(path, "rb").read()
    assert len(raw) == size == os.path.getsize(path)
    assert [k for k, *_ in placed] == [k for k, _ in tensors]
    end = 0
    for (key, offset, nbytes, digest), (_, t) in zip(placed, tensors, strict=True):
        want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert offset % ALIGN == 0 and offset >= end, key
        assert raw[end:offset] == bytes(offset - end), f"gap before {key} is not zeros"
        assert nbytes == len(want), key
        assert raw[offset : offset + nbytes] == want, key
        assert digest == xxhash.xxh3_64_hexdigest(want), key
        end = offset + nbytes
    assert size == end  # the last stage's block padding is truncated away
    assert end > 5 * (16 << 10)  # the file did go through many stages


def test_stages_start_on_huge_page_boundaries(small_stages: None) -> None:
    _direct._stages.ensure()
    ptrs = [t.data_ptr() for t in _direct._stages.tensors]
    assert len(ptrs) == _direct.STAGES
    assert ptrs[0] % _direct.HUGE == 0
    assert all(b - a == _direct.STAGE_BYTES for a, b in zip(ptrs, ptrs[1:], strict=False))
    for i, t in enumerate(_direct._stages.tensors):  # the memoryview and the tensor agree
        t.fill_(i + 1)
        assert bytes(_direct._stages.view(i)[:4]) == bytes([i + 1]) * 4
