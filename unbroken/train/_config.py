"""Run options, checked up front so a typo fails before any training."""

from __future__ import annotations

import difflib
import numbers
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ConfigError, ConfigTypeError


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Options of :class:`unbroken.Run`: pass one as ``Run(dir, config=RunConfig(...), ...)``,
    or its fields as keyword arguments of ``Run`` (not both). Types are checked here."""

    save_every: int | None = None
    """Save every N optimizer steps."""
    save_every_minutes: float | None = None
    """Save when this many minutes passed since the last save."""
    save_on_epoch_end: bool = False
    """Save whenever an epoch completes."""
    save_final: bool = True
    """Save when training completes (``finish()``, or the end of ``epochs()``/``loop()``)."""
    time_limit: float | str | None = None
    """Wall-time budget of this process, in seconds or ``[D-]HH:MM:SS``; the run saves and exits
    resumable before it ends. SLURM's job end time (``SLURM_JOB_END_TIME``) is honoured too."""
    time_margin: float = 10.0
    """Seconds of slack kept before the budget ends, on top of a step and a save."""
    keep_last: int | None = 3
    """Keep the newest N checkpoints (None keeps all). The environment variable
    ``UNBROKEN_KEEP_ALL=1`` overrides it with None (``unbroken verify`` sets it)."""
    keep_every: int | None = None
    """Also keep checkpoints whose step is a multiple of this."""
    remote: str | None = None
    """An object store URL (``s3://bucket/prefix``) every checkpoint is uploaded to in the
    background after it commits locally; a start resumes from the newest checkpoint that
    verifies in either tier (an empty run directory from the remote one). Needs
    ``unbroken[s3]``; credentials and endpoint from the standard ``AWS_*`` variables and
    files. See docs/remote.md."""
    remote_keep_last: int | None = 3
    """Keep the newest N checkpoints in ``remote`` (None keeps all); ``keep_every`` applies
    too. ``UNBROKEN_KEEP_ALL=1`` overrides it with None."""
    max_steps: int | None = None
    """Training is complete after this many optimizer steps."""
    resume: bool | int = True
    """True: continue from the latest valid checkpoint if there is one; an int: from that step;
    False: start fresh and refuse to run in a directory that has checkpoints. Checkpoints none
    of which loads are an error, never a fresh start (see ``start_over``)."""
    start_over: bool = False
    """Move every checkpoint already in the run directory, and its metrics log, into
    ``checkpoints/abandoned-<UTC time>/`` (nothing is deleted) and start fresh. Meant for one
    launch: left on, every relaunch starts over again."""
    allow_missing: tuple[str, ...] = ()
    """Components that may be absent from the checkpoint (they start fresh)."""
    allow_unexpected: tuple[str, ...] = ()
    """Components the checkpoint may hold that are not tracked now (ignored)."""
    seed: int | None = None
    """On a fresh start, seed Python, NumPy and torch (on resume, the streams are restored)."""
    handle_signals: bool = True
    """SIGTERM, SIGUSR1, SIGINT: finish the step, save, exit with code 75."""
    exit_on_stop: bool = True
    """After a signal or time-budget save, raise SystemExit(75); else ``step()`` returns True."""
    metrics: bool = True
    """Write ``RUN/metrics.jsonl``."""
    progress: bool | None = None
    """Show a tqdm bar (default: when stderr is a terminal)."""
    async_save: bool = False
    """Block training only for a snapshot; write and commit in the background."""
    snapshot_every: int | None = None
    """Under ``unbroken run``: an in-memory snapshot every N steps (0: none; None: as often as
    keeps them under 2% of the step time), persisted by the supervisor if the process dies."""
    verify_checksums: bool = True
    """Check every file's xxh3 before resuming (size checks always happen)."""
    track_rng: bool = True
    """Capture and restore the global Python, NumPy, torch and CUDA random streams."""
    settings: Any = None
    """An ``unbroken.Settings``: values that are constants or functions of (step, epoch)."""
    before_step: Callable[..., Any] | None = None
    """``before_step(ctx)`` at each step start in ``run.loop()``; may return a Change."""
    on_epoch_start: Callable[..., Any] | None = None
    """``on_epoch_start(ctx)`` before the first step of each epoch; may return a Change."""
    model_factory: Callable[[Any], Any] | None = None
    """``model_factory(stage)`` builds the model of a stage (on resume, before loading)."""
    optimizer_factory: Callable[[Any], Any] | None = None
    """``optimizer_factory(model)`` builds the optimizer after a model change (default: the
    same class and param groups, matched by parameter name)."""
    grow: Callable[..., Any] | None = None
    """``grow(name, what, old, new_shape)`` remaps state of a reshaped parameter (see docs)."""
    stage: Any = None
    """The stage of the model you built (JSON-able); recorded in every checkpoint."""
    wrap_model: Callable[[Any], Any] | None = None
    """``wrap_model(model)`` wraps a new model after a change (default: DDP again if the old one
    was DDP; FSDP2 users pass a function that calls ``fully_shard``)."""
    on_save: Callable[[int, str], Any] | None = None
    """``on_save(step, path)`` after each checkpoint is durably committed, on every rank, in
    the training thread (after an ``async_save``: at the next ``step()``, ``wait()`` or
    ``finish()``). For your own logger; see docs/trackers.md."""
    on_resume: Callable[[int, str], Any] | None = None
    """``on_resume(step, path)`` once ``Run()`` restored every component from a checkpoint,
    on every rank (not on a fresh start)."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("save_every", "keep_last", "keep_every", "max_steps", "remote_keep_last"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        if self.save_every_minutes is not None and self.save_every_minutes <= 0:
            raise ConfigError(f"save_every_minutes must be > 0, got {self.save_every_minutes!r}")
        if not isinstance(self.resume, (bool, int)) or (
            not isinstance(self.resume, bool) and self.resume < 0
        ):
            raise ConfigError(f"resume must be True, False or a step number, got {self.resume!r}")
        if self.start_over and not isinstance(self.resume, bool):
            raise ConfigError(
                f"start_over=True starts fresh; it cannot be combined with resume={self.resume!r}"
            )
        if os.environ.get("UNBROKEN_KEEP_ALL") == "1":
            # Set by `unbroken verify`, which compares the runs at every checkpoint step.
            self.keep_last = None
            self.remote_keep_last = None
        if self.remote is not None:
            from ..store._s3 import parse_url

            parse_url(self.remote)  # a malformed URL fails here, before anything runs
        self.allow_missing = tuple(self.allow_missing)
        self.allow_unexpected = tuple(self.allow_unexpected)
        every = self.snapshot_every
        if every is not None and (
            not isinstance(every, int) or isinstance(every, bool) or every < 0
        ):
            raise ConfigError(f"snapshot_every must be an int >= 0 or None, got {every!r}")
        self.time_limit_seconds()

    def time_limit_seconds(self) -> float | None:
        return parse_duration(self.time_limit, "time_limit")

    @classmethod
    def fields(cls) -> frozenset[str]:
        return frozenset(cls.__dataclass_fields__)


# What each option accepts, by kind; a value of the wrong type is a ConfigTypeError (also a
# TypeError) naming the option, before any range check.
_KINDS = {
    "save_every": "int?",
    "save_every_minutes": "real?",
    "save_on_epoch_end": "bool",
    "save_final": "bool",
    "time_limit": "duration?",
    "time_margin": "real",
    "keep_last": "int?",
    "keep_every": "int?",
    "remote": "str?",
    "remote_keep_last": "int?",
    "max_steps": "int?",
    "resume": "resume",
    "start_over": "bool",
    "allow_missing": "names",
    "allow_unexpected": "names",
    "seed": "int?",
    "handle_signals": "bool",
    "exit_on_stop": "bool",
    "metrics": "bool",
    "progress": "bool?",
    "async_save": "bool",
    "snapshot_every": "int?",
    "verify_checksums": "bool",
    "track_rng": "bool",
    "settings": "any",
    "before_step": "callable?",
    "on_epoch_start": "callable?",
    "model_factory": "callable?",
    "optimizer_factory": "callable?",
    "grow": "callable?",
    "stage": "any",
    "wrap_model": "callable?",
    "on_save": "callable?",
    "on_resume": "callable?",
}
_EXPECTED = {
    "int?": "an int or None",
    "real?": "a number or None",
    "real": "a number",
    "bool": "a bool",
    "bool?": "a bool or None",
    "str?": "a string or None",
    "duration?": "seconds (a number), a '[D-]HH:MM:SS' string, or None",
    "resume": "True, False or a step number (int)",
    "names": "a list or tuple of component names (str)",
    "callable?": "a function (callable) or None",
}


def _fits(kind: str, v: Any) -> bool:
    is_int = isinstance(v, int) and not isinstance(v, bool)
    is_real = isinstance(v, numbers.Real) and not isinstance(v, bool)
    if kind.endswith("?") and v is None:
        return True
    return {
        "int?": is_int,
        "real?": is_real,
        "real": is_real,
        "bool": isinstance(v, bool),
        "bool?": isinstance(v, bool),
        "str?": isinstance(v, str),
        "duration?": is_real or isinstance(v, str),
        "resume": isinstance(v, bool) or is_int,
        "names": isinstance(v, (list, tuple, set, frozenset))
        and all(isinstance(n, str) for n in v),
        "callable?": callable(v),
        "any": True,
    }[kind]


def check_types(config: RunConfig) -> None:
    for name, kind in _KINDS.items():
        value = getattr(config, name)
        if looks_like_component(value):
            raise ConfigError(collision(name, value))
        if not _fits(kind, value):
            raise ConfigTypeError(
                f"Run option {name}= must be {_EXPECTED[kind]}, got {value!r} "
                f"({type(value).__name__})"
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


def wall() -> float:
    return time.time()


def option_hint(name: str) -> str:
    # A mistyped option arrives as a component of the wrong type: say which option was meant.
    close = difflib.get_close_matches(name, sorted(RunConfig.fields()), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"; it is not a Run option either{hint}"
