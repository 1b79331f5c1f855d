"""Run options, checked up front so a typo fails before any training."""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import numbers
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, ConfigTypeError

GROUPS = {
    "save": "when and how checkpoints are written, and how many are kept",
    "resume": "where a launch continues from, and what it checks",
    "stop": "when training ends or stops resumable",
    "snapshot": "in-memory snapshots under `unbroken run`",
    "log": "the metrics log, the progress bar and your hooks",
    "loop": "what `run.loop()` applies at step starts: settings, callbacks, stages",
}
"""The option groups, in the order the docs list them."""
SNAPSHOT_COPIES = ("step", "background")
"""The values of ``snapshot_copy``."""


def _option(
    default: Any, group: str, *, framework: bool = False, expects: str | None = None
) -> Any:
    """A field of :class:`RunConfig`: its group, whether it means anything under a framework's
    own loop (Lightning, the Trainer: they take those options), and, where the annotation's
    wording would not help, what it accepts."""
    return field(
        default=default, metadata={"group": group, "framework": framework, "expects": expects}
    )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Options of :class:`unbroken.Run`: pass one as ``Run(dir, config=RunConfig(...), ...)``,
    or its fields as keyword arguments of ``Run`` (not both). Each field's annotation is its
    type, checked here; :data:`GROUPS` says what each group is for (``RunConfig.fields(group)``)."""

    # ---- save ----
    save_every: int | None = _option(None, "save", framework=True)
    """Save every N optimizer steps."""
    save_every_minutes: float | None = _option(None, "save", framework=True)
    """Save when this many minutes passed since the last save."""
    save_on_epoch_end: bool = _option(False, "save")
    """Save whenever an epoch completes."""
    save_final: bool = _option(True, "save", framework=True)
    """Save when training completes (``finish()``, or the end of ``epochs()``/``loop()``)."""
    keep_last: int | None = _option(3, "save", framework=True)
    """Keep the newest N checkpoints (None keeps all). ``unbroken verify`` keeps them all in the
    runs it launches, and says so."""
    keep_every: int | None = _option(None, "save", framework=True)
    """Also keep checkpoints whose step is a multiple of this."""
    remote: str | None = _option(None, "save", framework=True)
    """An object store URL (``s3://bucket/prefix``) every checkpoint is uploaded to in the
    background after it commits locally; a start resumes from the newest checkpoint that
    verifies in either tier (an empty run directory from the remote one). Needs
    ``unbroken[s3]``; credentials and endpoint from the standard ``AWS_*`` variables and
    files. See docs/remote.md."""
    remote_keep_last: int | None = _option(3, "save", framework=True)
    """Keep the newest N checkpoints in ``remote`` (None keeps all); ``keep_every`` applies
    too. ``unbroken verify`` keeps them all in the runs it launches."""
    remote_finish_timeout: float | None = _option(120.0, "save", framework=True)
    """The longest ``finish()`` waits for the final upload to ``remote`` (seconds; the upload
    in flight, then one retry): past it, the run raises ``RemoteStoreError`` with the final
    checkpoint kept locally and the command that uploads it. A stop (exit 75) waits as long
    at most for the upload in flight. None: as long as the store takes."""
    async_save: bool = _option(False, "save", framework=True)
    """Block training only for a snapshot; write and commit in the background."""
    # ---- resume ----
    resume: bool | int = _option(
        True, "resume", framework=True, expects="True, False or a step number (int)"
    )
    """True: continue from the latest valid checkpoint if there is one; an int: from that step;
    False: start fresh and refuse to run in a directory that has checkpoints. Checkpoints none
    of which loads are an error, never a fresh start (see ``start_over``)."""
    start_over: bool = _option(False, "resume", framework=True)
    """Move every checkpoint already in the run directory, and its metrics log, into
    ``checkpoints/abandoned-<UTC time>/`` (nothing is deleted) and start fresh. Meant for one
    launch: left on, every relaunch starts over again."""
    allow_missing: tuple[str, ...] = _option((), "resume", framework=True)
    """Components that may be absent from the checkpoint (they start fresh)."""
    allow_unexpected: tuple[str, ...] = _option((), "resume", framework=True)
    """Components the checkpoint may hold that are not tracked now (ignored)."""
    verify_checksums: bool = _option(True, "resume", framework=True)
    """Check every file's xxh3 before resuming (size checks always happen)."""
    seed: int | None = _option(None, "resume")
    """On a fresh start, seed Python, NumPy and torch (on resume, the streams are restored)."""
    track_rng: bool = _option(True, "resume", framework=True)
    """Capture and restore the global Python, NumPy, torch and CUDA random streams."""
    # ---- stop ----
    max_steps: int | None = _option(None, "stop")
    """Training is complete after this many optimizer steps."""
    time_limit: float | str | None = _option(
        None,
        "stop",
        framework=True,
        expects="seconds (a number), a '[D-]HH:MM:SS' string, or None",
    )
    """Wall-time budget of this process, in seconds or ``[D-]HH:MM:SS``; the run saves and exits
    resumable before it ends. SLURM's job end time (``SLURM_JOB_END_TIME``) is honoured too."""
    time_margin: float = _option(10.0, "stop", framework=True)
    """Seconds of slack kept before the budget ends, on top of a step and a save."""
    handle_signals: bool = _option(True, "stop")
    """SIGTERM, SIGUSR1, SIGINT: finish the step, save, exit with code 75."""
    exit_on_stop: bool = _option(True, "stop")
    """After a signal or time-budget save, raise SystemExit(75); else ``step()`` returns True."""
    # ---- snapshot ----
    snapshot_every: int | None = _option(None, "snapshot")
    """Under ``unbroken run``: an in-memory snapshot every N steps (0: none; None: as often as
    keeps them under 1% of the step time), persisted by the supervisor if the process dies."""
    snapshot_copy: str = _option("step", "snapshot", expects="'step' or 'background'")
    """How a snapshot's tensors are copied. ``"step"`` (the default): every tensor is copied at
    ``run.step()`` (into buffers kept from one snapshot to the next: one more copy of the state
    in memory) -- the snapshot is the state of that step exactly, whatever the training does
    next; the copy into shared memory, hashing, writing the table and the commit go on in a
    thread while the next step computes. ``"background"``: the
    tracked optimizers' parameters and state and the EMAs' shadows (CPU tensors only) are
    copied by that thread while the next step computes, checked by their version counters
    before the next ``optimizer.step()``, and ``Tensor.data``/``.numpy()`` are watched; changes
    that move no version counter and escape that watch are not seen and make a torn snapshot
    (NumPy arrays made before the snapshot, ``.numpy()`` of a view at another address,
    ``untyped_storage()``, DLPack, raw pointers, code compiled by ``torch.compile``'s eager
    backend). See docs/design.md."""
    # ---- log ----
    metrics: bool = _option(True, "log", framework=True)
    """Write ``RUN/metrics.jsonl``."""
    progress: bool | None = _option(None, "log", framework=True)
    """Show a tqdm bar (default: when stderr is a terminal)."""
    on_save: Callable[[int, str], Any] | None = _option(None, "log")
    """``on_save(step, path)`` after each checkpoint is durably committed, on every rank, in
    the training thread (after an ``async_save``: at the next ``step()``, ``wait()`` or
    ``finish()``). For your own logger; see docs/trackers.md."""
    on_resume: Callable[[int, str], Any] | None = _option(None, "log")
    """``on_resume(step, path)`` once ``Run()`` restored every component from a checkpoint,
    on every rank (not on a fresh start)."""
    # ---- loop ----
    settings: Any = _option(None, "loop")
    """An ``unbroken.train.Settings``: values that are constants or functions of (step, epoch)."""
    before_step: Callable[..., Any] | None = _option(None, "loop")
    """``before_step(ctx)`` at each step start in ``run.loop()``; may return a Change."""
    on_epoch_start: Callable[..., Any] | None = _option(None, "loop")
    """``on_epoch_start(ctx)`` before the first step of each epoch; may return a Change."""
    model_factory: Callable[[Any], Any] | None = _option(None, "loop")
    """``model_factory(stage)`` builds the model of a stage (on resume, before loading)."""
    optimizer_factory: Callable[[Any], Any] | None = _option(None, "loop")
    """``optimizer_factory(model)`` builds the optimizer after a model change (default: the
    same class and param groups, matched by parameter name)."""
    grow: Callable[..., Any] | None = _option(None, "loop")
    """``grow(name, what, old, new_shape)`` remaps state of a reshaped parameter (see docs)."""
    stage: Any = _option(None, "loop")
    """The stage of the model you built (JSON-able); recorded in every checkpoint."""
    wrap_model: Callable[[Any], Any] | None = _option(None, "loop")
    """``wrap_model(model)`` wraps a new model after a change (default: DDP again if the old one
    was DDP; FSDP2 users pass a function that calls ``fully_shard``)."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("save_every", "keep_last", "keep_every", "max_steps", "remote_keep_last"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        if self.save_every_minutes is not None and self.save_every_minutes <= 0:
            raise ConfigError(f"save_every_minutes must be > 0, got {self.save_every_minutes!r}")
        if self.remote_finish_timeout is not None and not self.remote_finish_timeout > 0:
            raise ConfigError(
                f"remote_finish_timeout must be > 0 or None, got {self.remote_finish_timeout!r}"
            )
        if not isinstance(self.resume, bool) and self.resume < 0:
            raise ConfigError(f"resume must be True, False or a step number, got {self.resume!r}")
        if self.start_over and not isinstance(self.resume, bool):
            raise ConfigError(
                f"start_over=True starts fresh; it cannot be combined with resume={self.resume!r}"
            )
        if self.remote is not None:
            from ..store.remote._s3 import parse_url

            parse_url(self.remote)  # a malformed URL fails here, before anything runs
        self.allow_missing = tuple(self.allow_missing)
        self.allow_unexpected = tuple(self.allow_unexpected)
        if self.snapshot_copy not in SNAPSHOT_COPIES:
            raise ConfigError(
                f"snapshot_copy must be one of {', '.join(map(repr, SNAPSHOT_COPIES))}, "
                f"got {self.snapshot_copy!r}"
            )
        if self.snapshot_every is not None and self.snapshot_every < 0:
            raise ConfigError(
                f"snapshot_every must be an int >= 0 or None, got {self.snapshot_every!r}"
            )
        self.time_limit_seconds()

    def time_limit_seconds(self) -> float | None:
        return parse_duration(self.time_limit, "time_limit")

    @classmethod
    def fields(cls, group: str | None = None, *, framework: bool = False) -> frozenset[str]:
        """The option names (of one group; only those that mean something under a framework's
        own loop, with ``framework=True``)."""
        return frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if (group is None or f.metadata["group"] == group)
            and (not framework or f.metadata["framework"])
        )


@functools.cache
def _types() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


def _fits(tp: Any, v: Any) -> bool:
    """Whether ``v`` is of the annotated type ``tp`` (the forms RunConfig uses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arg, v) for arg in typing.get_args(tp))
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    if origin is tuple:  # names: any collection of strings
        return isinstance(v, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in v)
    if origin is collections.abc.Callable:
        return callable(v)
    raise TypeError(f"RunConfig cannot check the annotation {tp!r}")  # a new form: teach _fits


_WORDS = {bool: "a bool", int: "an int", float: "a number", str: "a string"}


def _expected(tp: Any) -> str:
    """What the annotation ``tp`` accepts, in words: "an int or None", "a bool", ..."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    parts = [_expected(a) for a in args if a is not type(None)] if args else []
    if args:
        return " or ".join([*parts, "None"] if type(None) in args else parts)
    if typing.get_origin(tp) is tuple:
        return "a list or tuple of component names (str)"
    if typing.get_origin(tp) is collections.abc.Callable:
        return "a function (callable)"
    return _WORDS.get(tp, repr(tp))


def check_types(config: RunConfig) -> None:
    hints = _types()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if looks_like_component(value):
            raise ConfigError(collision(f.name, value))
        if not _fits(hints[f.name], value):
            expects = f.metadata["expects"] or _expected(hints[f.name])
            raise ConfigTypeError(
                f"Run option {f.name}= must be {expects}, got {value!r} ({type(value).__name__})"
            )


def looks_like_component(obj: Any) -> bool:
    """A module, optimizer, loader, generator or any object with state_dict/load_state_dict:
    something to track, never an option's value."""
    if isinstance(obj, (torch.nn.Module, torch.Generator)):
        return True
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def collision(name: str, obj: Any) -> str:
    return (
        f"Run keyword {name!r} names the Run option {name}= (RunConfig.{name}), but the value "
        f"is a {type(obj).__name__}, a component to track; a component cannot take an "
        f"option's name as a keyword. Pass it as components={{{name!r}: ...}} (tracked under "
        f"the name {name!r}), or give it another name"
    )


def split_arguments(
    config: RunConfig | None, components: Mapping[str, Any] | None, kwargs: dict[str, Any]
) -> tuple[RunConfig, dict[str, Any]]:
    """``Run(dir, config=..., components=..., **kwargs)`` -> (the options, the components).

    Keywords that are option names are options (a component-like value there is an error);
    the rest are components, as are the entries of ``components`` (any names, options' too).
    """
    if config is not None and not isinstance(config, RunConfig):
        raise ConfigTypeError(
            f"Run(config=...) takes an unbroken.RunConfig, got a {type(config).__name__}; to "
            "track a component named 'config', pass components={'config': obj}"
        )
    fields = RunConfig.fields()
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    for name, value in options.items():
        if looks_like_component(value):
            raise ConfigError(collision(name, value))
    if config is not None and options:
        listed = ", ".join(f"{k}=" for k in sorted(options))
        raise ConfigError(
            f"Run got config= and the keyword option(s) {listed}; pass the options one way: "
            f"in the RunConfig (dataclasses.replace(config, {next(iter(sorted(options)))}=...)) "
            "or all as keywords"
        )
    if components is not None:
        if not isinstance(components, Mapping):
            raise ConfigTypeError(
                f"Run(components=...) takes a dict of name -> component, got a "
                f"{type(components).__name__}"
            )
        for name in components:
            if not isinstance(name, str) or not name:
                raise ConfigTypeError(f"Run(components=...): names must be strings, got {name!r}")
            if name in kwargs:
                raise ConfigError(
                    f"component {name!r} is given twice: as a keyword of Run and in "
                    "components=; keep one"
                )
        kwargs = {**kwargs, **components}
    return (config if config is not None else RunConfig(**options)), kwargs


_HMS = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_duration(value: Any, name: str) -> float | None:
    """Seconds from a number or ``[D-][HH:]MM:SS`` (SLURM's notation)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")
        return float(value)
    m = _HMS.match(str(value).strip())
    if not m:
        raise ConfigError(f"{name} must be seconds or [D-]HH:MM:SS, got {value!r}")
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


def deadline(start: float, config: RunConfig) -> float | None:
    """The wall-clock time (``time.time()``) by which the process must have saved and exited."""
    limits = []
    budget = config.time_limit_seconds()
    if budget is not None:
        limits.append(start + budget)
    slurm_end = os.environ.get("SLURM_JOB_END_TIME")
    if slurm_end and slurm_end.isdigit():
        limits.append(float(slurm_end))
    return min(limits) if limits else None


def option_hint(name: str) -> str:
    # A mistyped option arrives as a component of the wrong type: say which option was meant.
    close = difflib.get_close_matches(name, sorted(RunConfig.fields()), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"; it is not a Run option either{hint}"
