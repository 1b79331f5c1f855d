"""What a run tracks: the user's components, its counters and the global random streams; and
how many checkpoints it keeps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..data._contract import check_world, is_loader
from ..errors import ConfigError
from ..process import _log
from ..process._protocol import ProcessContext
from ..state import Counters, GlobalRNG, Registry
from ..store import Retention
from ._audit import refuse_untrackable
from ._config import RunConfig, option_hint
from ._reduction import fix_layouts

RESERVED = ("counters", "rng")
log = _log.get("run")


def track(
    components: Mapping[str, Any], counters: Counters, config: RunConfig, rank: int, world: int
) -> Registry:
    """The registry of a run: the user's components, then the counters and the RNG streams."""
    registry = Registry()
    for name, obj in components.items():
        if name in RESERVED:
            raise ConfigError(f"component name {name!r} is reserved by unbroken; rename it")
        try:
            refuse_untrackable(obj)
            registry.add(name, obj)
        except ConfigError as e:
            raise ConfigError(f"Run keyword {name!r}: {e}{option_hint(name)}") from None
        if is_loader(obj):
            check_world(name, obj, rank, world)
    registry.add("counters", counters)
    registry.check_untracked_parameters()
    fix_layouts(list(registry.modules().values()))  # DDP: one reduction layout for the run
    if config.track_rng:
        registry.add("rng", GlobalRNG())
    return registry


def retention(config: RunConfig, process: ProcessContext, rank: int) -> Retention:
    if process.keep_all and config.keep_last is not None:
        # `unbroken verify` compares both runs at every checkpoint step: it asks every run it
        # launches to keep them all. Said, not silently done.
        if rank == 0:
            log.info(
                "unbroken: keeping every checkpoint (keep_last=%d set aside): this launch is "
                "run by `unbroken verify`",
                config.keep_last,
            )
        return Retention(None, config.keep_every)
    return Retention(config.keep_last, config.keep_every)


def remote_retention(config: RunConfig, process: ProcessContext) -> Retention:
    """The object store's retention (``remote_keep_last``); all kept under ``unbroken verify``."""
    return Retention(None if process.keep_all else config.remote_keep_last, config.keep_every)
