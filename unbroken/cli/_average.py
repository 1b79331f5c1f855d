"""``unbroken average RUN --last N``: the mean of the model (or EMA) weights of a run's last N
valid checkpoints, written as one safetensors file.

The order of summation is fixed, so the result is reproducible bit for bit: for each
floating-point tensor, ``acc = 0`` in float64, then ``acc += w_i.double()`` for the
checkpoints in ascending step order, then ``(acc / N).to(original dtype)``. Integer and bool
tensors (step counters such as BatchNorm's ``num_batches_tracked``) are not averaged: they
are taken from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..process._exit import EXIT_OK
from . import _weights

if TYPE_CHECKING:
    import torch

ORDER = "float64 sum in ascending step order, divided by N, cast to the tensor's dtype"

EPILOG = """exit codes: 0 written, 1 a checkpoint is corrupt or the checkpoints do not match
            (another tensor name, shape or dtype), 2 usage error, 3 fewer than N valid
            checkpoints

example: unbroken average runs/gpt --last 5 --ema --out gpt-avg5.safetensors"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "average",
        help="average the model or EMA weights of the last N checkpoints into a safetensors file",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN", help="the run directory")
    p.add_argument("--last", type=int, required=True, metavar="N", help="how many checkpoints")
    p.add_argument(
        "--out",
        metavar="FILE",
        help="the safetensors file to write (default: COMPONENT-avg-STEPS.safetensors)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    _weights.add_source_options(p)
    p.set_defaults(func=lambda a: _weights.run_guarded("average", run, a))


def run(args: argparse.Namespace) -> int:
    from ._inspect import _run_store

    if args.last < 1:
        raise _weights.UsageError(f"--last must be at least 1, not {args.last}")
    store = _run_store(args.run_dir)
    listing = store.listing(checksums=not args.no_verify)
    for item in listing:
        if not item.valid:
            print(f"unbroken average: skipping {item.path}: {item.reason}", file=sys.stderr)
    valid = sorted(item.step for item in listing if item.valid)
    if len(valid) < args.last:
        raise CheckpointNotFoundError(
            f"{store.root} has {len(valid)} valid checkpoint(s), fewer than --last {args.last}"
        )
    steps = valid[-args.last :]
    readers = [store.open(s, checksums=False) for s in steps]  # listing verified them
    component, refs = _weights.weight_refs(readers[-1], args.component, args.ema)
    mean = average(readers, refs, component, args.ema)
    out = args.out or f"{component}-avg-{steps[0]}-{steps[-1]}.safetensors"
    meta = {
        "format": "pt",
        "unbroken_run": store.root,
        "unbroken_steps": ",".join(map(str, steps)),
        "unbroken_component": component + (".shadow" if args.ema else ""),
        "unbroken_order": ORDER,
    }
    _weights.write_safetensors(out, mean, meta)
    info = {
        "out": out,
        "steps": steps,
        "component": component,
        "ema": bool(args.ema),
        "tensors": len(mean),
        "order": ORDER,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(
            f"{out}: mean of {component}{' (EMA)' if args.ema else ''} over steps "
            f"{', '.join(map(str, steps))} ({len(mean)} tensors)"
        )
    return EXIT_OK


def average(
    readers: list[Any], refs: dict[str, _weights.Ref], component: str, ema: bool
) -> dict[str, torch.Tensor]:
    """The mean described in the module docstring; ``readers`` in ascending step order, ``refs``
    the newest checkpoint's tensors (every checkpoint must hold the same names, shapes and
    dtypes). One checkpoint's weights are in memory at a time, plus the float64 sums."""
    import torch

    acc: dict[str, torch.Tensor] = {}
    newest: dict[str, torch.Tensor] = {}
    for i, reader in enumerate(readers):
        _, these = _weights.weight_refs(reader, component, ema)
        _same_layout(reader, these, readers[-1].path, refs)
        tensors = _weights.load(reader, these)
        for key, t in tensors.items():
            if not (t.is_floating_point() or t.is_complex()):
                newest[key] = t
                continue
            wide = t.to(torch.complex128 if t.is_complex() else torch.float64)
            if i == 0:
                acc[key] = torch.zeros_like(wide)
            acc[key] += wide
    n = len(readers)
    out = {}
    for key, ref in refs.items():
        out[key] = newest[key] if key in newest else (acc[key] / n).to(ref.dtype)
    return out


def _same_layout(reader: Any, these: dict[str, _weights.Ref], ref_path: str, refs: dict) -> None:
    if these.keys() != refs.keys():
        extra, missing = sorted(these.keys() - refs.keys()), sorted(refs.keys() - these.keys())
        raise CorruptCheckpointError(
            f"{reader.path} does not hold the tensors of {ref_path}: "
            f"missing {missing[:5]}, extra {extra[:5]}"
        )
    for key, r in these.items():
        if (r.shape, r.dtype) != (refs[key].shape, refs[key].dtype):
            raise CorruptCheckpointError(
                f"{reader.path}: {key} is {list(r.shape)} {r.dtype}, but "
                f"{list(refs[key].shape)} {refs[key].dtype} in {ref_path}; cannot average"
            )
