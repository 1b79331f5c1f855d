"""Compare two run directories: every tracked tensor and all JSON state at every checkpoint step
both hold, and the per-step metrics log.

Fields that measure time (``counters.train_seconds``, the Trainer's ``*_runtime`` and
``*_per_second`` log entries, ...: :mod:`._volatile`) and what ``ignore`` names are left out,
and listed (``Comparison.not_compared``). The first step after each resume (from the interrupted
run's ``resume`` events) is kept key by key for the hints: which logged values agree there.

Tensors are compared bitwise by default (``-0.0`` differs from ``0.0``, a NaN equals the same
NaN), or with ``atol``/``rtol``. The walk follows each component's JSON tree, so keys come out in
the order the checkpoint stores them (``optimizer.param_groups.0.lr`` before
``optimizer.state.0.weight.exp_avg``) and tensors are named by their path with dots.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import CheckpointError
from ..store import CheckpointReader, scan
from ..train import read_metrics
from ._findings import Comparison, Difference
from ._unverifiable import VerifyError
from ._volatile import VOLATILE, NotCompared, collapse, volatile_rule

# At one step, the component whose difference most likely *causes* the others comes first.
_KIND_ORDER = ("counters", "loader", "rng", "generator", "module", "optimizer", "stateful")
_CLASS_ORDER = {"length": 0, "missing": 0, "unreadable": 0, "state": 1, "tensor": 2, "metric": 3}


def compare_runs(
    ref_dir: str | os.PathLike[str],
    other_dir: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    ignore: Iterable[str] = (),
) -> Comparison:
    """Compare two existing run directories (``ref_dir`` is the uninterrupted one).

    ``ignore`` holds ``COMPONENT`` or ``COMPONENT.KEY`` prefixes (``rng.python``,
    ``metrics.throughput``); fields that measure time (:data:`VOLATILE`) are always left out.
    Both are listed in ``not_compared``. Raises :class:`VerifyError` when the two hold no
    checkpoint step in common and no metrics log::

        cmp = compare_runs("runs/a", "runs/b")
        assert cmp.passed, cmp.first_difference.describe()
    """
    ref, other = os.fspath(ref_dir), os.fspath(other_dir)
    for run_dir in (ref, other):
        if not os.path.isdir(run_dir):
            raise VerifyError(f"{run_dir} is not a run directory")
    w = _Walker(atol, rtol, ignore)
    ref_steps = {s: p for s, p in scan(ref)}
    other_steps = {s: p for s, p in scan(other)}
    shared = sorted(ref_steps.keys() & other_steps.keys())
    kinds: dict[str, str] = {}
    schedulers: list[str] = []
    untracked: dict[str, list[str]] = {}
    world_size = 1
    if ref_steps:
        kinds, schedulers, untracked, world_size = _components(ref_steps[max(ref_steps)])
    found: dict[str, Difference] = {}
    for step in shared:
        for d in _compare_step(step, ref_steps[step], other_steps[step], w):
            found.setdefault(d.component, d)
    if ref_steps and other_steps and max(ref_steps) != max(other_steps):
        end = min(max(ref_steps), max(other_steps))
        ends = (f"ends at step {max(ref_steps)}", f"ends at step {max(other_steps)}")
        found.setdefault("checkpoints", Difference(end, "checkpoints", "", "length", *ends))
    logs = _Logs(ref, other)
    n_metrics, metric_diffs = _compare_metrics(logs, w)
    if not shared and n_metrics == 0 and not metric_diffs:
        raise VerifyError(
            f"{ref} and {other} hold no checkpoint step in common and no metrics log to compare"
        )
    diffs = sorted(found.values(), key=lambda d: _order(d, kinds)) + metric_diffs
    diffs.sort(key=lambda d: d.step)  # stable: within a step, the order above stays
    audit = [e for e in logs.events if e.get("event") == "audit"]
    cmp = Comparison(shared, n_metrics, diffs, kinds, schedulers, untracked, audit)
    cmp.step_counts = list(dict.fromkeys(w.step_counts))
    cmp.world_size = world_size
    cmp.resumes = logs.resumes
    cmp.after_resume = _after_resume(logs, w)
    cmp.not_compared = list(w.skipped.values())
    return cmp


class _Logs:
    """Both metrics logs: step records (None where a run has no log) and their events."""

    def __init__(self, ref: str, other: str) -> None:
        self.records: list[list[dict[str, Any]] | None] = []
        self.events: list[dict[str, Any]] = []
        for d in (ref, other):
            try:
                entries = read_metrics(d, events=True)
            except FileNotFoundError:
                self.records.append(None)
                continue
            self.records.append([e for e in entries if "event" not in e])
            self.events += [e for e in entries if "event" in e]
        # The interrupted run's resumes that took effect: a resume truncates the log to its
        # checkpoint's offset, so those superseded by a resume from an earlier step are gone.
        steps = [e.get("step") for e in self.events if e.get("event") == "resume"]
        self.resumes = sorted({s for s in steps if isinstance(s, int) and s > 0})


def _step_of(rec: dict[str, Any], i: int) -> int:
    return rec["step"] if isinstance(rec.get("step"), int) else i + 1


def _after_resume(logs: _Logs, w: _Walker) -> dict[int, dict[str, bool]]:
    """For the first step after each resume: which logged values agree."""
    ma, mb = logs.records
    if not ma or not mb or w.ignored("metrics"):
        return {}
    wanted = {r + 1 for r in logs.resumes}
    rows_a = {_step_of(r, i): r for i, r in enumerate(ma) if _step_of(r, i) in wanted}
    rows_b = {_step_of(r, i): r for i, r in enumerate(mb) if _step_of(r, i) in wanted}
    out: dict[int, dict[str, bool]] = {}
    for step in sorted(rows_a.keys() & rows_b.keys()):
        ra, rb = rows_a[step], rows_b[step]
        row: dict[str, bool] = {}
        for key in [*ra, *(k for k in rb if k not in ra)]:
            if key in ("step", "epoch") or w.ignored(f"metrics.{key}"):
                continue
            found: list[Any] = []
            if key in ra and key in rb:
                w.walk(ra[key], rb[key], f"metrics.{key}", found, limit=1)
            row[key] = key in ra and key in rb and not found
        out[step] = row
    return out


def _order(d: Difference, kinds: dict[str, str]) -> tuple[int, int, int, str]:
    kind = kinds.get(d.component.split("@", 1)[0], "stateful")
    rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
    return (d.step, _CLASS_ORDER.get(d.kind, 9), rank, d.component)


def _components(path: str) -> tuple[dict[str, str], list[str], dict[str, list[str]], int]:
    try:
        reader = CheckpointReader(path)
        comps = reader.components
        trees = reader.global_trees()
        world_size = reader.world_size
    except CheckpointError:
        return {}, [], {}, 1
    kinds = {name: str(c.get("kind", "stateful")) for name, c in comps.items()}
    schedulers = [
        n for n, t in trees.items() if isinstance(t, dict) and {"base_lrs", "last_epoch"} <= set(t)
    ]
    untracked: dict[str, list[str]] = {}
    for name, kind in kinds.items():
        tree = trees.get(name)
        groups = (
            tree.get("param_groups") if kind == "optimizer" and isinstance(tree, dict) else None
        )
        if isinstance(groups, list):
            keys = [p for g in groups if isinstance(g, dict) for p in g.get("params", [])]
            lost = [k for k in keys if isinstance(k, str) and k.startswith("#")]
            if lost:
                untracked[name] = lost
    return kinds, schedulers, untracked, world_size


def _open(path: str) -> CheckpointReader:
    reader = CheckpointReader(path)
    reader.verify(checksums=True)
    return reader


def _load(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    tensors = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in reader.tensor_infos().items()}
    reader.load_tensors(tensors)
    return tensors


def _trees(reader: CheckpointReader, ranks: int) -> dict[str, Any]:
    trees = dict(reader.global_trees())
    for r in range(ranks):
        for name, tree in (reader.local_trees(r) or {}).items():
            trees[name if r == 0 else f"{name}@rank{r}"] = tree
    return trees


def _compare_step(step: int, ref_path: str, other_path: str, w: _Walker) -> list[Difference]:
    readers = []
    for i, path in enumerate((ref_path, other_path)):
        try:
            readers.append(_open(path))
        except CheckpointError as e:
            why = str(e)[:200]
            ref_side, other_side = (why, "readable") if i == 0 else ("readable", why)
            return [Difference(step, "checkpoints", "", "unreadable", ref_side, other_side)]
    a, b = readers
    ranks = min(a.world_size, b.world_size)
    trees_a, trees_b = _trees(a, ranks), _trees(b, ranks)
    w.tensors = (_load(a), _load(b))
    out = []
    for name in [*trees_a, *(n for n in trees_b if n not in trees_a)]:
        if w.ignored(name):
            continue
        if name not in trees_a or name not in trees_b:
            have = "tracked" if name in trees_a else "absent"
            out.append(Difference(step, name, "", "missing", have, _flip(have)))
            continue
        diffs: list[tuple[str, str, str, str, float | None]] = []
        w.walk(trees_a[name], trees_b[name], name, diffs, limit=1)
        if diffs:
            path, kind, ra, rb, mad = diffs[0]
            key = path[len(name) + 1 :]  # the component's name may hold dots (callback.Timer)
            out.append(Difference(step, name, key, kind, ra, rb, mad))
            _step_count(trees_a[name], trees_b[name], name, w)
    w.tensors = ({}, {})
    return out


def _step_count(a: Any, b: Any, name: str, w: _Walker) -> None:
    """For an optimizer that differs: whether its step counter does (evidence for the hints;
    the walk above stops at the first key, and ``exp_avg`` sorts before ``step``)."""
    if not (isinstance(a, dict) and isinstance(b, dict) and "param_groups" in a):
        return
    sa, sb = a.get("state"), b.get("state")
    if not (isinstance(sa, dict) and isinstance(sb, dict)):
        return
    for param, entry in sa.items():
        other = sb.get(param)
        if isinstance(entry, dict) and isinstance(other, dict) and "step" in entry:
            found: list[Any] = []
            w.walk(entry["step"], other.get("step"), f"{name}.state.{param}.step", found, limit=1)
            if found:
                w.step_counts.append(f"{name}.state.{param}.step")
            return


def _flip(have: str) -> str:
    return "absent" if have == "tracked" else "tracked"


def _compare_metrics(logs: _Logs, w: _Walker) -> tuple[int, list[Difference]]:
    if w.ignored("metrics"):
        return 0, []
    ma, mb = logs.records
    if ma is None and mb is None:
        return 0, []
    if ma is None or mb is None:
        have = "absent" if ma is None else "present"
        return 0, [Difference(0, "metrics", "", "missing", have, _flip_log(have))]
    seen: dict[str, Difference] = {}
    for i, (ra, rb) in enumerate(zip(ma, mb, strict=False)):
        step = _step_of(ra, i)
        for key in [*ra, *(k for k in rb if k not in ra)]:
            if key in seen or w.ignored(f"metrics.{key}"):
                continue
            diffs: list[tuple[str, str, str, str, float | None]] = []
            if key not in ra or key not in rb:
                diffs.append(("", "metric", _short(ra.get(key)), _short(rb.get(key)), None))
            else:
                w.walk(ra[key], rb[key], f"metrics.{key}", diffs, limit=1)
            if diffs:
                _, _, va, vb, _ = diffs[0]
                seen[key] = Difference(step, "metrics", key, "metric", va, vb)
    out = list(seen.values())
    if len(ma) != len(mb):
        n = min(len(ma), len(mb))
        out.append(
            Difference(n + 1, "metrics", "", "length", f"{len(ma)} steps", f"{len(mb)} steps")
        )
    return min(len(ma), len(mb)), out


def _flip_log(have: str) -> str:
    return "present" if have == "absent" else "absent"


class _Walker:
    """Walks two JSON trees side by side; ``$tensor`` leaves compare the loaded tensors."""

    def __init__(self, atol: float, rtol: float, ignore: Iterable[str]) -> None:
        self.atol, self.rtol = float(atol), float(rtol)
        self.exact = self.atol == 0 and self.rtol == 0
        self.ignore = tuple(ignore)
        self.tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self.step_counts: list[str] = []
        self.skipped: dict[str, NotCompared] = {}  # what was left out, by listed path

    def ignored(self, path: str) -> bool:
        """Whether ``path`` is left out (named by ``ignore``, or volatile); noted if so."""
        base = _strip_rank(path)
        for p in self.ignore:
            if base == p or base.startswith(p + "."):
                if p not in self.skipped:
                    self.skipped[p] = NotCompared(p, "--ignore", "left out on request")
                return True
        rule = volatile_rule(base)
        if rule is None:
            return False
        shown = collapse(base)
        if shown not in self.skipped:
            self.skipped[shown] = NotCompared(shown, rule.source, rule.why)
        return True

    def walk(self, a: Any, b: Any, path: str, out: list[Any], limit: int) -> None:
        if len(out) >= limit or self.ignored(path):
            return
        ma, mb = _marker(a), _marker(b)
        if ma is not None or mb is not None:
            if ma != mb:
                out.append(_leaf(path, "state", a, b))
            elif ma == "$tensor":
                self._tensor(path, a["$tensor"], b["$tensor"], out)
            elif ma in ("$tuple", "$dict") and isinstance(a[ma], list) and isinstance(b[ma], list):
                self.walk(a[ma], b[ma], path, out, limit)
            elif a != b:
                out.append(_leaf(path, "state", a, b))
        elif isinstance(a, dict) and isinstance(b, dict):
            for k in [*a, *(k for k in b if k not in a)]:
                if (k not in a or k not in b) and self.ignored(f"{path}.{k}"):
                    continue
                if k not in a or k not in b:
                    out.append(_leaf(f"{path}.{k}", "state", a.get(k), b.get(k)))
                else:
                    self.walk(a[k], b[k], f"{path}.{k}", out, limit)
                if len(out) >= limit:
                    return
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(_leaf(path, "state", f"{len(a)} items", f"{len(b)} items"))
                return
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                self.walk(x, y, f"{path}.{i}", out, limit)
                if len(out) >= limit:
                    return
        elif not self._same_scalar(a, b):
            out.append(_leaf(path, "state", a, b))

    def _same_scalar(self, a: Any, b: Any) -> bool:
        if type(a) is not type(b) and not (_is_num(a) and _is_num(b)):
            return False
        if isinstance(a, float) or isinstance(b, float):
            x, y = float(a), float(b)
            if math.isnan(x) or math.isnan(y):
                return math.isnan(x) and math.isnan(y)
            if self.exact:
                return x == y and math.copysign(1, x) == math.copysign(1, y)
            return math.isclose(x, y, rel_tol=self.rtol, abs_tol=self.atol)
        return bool(a == b)

    def _tensor(self, path: str, name_a: str, name_b: str, out: list[Any]) -> None:
        ta, tb = self.tensors[0].get(name_a), self.tensors[1].get(name_b)
        if ta is None or tb is None:
            have = ("absent" if ta is None else "present", "absent" if tb is None else "present")
            out.append(_leaf(path, "tensor", *have))
            return
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            out.append(_leaf(path, "tensor", _describe(ta), _describe(tb)))
            return
        if _tensors_equal(ta, tb, self.exact, self.atol, self.rtol):
            return
        out.append((path, "tensor", _describe(ta), _describe(tb), _max_abs_diff(ta, tb)))


def _tensors_equal(a: torch.Tensor, b: torch.Tensor, exact: bool, atol: float, rtol: float) -> bool:
    if exact or not (a.is_floating_point() or a.is_complex()):
        if a.numel() == 0:
            return True
        return torch.equal(_bits(a), _bits(b))
    wide = torch.complex128 if a.is_complex() else torch.float64
    return bool(torch.allclose(a.to(wide), b.to(wide), rtol=rtol, atol=atol, equal_nan=True))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes: bit-for-bit equality, so NaN payloads and the sign of zero count."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.numel() == 0:
        return None
    if a.is_complex():
        d = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    elif a.dtype == torch.bool:
        d = (a != b).double()
    else:
        d = (a.double() - b.double()).abs()
    d = d[~torch.isnan(d)]
    return float(d.max()) if d.numel() else float("nan")


def _describe(t: torch.Tensor) -> str:
    shape = "x".join(map(str, t.shape)) or "scalar"
    if t.numel() == 1:
        return f"{t.reshape(-1)[0].item()!r} ({str(t.dtype).removeprefix('torch.')})"
    return f"{shape} {str(t.dtype).removeprefix('torch.')}"


def _marker(v: Any) -> str | None:
    if isinstance(v, dict) and len(v) == 1:
        (k,) = v
        if isinstance(k, str) and k.startswith("$"):
            return k
    return None


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _strip_rank(path: str) -> str:
    head, dot, rest = path.partition(".")
    return head.split("@", 1)[0] + dot + rest


def _leaf(path: str, kind: str, a: Any, b: Any) -> tuple[str, str, str, str, None]:
    """(the full dotted path, kind, both values shortened, no max |Δ|)."""
    return (path, kind, _short(a), _short(b), None)


def _short(v: Any, limit: int = 80) -> str:
    if _marker(v) == "$bytes" and isinstance(v["$bytes"], str):  # a random stream's state, say
        return f"<bytes, crc32 {zlib.crc32(v['$bytes'].encode()):08x}>"
    if isinstance(v, str):
        text = v
    else:
        try:
            text = json.dumps(v, sort_keys=True)
        except (TypeError, ValueError):
            text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["VOLATILE", "Comparison", "Difference", "NotCompared", "compare_runs"]
