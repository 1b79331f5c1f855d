"""``unbroken export CKPT --to safetensors|hf``: a checkpoint's model (or EMA) weights,
consolidated, as one safetensors file or a Hugging Face style directory of safetensors shards.

One offline process reads the checkpoint through the store's reader: a checkpoint saved sharded
by N ranks is consolidated here without any rank ever materialising the full model. Memory
peaks at one output file: the whole model for ``safetensors``, one shard for ``hf``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..errors import CheckpointError
from ..process._exit import EXIT_OK
from . import _weights

EPILOG = """CKPT is a checkpoint directory or a run directory (its newest valid checkpoint, or
the one of --step N).

exit codes: 0 written, 1 corrupt or unsafe checkpoint (or OUT cannot be written),
            2 usage error (no such component, several to choose from), 3 no valid checkpoint

examples: unbroken export runs/gpt --to safetensors --out gpt.safetensors
          unbroken export runs/gpt --ema --to hf --out gpt-ema/ --max-shard-size 2GB"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's model or EMA weights as safetensors or a HF-style directory",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="CKPT", help="a checkpoint or run directory")
    p.add_argument("--to", choices=["safetensors", "hf"], required=True, help="output format")
    p.add_argument(
        "--out",
        metavar="OUT",
        help="the file (safetensors) or directory (hf) to write "
        "(default: COMPONENT-step-N.safetensors, COMPONENT-step-N-hf/)",
    )
    p.add_argument("--step", type=int, metavar="N", help="in a run directory: step N")
    p.add_argument(
        "--max-shard-size",
        type=_weights.parse_size,
        default=_weights.parse_size("5GB"),
        metavar="SIZE",
        help="hf: the largest shard (default: 5GB)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    _weights.add_source_options(p)
    p.set_defaults(func=lambda a: _weights.run_guarded("export", run, a))


def run(args: argparse.Namespace) -> int:
    reader = _weights.open_checkpoint(args.path, args.step, checksums=not args.no_verify)
    component, refs = _weights.weight_refs(reader, args.component, args.ema)
    default = f"{component}-step-{reader.step}" + ("-hf" if args.to == "hf" else ".safetensors")
    out = args.out or default
    meta = {
        "format": "pt",  # what transformers' loaders expect
        "unbroken_checkpoint": reader.path
        if "://" in reader.path
        else os.path.abspath(reader.path),
        "unbroken_step": str(reader.step),
        "unbroken_component": component + (".shadow" if args.ema else ""),
    }
    if args.to == "safetensors":
        if os.path.isdir(out):
            raise _weights.UsageError(f"--out {out} is a directory; name the file to write")
        _weights.write_safetensors(out, _weights.load(reader, refs), meta)
        files = [out]
    else:
        files = write_hf(out, reader, refs, meta, args.max_shard_size)
    info = {
        "checkpoint": reader.path,
        "step": reader.step,
        "component": component,
        "ema": bool(args.ema),
        "format": args.to,
        "out": out,
        "files": files,
        "tensors": len(refs),
        "bytes": sum(r.nbytes for r in refs.values()),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        what = f"{component} (EMA)" if args.ema else component
        print(f"{out}: {len(refs)} tensors of {what} at step {reader.step}, {len(files)} file(s)")
    return EXIT_OK


def write_hf(
    out: str, reader: Any, refs: dict[str, _weights.Ref], meta: dict[str, str], shard_limit: int
) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000K.safetensors`` shards (tensors in the
    checkpoint's order, each shard at most ``shard_limit`` bytes unless one tensor is larger)
    with ``model.safetensors.index.json``: the layout ``transformers`` loads."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise _weights.UsageError(f"--out {out} is a file; hf writes a directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {out}: {e}") from None
    groups = _weights.batches(refs, shard_limit)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map: dict[str, str] = {}
    files = []
    for name, group in zip(names, groups, strict=True):
        path = os.path.join(out, name)
        _weights.write_safetensors(path, _weights.load(reader, group), meta)  # one shard at a time
        weight_map |= dict.fromkeys(group, name)
        files.append(path)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(r.nbytes for r in refs.values())},
            "weight_map": weight_map,
        }
        path = os.path.join(out, "model.safetensors.index.json")
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: {e}") from None
        files.append(path)
    _remove_stale(out, {os.path.basename(f) for f in files})
    return files


def _remove_stale(out: str, written: set[str]) -> None:
    """Drop the files of an earlier export into ``out`` that this one did not rewrite (other
    shard counts, an index no longer needed): loaders would mix them with the new ones."""
    for name in os.listdir(out):
        ours = name == "model.safetensors.index.json" or (
            name.startswith("model") and name.endswith(".safetensors")
        )
        if ours and name not in written:
            try:
                os.remove(os.path.join(out, name))
            except OSError as e:
                raise CheckpointError(f"cannot remove {os.path.join(out, name)}: {e}") from None
