"""Which checkpoint a starting run continues from: one pure function over what the tiers hold.

The tiers list what they hold -- the run directory, the object store of ``remote=``, the
in-memory snapshot area under ``unbroken run`` -- as :class:`~unbroken.store._entry.Entry`
(step, tier, where, whether it verifies and why not). :func:`choose` decides from those
listings alone, without any I/O, and returns a :class:`Decision`: the step, the tier it comes
from, what to move aside and why, what to fetch or keep, whether to upload it.
:class:`~._resume.Resumer` carries the decision out (rank 0), every rank loads the step, and a
step that cannot be brought into the run directory or fails its checksums while loading is
marked unusable in the listings before the choice is made again: the one fallback loop.

Entries are verified lazily: ``choose`` walks the candidates in the order it prefers them and
returns ``Decision(check=...)`` at the first one it has no verdict for; the caller verifies it
(from metadata) and asks again. So a resume verifies what walking the tiers newest first did --
usually the newest checkpoint alone -- and ``choose`` stays a function of its arguments.

The rules:

- ``start_over=True``: a fresh start; every local checkpoint (and the metrics log) moves into
  ``abandoned-<time>/``, every remote one aside (nothing is deleted).
- ``resume=False``: a fresh start; checkpoints in the run directory or the store are an error.
- ``resume=True``: the newest step that verifies in any tier. At one step the local copy comes
  first, then the snapshot, then the remote copy (no copy, a copy from memory, a download).
  Newer local checkpoints that cannot be used are moved aside with the reason (so that neither
  saving their step again nor retention destroys them); newer remote ones and snapshots that do
  not verify are reported and left in place. Checkpoints none of which verifies are an error
  listing each -- never a fresh start on top of them (a reader that cannot read what an older
  version wrote must not let retention delete it). Snapshots never make that error: one that
  is not usable (another run's, a node's part of a snapshot over several nodes) is no
  checkpoint of this run directory.
- ``resume=STEP``: that step, from the first tier (same order) that holds it verified; newer
  checkpoints of the run directory and the store are moved aside (history forks there).
- A step taken from the store is fetched into the run directory first, one from the snapshot
  area committed into it: the run loads from the local tier, always. With ``remote=``, a step
  taken from elsewhere is uploaded unless the store holds it verified.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ..store._entry import LOCAL, REMOTE, SNAPSHOT, Entry

ORDER = {LOCAL: 0, SNAPSHOT: 1, REMOTE: 2}
"""At one step, the tier taken first."""


@dataclass(frozen=True)
class Listings:
    """What each tier holds, newest first."""

    local: tuple[Entry, ...]
    local_root: str
    """The run directory's ``checkpoints`` folder (for messages)."""
    remote: tuple[Entry, ...] | None = None
    """None: no remote tier (``remote=`` not given)."""
    remote_root: str = ""
    """The store's ``.../checkpoints`` URL (for messages)."""
    snapshot: tuple[Entry, ...] = ()

    def all(self) -> list[Entry]:
        return [*self.local, *self.snapshot, *(self.remote or ())]

    def replaced(self, new: Entry) -> Listings:
        """With ``new`` in place of the entry of its tier and step (added if there is none)."""
        return self._edit(new.tier, new.step, new)

    def without(self, tier: str, step: int) -> Listings:
        return self._edit(tier, step, None)

    def unusable(self, tier: str, step: int, why: str) -> Listings:
        """The entry of ``tier`` at ``step``, if any, marked unusable."""
        found = [e for e in self._tier(tier) if e.step == step]
        return self.replaced(found[0].unusable(why)) if found else self

    def _tier(self, tier: str) -> tuple[Entry, ...]:
        return {LOCAL: self.local, REMOTE: self.remote or (), SNAPSHOT: self.snapshot}[tier]

    def _edit(self, tier: str, step: int, new: Entry | None) -> Listings:
        kept = [e for e in self._tier(tier) if e.step != step]
        if new is not None:
            kept.append(new)
        entries = tuple(sorted(kept, key=lambda e: -e.step))
        if tier == LOCAL:
            return replace(self, local=entries)
        if tier == SNAPSHOT:
            return replace(self, snapshot=entries)
        return replace(self, remote=entries)


@dataclass(frozen=True)
class Decision:
    """What :func:`choose` decided; ``check`` non-empty: nothing yet (verify those first)."""

    step: int | None = None
    """The step to resume from; None: a fresh start."""
    source: str | None = None
    """Where it comes from: LOCAL (the run directory has it), REMOTE (fetch it into the run
    directory first), SNAPSHOT (commit it into the run directory first)."""
    set_aside: tuple[Entry, ...] = ()
    """Local checkpoints newer than ``step`` (or of ``step``, when it comes from another tier)
    that cannot be used, each with its reason: moved aside as ``unusable-...``."""
    supersede: tuple[Entry, ...] = ()
    """Checkpoints newer than an explicit ``resume=STEP`` (history forks there), and on
    ``start_over`` the remote ones: moved aside as ``superseded-...``."""
    abandon: bool = False
    """``start_over``: every local checkpoint and the metrics log into ``abandoned-<time>/``."""
    skipped: tuple[Entry, ...] = ()
    """Remote checkpoints and snapshots newer than ``step`` that do not verify: reported, left
    where they are."""
    upload: bool = False
    """``remote=``: the store does not hold ``step`` verified (upload it in the background)."""
    check: tuple[Entry, ...] = ()
    """Entries whose verdict the choice needs: verify them and choose again."""


def choose(listings: Listings, *, resume: bool | int = True, start_over: bool = False) -> Decision:
    """The decision for ``listings`` (see the module's docstring for the rules). Raises
    ConfigError (``resume=False`` and checkpoints exist), CheckpointNotFoundError (no tier holds
    ``resume=STEP``), CorruptCheckpointError (checkpoints exist and none verifies)."""
    if start_over:
        return Decision(abandon=True, supersede=tuple(listings.remote or ()))
    if resume is False:
        if listings.local:
            raise ConfigError(
                f"resume=False but {listings.local_root} already holds checkpoints; use another "
                "run directory, resume=True, or start_over=True (moves them aside)"
            )
        if listings.remote:
            steps = [e.step for e in listings.remote]
            raise ConfigError(
                f"resume=False but {listings.remote_root} already holds checkpoints (steps "
                f"{steps[:5]}...); use another remote prefix, resume=True, or start_over=True "
                "(moves them aside)"
            )
        return Decision()
    if resume is True:
        return _newest(listings)
    return _exact(listings, int(resume))


def _ordered(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (-e.step, ORDER[e.tier]))


def _newest(listings: Listings) -> Decision:
    order = _ordered(listings.all())
    for e in order:
        if e.ok is None:
            return Decision(check=(e,))
        if e.ok:
            return _take(listings, e, newer=True)
    durable = [e for e in order if e.tier != SNAPSHOT]
    if durable:
        raise _none_loads(listings, durable)
    return Decision(skipped=tuple(order))  # a fresh start: snapshots of no use were reported


def _exact(listings: Listings, step: int) -> Decision:
    held = _ordered([e for e in listings.all() if e.step == step])
    for e in held:
        if e.ok is None:
            return Decision(check=(e,))
        if e.ok:
            d = _take(listings, e, newer=False)
            newer = [x for x in (*listings.local, *(listings.remote or ())) if x.step > step]
            return d if d.check else replace(d, supersede=tuple(newer))
    if not [e for e in held if e.tier != SNAPSHOT]:
        have = sorted(e.step for e in listings.local)
        where = f"no checkpoint for step {step} in {listings.local_root} (found steps {have})"
        if listings.remote is not None:
            there = sorted(e.step for e in listings.remote)
            where += f" nor in {listings.remote_root} (found steps {there})"
        raise CheckpointNotFoundError(where, path=listings.local_root, step=step)
    first, *others = held
    said = first.why + "".join(f"; its copy in {e.where}: {e.why}" for e in others)
    raise CorruptCheckpointError(said, path=first.where, step=step)


def _take(listings: Listings, chosen: Entry, *, newer: bool) -> Decision:
    """Resume from ``chosen`` (it verifies): what else follows from that. ``newer``: the
    entries newer than it were passed over (every one of them verified and failed)."""
    upload = False
    if listings.remote is not None and chosen.tier != REMOTE:
        twin = [e for e in listings.remote if e.step == chosen.step]
        if twin and twin[0].ok is None:
            return Decision(check=(twin[0],))  # does the store hold it already?
        upload = not (twin and twin[0].ok)
    # Passed over: at its step, the tiers taken before it (verified, failed) -- and with
    # ``newer``, every newer entry (verified, failed: else it would have been chosen).
    first = ORDER[chosen.tier]
    passed = [
        e
        for e in listings.all()
        if (newer and e.step > chosen.step) or (e.step == chosen.step and ORDER[e.tier] < first)
    ]
    return Decision(
        step=chosen.step,
        source=chosen.tier,
        set_aside=tuple(e for e in _ordered(passed) if e.tier == LOCAL),
        skipped=tuple(e for e in _ordered(passed) if e.tier != LOCAL),
        upload=upload,
    )


def _none_loads(listings: Listings, failed: list[Entry]) -> CorruptCheckpointError:
    """Checkpoints exist in the run directory or the store, and none verifies."""
    local = [e for e in failed if e.tier == LOCAL]
    remote = [e for e in failed if e.tier == REMOTE]
    listed = "\n".join(f"  {e.where}: {e.why}" for e in [*local, *remote])
    head = f"none of the {len(failed)} checkpoint(s) in "
    stay = ", so the run does not start over on top of them:\n"
    abandoned = os.path.join(listings.local_root, "abandoned-<time>")
    if not remote:
        return CorruptCheckpointError(
            f"{head}{listings.local_root} can be loaded{stay}{listed}\nRepair or move them "
            "away, or pass start_over=True to Run once to move them into "
            f"{abandoned} (nothing is deleted) and start fresh.",
            path=listings.local_root,
        )
    if not local:
        return CorruptCheckpointError(
            f"{head}{listings.remote_root} can be loaded{stay}{listed}\nRepair or remove them, "
            "or point remote= at another prefix.",
            path=listings.remote_root,
        )
    return CorruptCheckpointError(
        f"{head}{listings.local_root} and {listings.remote_root} can be loaded{stay}{listed}\n"
        "Repair or move them away, point remote= at another prefix, or pass start_over=True "
        f"to Run once to move them into {abandoned} and the store's superseded-<time>/ "
        "(nothing is deleted) and start fresh.",
        path=listings.local_root,
    )
