"""Start-up checks that name what would silently lose exactness (issue 17).

Each check is cheap and runs once; what it finds is an error where the script cannot resume
exactly as written (a data source with no position), a :class:`ResumeWarning` where it is
misuse that may or may not matter (random draws between ``Run()`` and the loop), and an
``audit`` event in ``metrics.jsonl`` either way, which ``unbroken verify`` reads as evidence
when it ranks its hints. docs/resume.md, "What unbroken checks for you", lists them all.
"""

from __future__ import annotations

import random
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.optim.optimizer as optim_hooks
import torch.utils.data as tud

from ..data._contract import is_loader
from ..errors import ConfigError, ResumeWarning, StateError
from ..process import _log
from ..state import Registry
from ..state._adapters import unwrap
from ..state._rng import cuda_states

log = _log.get("run")


# ---- data sources with no position ----------------------------------------------------------


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _plain_loader(obj: Any) -> bool:
    # torchdata's StatefulDataLoader is a DataLoader with state_dict(): it has a position.
    return isinstance(obj, tud.DataLoader) and not _stateful(obj)


def _plain_sampler(obj: Any) -> bool:
    return isinstance(obj, (tud.Sampler, tud.BatchSampler)) and not _stateful(obj)


def replacement(obj: Any) -> str:
    """What to use instead of a plain torch DataLoader or Sampler ``obj``."""
    dataset = getattr(obj, "dataset", None)
    if isinstance(dataset, tud.IterableDataset):
        return (
            "unbroken.IterableLoader(source, batch_size) for an iterable dataset (its source "
            "saves its own position), or unbroken.data.IterableShards for a sharded one"
        )
    if isinstance(obj, (tud.Sampler, tud.BatchSampler)):
        return (
            "unbroken.MapLoader(dataset, batch_size, shuffle=True, seed=...) in place of the "
            "sampler and its DataLoader, or unbroken.data.SamplerLoader(dataset, sampler=...) "
            "with a sampler that has state_dict()/load_state_dict()"
        )
    return (
        "unbroken.MapLoader(dataset, batch_size, shuffle=True, seed=...) for a map-style "
        "dataset (unbroken.IterableLoader for an iterable one)"
    )


def _no_position(obj: Any, holder: str = "") -> str:
    what = "torch.utils.data.DataLoader" if isinstance(obj, tud.DataLoader) else "Sampler"
    subject = f"{holder}, a plain {what}," if holder else f"a plain {what} ({type(obj).__name__})"
    return (
        f"{subject} has no position to save: after a resume it "
        f"would restart its epoch and reshuffle. Use {replacement(obj)}, and pass it to Run "
        "(docs/data.md)"
    )


def refuse_untrackable(obj: Any) -> None:
    """A component that is a plain torch DataLoader or Sampler: name its replacement."""
    if _plain_loader(obj) or _plain_sampler(obj):
        raise ConfigError(_no_position(obj))


def check_loop_source(registry: Registry, source: Any) -> None:
    """What ``run.loop(source)`` iterates must resume where it stopped: a tracked loader, or
    something with no position at all (``range(n)``, a synthetic generator)."""
    tracked = [c for c in registry if c.obj is source]
    if tracked:
        return
    if _plain_loader(source) or _plain_sampler(source):
        raise ConfigError(f"run.loop(): {_no_position(source)}")
    if is_loader(source) or _stateful(source):
        raise ConfigError(
            f"run.loop() got a {type(source).__name__} that is not a component of this Run: "
            "its position would not be saved, so a resume would restart it. Pass it to Run "
            "(Run(..., loader=loader)) and loop over that same object"
        )
    # A wrapper (moving batches to the GPU, say) around a plain DataLoader hides the same bug.
    for attr, value in _attributes(source):
        if _plain_loader(value) or _plain_sampler(value):
            raise ConfigError(
                f"run.loop(): {_no_position(value, f'{type(source).__name__}.{attr}')}"
            )


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    try:
        items = vars(obj).items()
    except TypeError:  # no __dict__ (range, list, a generator)
        return []
    return [(k, v) for k, v in items if not k.startswith("__")]


# ---- random draws between Run() and the loop -------------------------------------------------


def _streams(registry: Registry) -> dict[str, Any]:
    """A comparable fingerprint of every random stream a checkpoint restores."""
    out: dict[str, Any] = {}
    if "rng" in registry:
        out["the torch global RNG (torch.rand, dropout)"] = torch.get_rng_state().numpy().tobytes()
        out["the NumPy global RNG (np.random.*)"] = _np_key(np.random.get_state())
        out["the Python global RNG (random.*)"] = random.getstate()
        cuda = cuda_states(getattr(registry.get("rng"), "devices", None))
        if cuda:
            out["the CUDA RNG"] = cuda
    for c in registry:
        if getattr(c.adapter, "kind", None) == "generator":
            out[f"the tracked generator {c.name!r}"] = repr(c.adapter.state_dict())
    return out


def _np_key(state: Any) -> Any:
    return (state[0], state[1].tobytes(), *state[2:])


def _python_draws(before: Any, after: Any, limit: int = 4096) -> int | None:
    """32-bit words drawn from Python's global stream between two states, when countable:
    replayed word by word on a copy (random.random() takes 2), up to ``limit``."""
    probe = random.Random()
    probe.setstate(before)
    for n in range(1, limit + 1):
        probe.getrandbits(32)
        if probe.getstate() == after:
            return n
    return None


# ---- module state outside the state_dict ------------------------------------------------------


def _hidden(registry: Registry) -> dict[str, tuple[str, Any]]:
    """What tracked modules hold outside their state_dict: non-persistent buffers, tensor and
    number attributes -- name -> (what, a fingerprint that changes when it is updated)."""
    out: dict[str, tuple[str, Any]] = {}
    for comp, module in registry.modules().items():
        for path, sub in unwrap(module).named_modules():
            prefix = f"{comp}.{path}." if path else f"{comp}."
            for b in getattr(sub, "_non_persistent_buffers_set", ()):
                t = sub._buffers.get(b)
                if t is not None:
                    out[prefix + b] = ("a non-persistent buffer", _tensor_mark(t))
            for k, v in vars(sub).items():
                if k.startswith("_") or k == "training":
                    continue
                if isinstance(v, torch.Tensor):
                    out[prefix + k] = ("a tensor attribute, not a buffer", _tensor_mark(v))
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[prefix + k] = ("a number attribute", v)
    return out


def _tensor_mark(t: torch.Tensor) -> Any:
    # In-place updates bump _version; a reassignment makes a new tensor, whose id may be the
    # old one's, so small CPU tensors are compared by value as well.
    value = None
    if t.device.type == "cpu" and t.layout == torch.strided and t.numel() <= 65536:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        # TensorBase's own numpy(): not the one the snapshots watch (train/_data_watch.py)
        value = torch._C.TensorBase.numpy(flat).tobytes()
    return (id(t), t._version, t.data_ptr(), value)


# ---- an optimizer not passed to Run --------------------------------------------------------


def _tracked_optimizers(registry: Registry) -> set[int]:
    """ids of the tracked optimizers and of the torch optimizers they wrap (Accelerate's and
    Lightning's wrappers keep theirs in ``.optimizer``)."""
    out: set[int] = set()
    for c in registry:
        obj = c.obj
        for _ in range(4):
            if obj is None:
                break
            out.add(id(obj))
            obj = getattr(obj, "optimizer", None)
    return out


def untracked_optimizer(registry: Registry, opt: torch.optim.Optimizer) -> list[str]:
    """The tracked modules whose parameters ``opt`` updates, when ``opt`` itself is not
    tracked (empty otherwise): its moments and step count would restart after a resume."""
    if id(opt) in _tracked_optimizers(registry):
        return []
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    return [
        name
        for name, module in registry.modules().items()
        if any(id(p) in held for p in module.parameters())
    ]


# (audit, hook handle) of each watching Run; a hook must not be removed while torch iterates
# over the hooks (from inside one), so those of closed runs are removed by the next Run.
_watchers: list[tuple[weakref.ref[Any], Any]] = []


def watch_optimizers(audit: Audit) -> None:
    """Warn, at its first step, about an optimizer that updates a tracked module's parameters
    but is not tracked itself (created after ``Run()``, or not passed): it would restart after
    a resume and the run diverge. A global optimizer hook; it does nothing once the run is
    closed, and is removed when the next Run starts."""
    for ref, old in list(_watchers):
        live = ref()
        if live is None or live.is_closed():
            old.remove()
            _watchers.remove((ref, old))
    seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        live = ref()
        if live is None or live.is_closed() or opt in seen:
            return
        seen.add(opt)
        modules = untracked_optimizer(live.registry, opt)
        if not modules:
            return
        warnings.warn(
            f"an optimizer ({type(opt).__name__}) that is not tracked updates the parameters of "
            f"{', '.join(repr(m) for m in modules)}: its state (moments, step count) is not "
            "saved, so after a resume it starts afresh and the run diverges from an "
            "uninterrupted one. Pass it to Run (Run(..., optimizer=opt)), creating it before "
            "the Run",
            ResumeWarning,
            stacklevel=3,
        )
        live.record("untracked_optimizer", optimizer=type(opt).__name__, modules=modules)

    ref = weakref.ref(audit)
    _watchers.append((ref, optim_hooks.register_optimizer_step_pre_hook(hook)))


class Audit:
    """The start-up audit of one Run: created once the Run has resumed (or started fresh).
    ``record(check, **fields)`` puts what it finds into the metrics log (as ``audit``)."""

    def __init__(
        self,
        registry: Registry,
        *,
        resumed: bool,
        record: Callable[..., None],
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.registry, self.resumed, self.record = registry, resumed, record
        self.is_closed = closed  # the Run's: a closed run's optimizer watch does nothing
        self._streams: dict[str, Any] | None = _streams(registry)
        self._steps_started = 0
        self._hidden: dict[str, tuple[str, Any]] | None = None
        watch_optimizers(self)

    def step_started(self) -> None:
        """At each step start of ``run.loop()``: module state outside the state_dict that a
        whole training step changed (the second of this process: a cache built lazily in the
        first does not count) is not saved, so a resume would restart it."""
        self._steps_started += 1
        if self._steps_started == 2:
            self._hidden = _hidden(self.registry)
        elif self._steps_started == 3 and self._hidden is not None:
            before, self._hidden = self._hidden, None
            after = _hidden(self.registry)
            changed = [
                (n, what)
                for n, (what, mark) in before.items()
                if after.get(n, (0, mark))[1] != mark
            ]
            if not changed:
                return
            names = ", ".join(f"{n} ({what})" for n, what in changed[:5])
            warnings.warn(
                f"a tracked module keeps state outside its state_dict that a training step "
                f"changed: {names}. It is not saved, so a resume restarts it and the run "
                "diverges. Register it as a persistent buffer (self.register_buffer(name, "
                "tensor)); if it is a cache rebuilt from the weights, ignore this warning",
                ResumeWarning,
                stacklevel=5,
            )
            self.record("hidden_state", names=[n for n, _ in changed])

    def loop_started(self, source: Any = None, *, check_source: bool = False) -> None:
        """At the first step start of ``run.loop()`` / the first epoch of ``run.epochs()``."""
        if check_source:
            check_loop_source(self.registry, source)
        if self._streams is None:
            return
        before, self._streams = self._streams, None
        after = _streams(self.registry)
        moved = [name for name, state in before.items() if after.get(name) != state]
        if not moved:
            return
        py = "the Python global RNG (random.*)"
        words = _python_draws(before[py], after[py]) if py in moved else None
        count = (
            f" (the Python one by {words} 32-bit words; random.random() takes 2)" if words else ""
        )
        where = "resumed" if self.resumed else "started"
        warnings.warn(
            f"{' and '.join(moved)} advanced between Run() and the start of the loop{count}: "
            f"the run {where} its random streams at Run(), and a resume restores them there, "
            "so these draws shift every later one and a resumed run diverges from an "
            "uninterrupted one. Draw them before creating the Run (fixed evaluation inputs, "
            "say), or from a separate torch.Generator(); see docs/resume.md",
            ResumeWarning,
            stacklevel=4,
        )
        self.record("rng_after_run", streams=moved)


# ---- the optimizer and model a model change replaced -----------------------------------------


def retire(
    old_opt: torch.optim.Optimizer | None,
    old_model: torch.nn.Module,
    new_model: torch.nn.Module,
    step: int,
) -> None:
    """After a model change, make the replaced optimizer and model refuse to train.

    The script's own ``opt``/``model`` variables still point at them; stepping the old
    optimizer would update parameters no longer tracked, and the new model would train
    nothing -- silently. A clear error at the first use is better.
    """
    if old_opt is not None and not getattr(old_opt, "_unbroken_retired", False):
        text = (
            f"this optimizer was replaced at step {step}, when the model changed: it updates "
            "parameters of the old model, which is no longer trained or saved. Use "
            "run.optimizer (and run.model) in the loop, and read them again after each step "
            "start"
        )

        def refuse_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            raise StateError(text)

        old_opt.register_step_pre_hook(refuse_step)
        old_opt._unbroken_retired = True  # type: ignore[attr-defined]
    inner = unwrap(old_model)
    if any(m is inner for m in unwrap(new_model).modules()):
        return  # the new model wraps the old one (a head added around it): it still runs
    if not getattr(inner, "_unbroken_retired", False):
        text_m = (
            f"this model was replaced at step {step}, when a callback (or a resume into a later "
            "stage) changed it: it is no longer trained or saved. Use run.model (and "
            "run.optimizer) in the loop"
        )

        def refuse_forward(_module: Any, _args: Any) -> None:
            raise StateError(text_m)

        inner.register_forward_pre_hook(refuse_forward)
        object.__setattr__(inner, "_unbroken_retired", True)  # a flag, not a module attribute
