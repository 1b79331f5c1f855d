"""``run.step()``'s fast path writes and decides exactly what the plain path did: the metrics
lines byte for byte (one reused C encoder against ``json.dumps`` a record), the logged loss bit
for bit (a float32 CPU loss read without ``.detach().float()``), the trigger decisions (no clock
and no ``decide()`` when nothing is due) and a stop signal at the next step."""

from __future__ import annotations

import json
import math
import signal
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unbroken
from unbroken import RunConfig
from unbroken.train import _metrics, _triggers
from unbroken.train._metrics import plain

TRICKY: list[Any] = [
    0,
    -1,
    2**70,
    -(2**70),
    2**63 - 1,
    0.0,
    -0.0,
    1e-320,  # subnormal
    5e-324,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    0.1,
    1 / 3,
    1e16,
    1e22,
    123456789.123456789,
    2.5e-7,
    float("nan"),
    float("inf"),
    float("-inf"),
    True,
    False,
    None,
    "",
    'say "hi"\\ \n\t\x00\x1f',
    "ünïcødé ☃ \U0001f600 \u2028",
    "</script>",
]


def _old(records: list[dict[str, Any]]) -> list[str]:
    """What the metrics log wrote before the fast path: json.dumps of each record."""
    return [json.dumps({k: plain(v) for k, v in r.items()}, allow_nan=True) + "\n" for r in records]


def _records() -> list[dict[str, Any]]:
    shared = [1.5, "x"]
    recs: list[dict[str, Any]] = [{"step": i, "epoch": 0, "loss": v} for i, v in enumerate(TRICKY)]
    recs.append({k: v for k, v in zip((f"k{i}" for i in range(99)), TRICKY, strict=False)})
    recs += [
        {"event": "resume", "time": 1733612345.123, "step": 7},
        {'ключ "q"': 1, "": 2.0, "tab\t": None},
        {},
        {"step": 1, "lst": shared, "again": shared, "d": {"a": [float("nan"), -0.0]}},
        {"step": 2, "t": torch.tensor(0.25), "v": torch.tensor([1.0, float("inf")])},
        {"step": 3, "h": torch.tensor(0.1, dtype=torch.float16), "b": torch.tensor(3)},
        {"step": 4, "np": np.float32(0.1), "np64": np.float64(-0.0), "ni": np.int64(2**40)},
        {"step": 5, "flag": np.bool_(True), "arr": np.array([1.5, 2.5]).tolist()},
        {"step": 6, 7: "int key", 1.5: "float key", True: "bool key", None: "none key"},
        # run.step()'s shape (spelled by an f-string) and its near misses (the encoder)
        {"step": True, "epoch": 0, "loss": 0.5},
        {"step": 2**70, "epoch": -3, "loss": -1e-300},
        {"step": 1, "epoch": 0.0, "loss": 0.5},
        {"step": 1, "epoch": 0, "loss": 1},
        {"epoch": 0, "step": 1, "loss": 0.5},
        {"step": 1, "epoch": 0, "lost": 0.5},
        {"step": 1, "epoch": 0, "loss": np.float64(0.1)},
    ]
    return recs


def test_lines_are_json_dumps_byte_for_byte() -> None:
    recs = _records()
    expected = _old([dict(r) for r in recs])
    got = _metrics.lines([dict(r) for r in recs])
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.encode() == e.encode()


@pytest.mark.parametrize("value", TRICKY, ids=repr)
def test_each_tricky_value_alone(value: Any) -> None:
    rec = {"step": 1, "epoch": 2, "loss": value, value if isinstance(value, str) else "s": value}
    assert _metrics.lines([dict(rec)]) == _old([dict(rec)])


def test_lines_without_the_c_encoder(monkeypatch) -> None:
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    recs = _records()
    assert _metrics.lines([dict(r) for r in recs]) == _old([dict(r) for r in recs])


def test_random_floats_and_ints_byte_for_byte() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**64, size=3000, dtype=np.uint64)
    floats = [struct.unpack("<d", int(b).to_bytes(8, "little"))[0] for b in bits]
    floats += [float(np.float32(f)) for f in rng.standard_normal(1000)]
    ints = [int(i) for i in rng.integers(-(2**62), 2**62, size=500)]
    recs = [{"step": i, "epoch": i % 7, "loss": f} for i, f in enumerate(floats)]
    recs += [{"step": i, "loss": f} for i, f in enumerate(floats[:100])]
    recs += [{"step": i, "n": n} for i, n in enumerate(ints)]
    assert _metrics.lines([dict(r) for r in recs]) == _old([dict(r) for r in recs])


def test_errors_are_json_dumps_errors() -> None:
    loop: list[Any] = []
    loop.append(loop)
    for bad in ({"step": 1, "x": loop}, {"step": 1, "x": object()}):
        with pytest.raises(Exception) as old:
            _old([bad])
        with pytest.raises(Exception) as new:
            _metrics.lines([bad])
        assert type(new.value) is type(old.value) and str(new.value) == str(old.value)


def test_the_file_holds_the_same_bytes(tmp_path: Path) -> None:
    log = _metrics.MetricsLog(str(tmp_path), None)
    recs = _records()
    expected = "".join(_old([dict(r) for r in recs])).encode()
    for r in recs:
        log.step(dict(r))
    log.close()
    assert (tmp_path / _metrics.METRICS_FILE).read_bytes() == expected


# ---- the loss ---------------------------------------------------------------------------------


def _old_loss(loss: torch.Tensor) -> float:
    t = loss.detach().float()
    return (t if t.numel() == 1 else t.mean()).item()


LOSSES = [
    torch.tensor(2.302585092994046),
    torch.tensor([0.1]),
    torch.tensor([[1 / 3]]),
    torch.tensor(-0.0),
    torch.tensor(float("nan")),
    torch.tensor(float("inf")),
    torch.tensor(1e-40),  # a float32 subnormal
    torch.tensor(0.1, dtype=torch.float16),
    torch.tensor(0.1, dtype=torch.bfloat16),
    torch.tensor(0.1, dtype=torch.float64),
    torch.tensor(1e-320, dtype=torch.float64),
    torch.tensor([0.1, 0.2, 0.3]),
    torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64),
    torch.tensor([0.1, 0.2, 0.3], dtype=torch.float16),
    torch.tensor([[0.1, 0.2], [0.3, 1e-3]], dtype=torch.bfloat16),
    torch.tensor(3),
    torch.arange(12.0).reshape(3, 4)[:, 1],  # not contiguous
]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.mark.parametrize("grad", [False, True])
def test_logged_loss_is_the_old_paths_bit_for_bit(tmp_path: Path, grad: bool) -> None:
    model = torch.nn.Linear(2, 1)
    run = unbroken.Run(tmp_path, model=model, progress=False, save_final=False)
    expected = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "requires_grad ... to a scalar" warning
        for loss in LOSSES:
            if grad and loss.is_floating_point():
                loss = (loss.clone().requires_grad_(True) * 1).reshape(loss.shape)
            expected.append(_old_loss(loss))
            run.step(loss=loss)
    run.close()
    got = [r["loss"] for r in unbroken.read_metrics(str(tmp_path))]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert _bits(g) == _bits(e) or (math.isnan(g) and math.isnan(e))
    text = (tmp_path / _metrics.METRICS_FILE).read_text()
    lines = [ln for ln in text.splitlines() if '"step"' in ln and '"event"' not in ln]
    assert lines == [
        json.dumps({"step": i + 1, "epoch": 0, "loss": e}, allow_nan=True)
        for i, e in enumerate(expected)
    ]


# ---- the triggers -----------------------------------------------------------------------------


@pytest.mark.parametrize("every", [None, 1, 3])
def test_nothing_seen_decides_as_decide(every: int | None) -> None:
    for final in (False, True):
        cfg = RunConfig(save_every=every, save_final=final)
        for step in range(1, 20):
            d = _triggers.decide(cfg, step, _triggers.NOTHING, complete=False)
            fast = _triggers.SAVE if _triggers.step_due(cfg, step) else _triggers.GO_ON
            assert d == fast
    assert _triggers.NOTHING == _triggers.observe(RunConfig(), _triggers.Clock(0.0, 0.0), False)
    assert _triggers.SIGNALLED == _triggers.observe(RunConfig(), _triggers.Clock(0.0, 0.0), True)


def test_a_signal_stops_the_next_step_with_a_checkpoint(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    run = unbroken.Run(
        tmp_path, model=model, progress=False, handle_signals=False, exit_on_stop=False
    )
    for _ in range(3):
        assert run.step(loss=torch.tensor(1.0)) is False
    run._stop.record(signal.SIGTERM)  # what the handler does
    assert run.step(loss=torch.tensor(1.0)) is True
    assert run.stopped and run.closed and run.last_saved_step == 4
    events = [m for m in unbroken.read_metrics(str(tmp_path), events=True) if "event" in m]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "signal SIGTERM"


def test_the_fast_path_skips_the_clock_only_without_timed_triggers(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    run = unbroken.Run(tmp_path / "a", model=model, progress=False, save_final=False)
    seen: list[Any] = []
    run._clock = lambda: seen.append(1)  # type: ignore[method-assign]
    run.step()
    run.close()
    assert seen == []
    run = unbroken.Run(
        tmp_path / "b", model=model, progress=False, save_final=False, save_every_minutes=5
    )
    calls = 0
    clock = run._clock

    def counted() -> _triggers.Clock:
        nonlocal calls
        calls += 1
        return clock()

    run._clock = counted  # type: ignore[method-assign]
    run.step()
    run.close()
    assert calls == 1


def test_a_background_saver_is_still_checked_every_step(tmp_path: Path, monkeypatch) -> None:
    model = torch.nn.Linear(2, 1)
    quiet = unbroken.Run(tmp_path / "a", model=model, progress=False, save_final=False)
    assert not quiet._background
    quiet.close()
    run = unbroken.Run(
        tmp_path / "b", model=model, progress=False, save_final=False, async_save=True
    )
    assert run._background
    calls: list[int] = []
    monkeypatch.setattr(run._checkpointer, "check", lambda: calls.append(run.counters.step))
    run.step()
    run.step()
    run.close()
    assert calls == [0, 1]  # before each step is counted: a failed save is raised there


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
