"""Weights out of a checkpoint, through the public reader API only (``tensor_infos``,
``global_trees``, ``load_tensors``): shared by ``export``, ``average`` and ``diff``.

No file of the checkpoint is parsed here; the reader verifies and reads it. Tensors are loaded
into plain full-size CPU tensors, so a checkpoint saved sharded by N ranks (FSDP2) is
consolidated by this one offline process: no rank ever holds the full model.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from ..store import CheckpointReader


class UsageError(Exception):
    """A wrong argument (exit 2), as opposed to a bad checkpoint (exit 1)."""


@dataclass(frozen=True)
class Ref:
    """A tensor of the checkpoint, by its stored name, not loaded."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def add_source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--component",
        metavar="NAME",
        help="the component to take the weights from (default: the model, i.e. the only "
        "module component; with --ema the only EMA)",
    )
    p.add_argument("--ema", action="store_true", help="the EMA weights instead of the model's")
    p.add_argument(
        "--no-verify", action="store_true", help="check file sizes only, not checksums (faster)"
    )


def open_checkpoint(path: str, step: int | None, *, checksums: bool) -> CheckpointReader:
    """A checkpoint directory, or a run directory's newest valid checkpoint (or of ``step``)."""
    from . import _inspect

    try:
        return _inspect._open(path, step, checksums=checksums)
    except _inspect._UsageError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def weight_refs(reader: CheckpointReader, component: str | None, ema: bool) -> tuple[str, dict]:
    """``(component name, {state-dict key: Ref})`` of the model's (or EMA's) weights."""
    trees = reader.global_trees()
    kinds = {name: (c or {}).get("kind") for name, c in reader.components.items()}
    if component is None:
        pick = [n for n in sorted(trees) if (_is_ema(trees[n]) if ema else kinds[n] == "module")]
        if not pick and ema:
            modules = [n for n in sorted(trees) if kinds[n] == "module"]
            plain = f"; for its model, drop --ema (modules: {', '.join(modules)})"
            plain = plain if modules else ""
            raise UsageError(f"{reader.path} holds no EMA (unbroken.EMA){plain}")
        if not pick:
            raise UsageError(
                f"{reader.path} holds no module; name a component with --component "
                f"(components: {', '.join(sorted(trees))})"
            )
        if len(pick) > 1:
            what = "EMAs (unbroken.EMA)" if ema else "modules"
            raise UsageError(
                f"{reader.path} holds several {what}: {', '.join(pick)}; name one with --component"
            )
        component = pick[0]
    if component not in trees:
        local = " (it is rank-local)" if component in kinds else ""
        raise UsageError(
            f"{reader.path} has no global component {component!r}{local}; "
            f"components: {', '.join(sorted(trees))}"
        )
    tree = trees[component]
    if ema and not _is_ema(tree):
        raise UsageError(f"component {component!r} of {reader.path} is not an unbroken.EMA")
    state = _decoded(reader, tree)
    if ema:
        state = state["shadow"]
    refs = (
        {str(k): v for k, v in state.items() if isinstance(v, Ref)}
        if isinstance(state, dict)
        else {}
    )
    if not refs:
        raise UsageError(
            f"component {component!r} of {reader.path} is not a state dict of tensors "
            "(a module's or an EMA's)"
        )
    return component, refs


def _is_ema(tree: Any) -> bool:
    return isinstance(tree, dict) and {"shadow", "updates"} <= tree.keys()


def _decoded(reader: CheckpointReader, tree: Any) -> Any:
    """The component's state with every tensor replaced by its :class:`Ref`."""
    from ..state import _nested

    infos = reader.tensor_infos()
    refs = {n: Ref(n, tuple(infos[n].shape), infos[n].dtype) for n in _nested.tensor_names(tree)}
    return _nested.join(tree, refs)  # type: ignore[arg-type]


def load(reader: CheckpointReader, refs: dict[str, Ref]) -> dict[str, torch.Tensor]:
    """The tensors of ``refs`` (key -> Ref), as full-size CPU tensors, keyed like ``refs``."""
    import torch

    targets = {r.name: torch.empty(r.shape, dtype=r.dtype) for r in refs.values()}
    reader.load_tensors(targets)
    return {key: targets[r.name] for key, r in refs.items()}


def batches(refs: dict[str, Ref], limit: int) -> list[dict[str, Ref]]:
    """``refs`` in order, cut into consecutive groups of at most ``limit`` bytes (a tensor
    larger than ``limit`` is a group of its own)."""
    out: list[dict[str, Ref]] = []
    size = 0
    for key, ref in refs.items():
        if not out or (size + ref.nbytes > limit and out[-1]):
            out.append({})
            size = 0
        out[-1][key] = ref
        size += ref.nbytes
    return out


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000``: bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        value = float(num) * units[t[len(num) :]]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write atomically: a crash leaves the old file or none, never a torn one."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        # safetensors creates its file 0600 whatever the umask; an export is a file the user
        # writes, readable by whom the umask allows (colleagues on a shared machine).
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot write {path}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells it (another thread may
    create files meanwhile); else set and put back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def run_guarded(name: str, fn: Any, args: argparse.Namespace) -> int:
    """``fn(args)``, a usage error turned into exit 2 and an OS error into exit 1, the message
    on stderr (checkpoint errors propagate to ``unbroken.cli.main``: exit 1, or 3 for no
    checkpoint)."""
    from ..process._exit import EXIT_FAILURE, EXIT_USAGE

    try:
        return int(fn(args))
    except BrokenPipeError:
        raise  # the reader went away (``| head``): unbroken.cli.main ends quietly
    except UsageError as e:
        print(f"unbroken {name}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. retention deleted a checkpoint of a live run while it was read
        print(f"unbroken {name}: error: {e}", file=sys.stderr)  # names e.filename
        return EXIT_FAILURE
