"""``unbroken diff CKPT_A CKPT_B``: compare two checkpoints component by component -- every tensor
(bitwise, or within --atol/--rtol) and every saved value, global and per rank -- and name the
first difference.

Components are compared in name order, the entries of each in the order they were saved; the
first differing entry of the first differing component is "the first difference"; the first
differing tensor is named too.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ..process._exit import EXIT_FAILURE, EXIT_OK
from . import _weights

if TYPE_CHECKING:
    import torch

    from ..store import CheckpointReader

EPILOG = """CKPT_A and CKPT_B are checkpoint directories or run directories (their newest valid
checkpoint).

exit codes: 0 identical (or within the tolerances), 1 they differ (or one is corrupt or
            unsafe: the message on stderr names the file), 2 usage error, 3 no valid checkpoint

example: unbroken diff runs/a/checkpoints/step-000001000 runs/b --ignore rng --json"""

MAX_LISTED = 20  # differences listed per component (all are counted)
BATCH_BYTES = 256 << 20  # tensors are loaded in groups of about this size, per side


def register(sub: Any) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two checkpoints: every component, first differing tensor named",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="CKPT_A", help="a checkpoint or run directory")
    p.add_argument("b", metavar="CKPT_B", help="a checkpoint or run directory")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: bitwise)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: bitwise)")
    p.add_argument(
        "--ignore", action="append", default=[], metavar="COMPONENT", help="skip a component"
    )
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    p.add_argument(
        "--no-verify", action="store_true", help="check file sizes only, not checksums (faster)"
    )
    p.set_defaults(func=lambda a: _weights.run_guarded("diff", run, a))


@dataclass
class Tolerance:
    atol: float | None
    rtol: float | None

    @property
    def bitwise(self) -> bool:
        return self.atol is None and self.rtol is None


@dataclass
class ComponentDiff:
    status: str = "equal"  # equal | differs | only in A | only in B
    tensors: int = 0
    tensors_differing: int = 0
    values_differing: int = 0
    leaves: int = 0
    entries: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def add(self, pos: int, entry: dict[str, Any]) -> None:
        """A difference at position ``pos`` of the component's saved state (its order)."""
        self.status = "differs"
        if entry["what"] == "tensor":
            self.tensors_differing += 1
        else:
            self.values_differing += 1
        self.entries.append((pos, entry))

    @property
    def differences(self) -> list[dict[str, Any]]:
        return [e for _, e in sorted(self.entries, key=lambda pe: pe[0])]

    @property
    def first(self) -> dict[str, Any] | None:
        return min(self.entries, key=lambda pe: pe[0])[1] if self.entries else None


def run(args: argparse.Namespace) -> int:
    checksums = not args.no_verify
    a = _weights.open_checkpoint(args.a, None, checksums=checksums)
    b = _weights.open_checkpoint(args.b, None, checksums=checksums)
    tol = Tolerance(args.atol, args.rtol)
    for name, v in (("--atol", tol.atol), ("--rtol", tol.rtol)):
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise _weights.UsageError(f"{name} must be a finite number >= 0, not {v}")
    comps = compare(a, b, tol, set(args.ignore))
    first = next(
        ({"component": n, **c.first} for n, c in comps.items() if c.first is not None), None
    )
    first_tensor = next(
        (
            {"component": n, **e}
            for n, c in comps.items()
            for e in c.differences
            if e["what"] == "tensor"
        ),
        None,
    )
    only = next((n for n, c in comps.items() if c.status.startswith("only")), None)
    identical = first is None and only is None
    report = {
        "a": {"path": a.path, "step": a.step, "world_size": a.world_size},
        "b": {"path": b.path, "step": b.step, "world_size": b.world_size},
        "identical": identical,
        "compared": "bitwise"
        if tol.bitwise
        else {"atol": tol.atol or 0.0, "rtol": tol.rtol or 0.0},
        "ignored": sorted(args.ignore),
        "first_difference": first,
        "first_differing_tensor": first_tensor,
        "components": {
            n: {
                "status": c.status,
                "tensors": c.tensors,
                "tensors_differing": c.tensors_differing,
                "values_differing": c.values_differing,
                "differences": c.differences[:MAX_LISTED],
            }
            for n, c in comps.items()
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for line in format_report(report):
            print(line)
    return EXIT_OK if identical else EXIT_FAILURE


def compare(
    a: CheckpointReader, b: CheckpointReader, tol: Tolerance, ignore: set[str]
) -> dict[str, ComponentDiff]:
    sides: list[tuple[dict[str, Any], dict[str, Any], int | None]]
    sides = [(a.global_trees(), b.global_trees(), None)]
    for rank in range(max(a.world_size, b.world_size)):
        la, lb = a.local_trees(rank), b.local_trees(rank)
        sides.append((la or {}, lb or {}, rank))
    out: dict[str, ComponentDiff] = {}
    for ta, tb, where in sides:
        for name in sorted(ta.keys() | tb.keys()):
            if name in ignore:
                continue
            label = name if where is None else f"{name}@rank{where}"
            if name not in tb or name not in ta:
                out[label] = ComponentDiff(status="only in A" if name in ta else "only in B")
                continue
            diff = out[label] = ComponentDiff()
            pairs: list[tuple[int, str, _weights.Ref, _weights.Ref]] = []
            _walk(_weights._decoded(a, ta[name]), _weights._decoded(b, tb[name]), "", diff, pairs)
            diff.tensors = len(pairs)
            _compare_tensors(a, b, pairs, tol, diff)
    return dict(sorted(out.items()))


def _walk(x: Any, y: Any, path: str, diff: ComponentDiff, pairs: list) -> None:
    """Values compared in place; tensor pairs collected (compared in batches afterwards).
    Each leaf gets the next position, so differences sort in the order of the saved state."""
    pos = diff.leaves
    if isinstance(x, dict) and isinstance(y, dict):
        for k in [*x, *(k for k in y if k not in x)]:  # A's order, then B's extra keys
            key = f"{path}.{k}" if path else str(k)
            if k not in x or k not in y:
                diff.leaves += 1
                side = "B" if k not in x else "A"
                diff.add(pos, {"what": "value", "key": key, "detail": f"only in {side}"})
            else:
                _walk(x[k], y[k], key, diff, pairs)
        return
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _walk(u, v, f"{path}.{i}" if path else str(i), diff, pairs)
        return
    diff.leaves += 1
    if isinstance(x, _weights.Ref) and isinstance(y, _weights.Ref):
        pairs.append((pos, path, x, y))
    elif not _same_value(x, y):
        detail = f"{_short(x)} != {_short(y)}"
        diff.add(pos, {"what": "value", "key": path or "(value)", "detail": detail})


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


def _short(v: Any) -> str:
    if isinstance(v, _weights.Ref):
        return f"tensor {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
    if isinstance(v, (bytes, bytearray)):  # a generator's raw state: its size and a hash
        return f"{len(v)} bytes (xxh3 {xxhash.xxh3_64_hexdigest(bytes(v))[:8]})"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _compare_tensors(
    a: CheckpointReader, b: CheckpointReader, pairs: list, tol: Tolerance, diff: ComponentDiff
) -> None:
    todo: dict[str, tuple[int, _weights.Ref, _weights.Ref]] = {}
    for pos, key, ra, rb in pairs:
        if (ra.shape, ra.dtype) != (rb.shape, rb.dtype):
            diff.add(pos, {"what": "tensor", "key": key, "detail": f"{_short(ra)} != {_short(rb)}"})
        else:
            todo[key] = (pos, ra, rb)
    for group in _weights.batches({k: ra for k, (_, ra, _) in todo.items()}, BATCH_BYTES):
        ta = _weights.load(a, group)
        tb = _weights.load(b, {k: todo[k][2] for k in group})
        for key in group:
            text = _tensor_difference(ta[key], tb[key], tol)
            if text is not None:
                diff.add(todo[key][0], {"what": "tensor", "key": key, "detail": text})


def _tensor_difference(x: torch.Tensor, y: torch.Tensor, tol: Tolerance) -> str | None:
    """None when equal (bitwise, or within the tolerances for floating point); else a text."""
    import torch

    if tol.bitwise or not (x.is_floating_point() or x.is_complex()):
        same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    else:
        same = bool(
            torch.isclose(x, y, rtol=tol.rtol or 0.0, atol=tol.atol or 0.0, equal_nan=True).all()
        )
    if same:
        return None
    if x.is_floating_point() or x.is_complex():
        delta = (x.to(torch.complex128 if x.is_complex() else torch.float64) - y).abs()
        count = int((x != y).sum()) if not tol.bitwise else int((delta != 0).sum())
        worst = float(delta.nan_to_num(nan=math.inf).max()) if delta.numel() else 0.0
        return f"{count} of {x.numel()} elements differ, max |Δ| {worst:.3g}"
    return f"{int((x != y).sum())} of {x.numel()} elements differ"


def format_report(r: dict[str, Any]) -> list[str]:
    lines = [
        f"A  {r['a']['path']}  (step {r['a']['step']}, world size {r['a']['world_size']})",
        f"B  {r['b']['path']}  (step {r['b']['step']}, world size {r['b']['world_size']})",
        "",
    ]
    rows = []
    for name, c in r["components"].items():
        if c["status"] == "differs":
            parts = []
            if c["tensors_differing"]:
                parts.append(f"{c['tensors_differing']} of {c['tensors']} tensors")
            if c["values_differing"]:
                parts.append(f"{c['values_differing']} value(s)")
            first = c["differences"][0]
            status = f"differs: {', '.join(parts)}; first {first['key']}: {first['detail']}"
        else:
            status = c["status"] + (f" ({c['tensors']} tensors)" if c["tensors"] else "")
        rows.append((name, status))
    width = max([len("COMPONENT")] + [len(n) for n, _ in rows])
    lines.append(f"{'COMPONENT':<{width}}  STATUS")
    lines += [f"{n:<{width}}  {s}" for n, s in rows]
    lines.append("")
    compared = r["compared"]
    how = (
        "bitwise" if compared == "bitwise" else f"atol {compared['atol']}, rtol {compared['rtol']}"
    )
    f = r["first_difference"]
    if r["identical"]:
        lines.append(f"IDENTICAL ({how})")
    elif f is None:
        lines.append(f"DIFFER ({how}): the components differ")
    else:
        lines.append(f"DIFFER ({how}): first difference {f['component']}: {f['key']}")
    t = r["first_differing_tensor"]
    if t is not None and t != f:
        lines.append(f"first differing tensor: {t['component']}: {t['key']} ({t['detail']})")
    return lines
