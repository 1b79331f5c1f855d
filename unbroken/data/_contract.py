"""The one contract every resumable loader meets, and what Run checks against it.

A loader is a component whose position is a count of samples in a global stream. ``Run`` finds
the loaders among its components by this protocol (not by a string tag), counts the batches
they yield to know whether a step drew data, calls ``set_epoch`` where it exists, and checks
that the loader's ``rank``/``world_size`` are torch.distributed's: a loader built for another
world size would feed this rank another rank's samples.

:class:`LoaderBase` is the shared skeleton (rank and world size, the yield counters, the
component flags) that unbroken's loaders inherit; a new source inherits it too, or implements
:class:`Loader` directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from .. import _dist
from ..errors import ConfigError


@runtime_checkable
class Loader(Protocol):
    """What ``unbroken.Run`` needs from a data loader.

    ``epoch`` and ``position`` (samples of that epoch consumed, all ranks together) are the
    position; ``state_dict()`` must describe exactly the batches *yielded* so far (not those
    prefetched), and after ``load_state_dict()`` the next ``iter()`` continues from there.
    ``yielded_batches``/``yielded_samples`` count what this object yielded (not saved).
    ``rank``/``world_size`` say which slice of each global batch this process takes.
    """

    epoch: int
    position: int
    rank: int
    world_size: int
    yielded_batches: int
    yielded_samples: int

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class LoaderBase:
    """The skeleton shared by unbroken's loaders (inherit it, or implement :class:`Loader`)."""

    kind = "loader"  # how `unbroken verify` and inspect group components
    rank_local = False  # one position for all ranks: saved once, loadable at any world size

    def _init_base(self, rank: int | None, world_size: int | None) -> None:
        self.rank = _dist.rank() if rank is None else int(rank)
        self.world_size = _dist.world_size() if world_size is None else int(world_size)
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.epoch = 0
        self.position = 0
        self.yielded_batches = 0
        self.yielded_samples = 0
        """Batches and global samples yielded by this object (process-local, not saved)."""

    def _count(self, samples: int) -> None:
        self.position += samples
        self.yielded_batches += 1
        self.yielded_samples += samples


def is_loader(obj: Any) -> bool:
    """A component Run treats as a loader: one meeting :class:`Loader`, or tagged so by an
    integration that predates the protocol (``kind = "loader"``)."""
    if getattr(obj, "kind", None) == "loader":
        return True
    # Run asks at every step; a runtime protocol check costs ~10 us an object, so objects
    # lacking one of its attributes (models, optimizers) are answered without it.
    return hasattr(obj, "yielded_batches") and isinstance(obj, Loader)


def check_world(name: str, loader: Any, rank: int, world_size: int) -> None:
    """The loader's rank/world size must be torch.distributed's (when it declares them)."""
    lr, lw = getattr(loader, "rank", None), getattr(loader, "world_size", None)
    if lw is None or lr is None:
        return
    if (int(lr), int(lw)) != (rank, world_size):
        raise ConfigError(
            f"loader {name!r} was built for rank {lr} of {lw}, but this process is rank {rank} "
            f"of {world_size} in torch.distributed; build the loader after "
            "init_process_group (or unbroken.init_distributed()) and leave rank/world_size to "
            "their defaults, or pass the process group's values"
        )
