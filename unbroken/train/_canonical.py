"""Canonical micro-shards: the same update, bit for bit, on every world size that divides K.

A plain DDP all-reduce sums the ranks' gradients in an order fixed by the world size, so a run
resumed on another number of ranks agrees with the original only up to rounding. Here the global
batch is cut into K shards fixed by the data stream (shard k is the k-th K-th of the global
batch, whatever the world size); each rank runs forward and backward on each of its K/W shards
separately (same shapes, same inputs, same kernels: the same bits as on any other rank), keeps
one flat gradient per shard, and the K shard gradients are added in shard order 0, 1, ..., K-1
(:class:`_Chain`: a partial sum passed from rank to rank, bucket by bucket, during the last
shard's backward). Random draws inside a shard (dropout) come from a generator seeded from
(seed, call, shard), not from the rank's stream.

What stays the user's: the loss, ``optimizer.step()``, GradScaler, clipping, EMA, schedules.
``p.grad`` holds, after the last shard of a synchronised call, exactly what DDP would hold up to
rounding: the mean over shards (DDP: over ranks) of the shard-mean gradients, added to whatever
``p.grad`` held before (backward's accumulation semantics).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _dist
from ..data._seeding import derive
from ..errors import ConfigError
from ..state._adapters import _is_dtensor, unwrap

STATE_VERSION = 1
# Elements per message of the chain sum: bucket b is on the wire while bucket b+1 is added.
_BUCKET = 1 << 19


@dataclass
class _Layout:
    """Where each parameter's gradient lives in the flat per-shard buffers (one per dtype)."""

    params: list[torch.nn.Parameter]
    groups: dict[torch.dtype, list[tuple[int, int, int]]]  # dtype -> (param idx, offset, numel)
    sizes: dict[torch.dtype, int]
    device: torch.device


class CanonicalGradients:
    """Make every world size dividing ``shards`` compute the very same update.

    ``model``: the (DDP-wrapped or plain) module, or a function returning the current one
    (``lambda: run.model`` after model changes). ``scaler``: a GradScaler whose scale
    :meth:`backward` applies. ``seed``: the per-shard random streams' seed. ``overlap``: add
    up and send gradient buckets during the last shard's backward, as DDP overlaps its
    all-reduce (that shard then takes a single :meth:`backward` call); ``False``: after the
    shard. The bits are the same either way. Track it in the run
    (``Run(..., canonical=canon)``) so its call count, which seeds those streams, resumes too::

        canon = unbroken.train.CanonicalGradients(net, shards=6, scaler=scaler)
        run = unbroken.Run("runs/x", model=net, optimizer=opt, loader=loader, canonical=canon)
        for x, y in run.loop(loader):
            for xs, ys in canon.shards(x, y, sync=not run.accumulating):
                canon.backward(F.cross_entropy(net(xs), ys))
            opt.step(); opt.zero_grad()
            run.step(loss=canon.loss)
    """

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        shards: int,
        *,
        scaler: Any = None,
        seed: int = 0,
        group: Any = None,
        overlap: bool = True,
    ) -> None:
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ConfigError(f"CanonicalGradients: shards must be a positive int, got {shards!r}")
        self.num_shards = shards
        self.scaler = scaler
        self.seed = int(seed)
        self.group = group
        self.overlap = bool(overlap)
        self._get = model if not isinstance(model, torch.nn.Module) else (lambda: model)
        self.world = _dist.world_size() if group is None else dist.get_world_size(group)
        self.rank = _dist.rank() if group is None else dist.get_rank(group)
        if shards % self.world:
            raise ConfigError(
                f"CanonicalGradients: {shards} shards cannot be split over {self.world} ranks; "
                f"run on a world size that divides {shards} (or choose shards as a multiple of "
                "every world size you will use, e.g. 12 for 1, 2, 3, 4, 6)"
            )
        self.calls = 0
        """Calls of :meth:`shards` so far (seeds the per-shard random streams; saved)."""
        self.loss: torch.Tensor | None = None
        """After a synchronised call: the mean over shards of the losses given to
        :meth:`backward` (summed over unsynchronised calls), the same on every rank."""
        self._layout: _Layout | None = None
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self._recv: dict[Any, torch.Tensor] = {}
        self._has: list[list[bool]] = []
        self._losses: torch.Tensor | None = None
        self._pending = False  # unsynchronised shards are waiting in the buffers
        self._shard: int | None = None  # the local shard being computed, inside shards()
        self._backed = False
        self._counted: list[bool] = []
        self._checked = False
        self._several = False  # a shard has seen several backward() calls
        self._chain: _Chain | None = None  # the sum under way in a synchronised call
        self._hooks: list[Any] = []
        self._index: dict[int, int] = {}  # id(param) -> its index in the layout
        self._plan: list[tuple[torch.dtype, int, int]] = []  # buckets, in the order summed
        self._param_buckets: list[list[int]] = []  # per parameter: the buckets it reaches
        self._where: list[tuple[torch.dtype, int]] = []  # per parameter: its flat buffer, offset
        self._bucket_entries: list[list[tuple[int, int, int]]] = []  # per bucket: its params
        if isinstance(model, torch.nn.Module):  # a function may name a run not built yet
            self._check_startup(model)

    # ---- start-up checks ------------------------------------------------------------------------

    def _check_startup(self, model: torch.nn.Module) -> None:
        self._checked = True
        inner = unwrap(model)
        if any(_is_dtensor(p) for p in inner.parameters()) or type(inner).__name__.startswith(
            "FSDP"
        ):
            raise ConfigError(
                "CanonicalGradients does not support FSDP2 (sharded parameters are "
                "reduce-scattered in an order fixed by the world size); use DDP or a plain module"
            )
        norms = [n for n, m in inner.named_modules() if _running_stats(m)]
        if norms:
            warnings.warn(
                f"CanonicalGradients: {norms[0]!r} keeps running statistics; they are updated by "
                "the shards each rank computes, so they (not the gradients) depend on the world "
                "size. Use track_running_stats=False, or LayerNorm/GroupNorm",
                stacklevel=3,
            )
        if torch.cuda.is_available() and not torch.are_deterministic_algorithms_enabled():
            warnings.warn(
                "CanonicalGradients: torch.use_deterministic_algorithms(True) is off; CUDA kernels "
                "(atomics in index_add, scatter, some convolutions) may change the bits from run "
                "to run, and then from world size to world size",
                stacklevel=3,
            )
        threads = _dist.all_gather_object(torch.get_num_threads(), self.group)
        if len(set(threads)) > 1:
            warnings.warn(
                f"CanonicalGradients: ranks use different intra-op thread counts {threads}; CPU "
                "reductions split by thread, so shards computed on different ranks may differ "
                "in the last bit. Call torch.set_num_threads(N) with the same N everywhere",
                stacklevel=3,
            )

    # ---- the user's loop ------------------------------------------------------------------------

    def shards(self, *batch: Any, sync: bool = True) -> Iterator[Any]:
        """Yield this rank's canonical shards of its slice of the global batch.

        Each item has the structure of ``batch`` (one argument: that object itself), cut along
        dim 0. Call :meth:`backward` once per shard. With ``sync=True`` (the default) the
        step's gradient is formed when the last shard is done; ``sync=False`` keeps it pending
        (gradient accumulation: ``sync=not run.accumulating``).
        """
        model = self._get()
        if not self._checked:
            self._check_startup(model)
        per = self.num_shards // self.world
        first = self.rank * per
        pieces = _split(batch[0] if len(batch) == 1 else batch, per, self.num_shards, self.world)
        layout = self._ensure_layout(model)
        # Gradients already in p.grad stay out of the shards; the result is added to them.
        stash = [p.grad for p in layout.params]
        for p in layout.params:
            p.grad = None
        call = self.calls
        self.calls += 1
        with ExitStack() as stack:
            no_sync = getattr(model, "no_sync", None)
            if callable(no_sync):  # DDP must not all-reduce: the shards are summed here
                stack.enter_context(no_sync())
            for j, piece in enumerate(pieces):
                self._shard, self._backed = j, False
                seed = derive(self.seed, call, first + j, domain=b"canonical-shard")
                if sync and j == per - 1:
                    # The last shard's backward completes each parameter's gradient: its hook
                    # counts it, and a bucket whose parameters are all complete is summed and
                    # sent on while backward goes on (DDP's overlap, in the canonical order).
                    live = self.overlap and not self._several
                    self._chain = _Chain(self, layout, live=live)
                try:
                    with _forked_rng(seed):
                        yield piece
                except BaseException:
                    self._chain = None
                    raise
                finally:
                    self._shard = None
                if not self._backed:
                    self._chain = None
                    raise ConfigError(
                        f"CanonicalGradients: shard {first + j} ended without canon.backward(loss)"
                    )
                self._harvest(layout, j)
        self._pending = True
        if sync:
            self._reduce(layout)
        for p, old in zip(layout.params, stash, strict=True):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the current shard (scaled by the scaler if one was given)."""
        j = self._shard
        if j is None:
            raise ConfigError("CanonicalGradients.backward() must be called inside canon.shards()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError("CanonicalGradients.backward() needs the shard's scalar loss tensor")
        assert self._losses is not None
        chain = self._chain
        if chain is not None and chain.live and self._backed:
            raise ConfigError(
                "CanonicalGradients: a second backward() in the last shard of a synchronised call; "
                "its gradients are already on their way to the other ranks. Add the losses and "
                "call backward() once, or construct CanonicalGradients(..., overlap=False)"
            )
        if self._backed:  # several backward() calls a shard: from now on, sum after the shard
            self._several = True
        value = loss.detach().float().reshape(()).cpu()
        self._losses[j] = value if not self._counted[j] else self._losses[j] + value
        self._counted[j] = self._backed = True
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward()

    # ---- gradients ------------------------------------------------------------------------------

    def _ensure_layout(self, model: torch.nn.Module) -> _Layout:
        params = [p for p in unwrap(model).parameters() if p.requires_grad]
        old = self._layout
        if old is not None and len(old.params) == len(params):
            if all(a is b for a, b in zip(old.params, params, strict=True)):
                return old
        if self._pending:
            raise ConfigError(
                "CanonicalGradients: the model's parameters changed while gradients were pending "
                "(sync=False); change the model only at a step boundary"
            )
        groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        sizes: dict[torch.dtype, int] = {}
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ConfigError(f"CanonicalGradients: parameters on several devices {devices}")
        for i, p in enumerate(params):
            off = sizes.get(p.dtype, 0)
            groups.setdefault(p.dtype, []).append((i, off, p.numel()))
            sizes[p.dtype] = off + p.numel()
        per = self.num_shards // self.world
        device = params[0].device if params else torch.device("cpu")
        self._layout = _Layout(params, groups, sizes, device)
        self._bufs = {dt: torch.zeros(per, n, dtype=dt, device=device) for dt, n in sizes.items()}
        self._plan_buckets(self._layout)
        self._has = [[False] * len(params) for _ in range(per)]
        self._losses = torch.zeros(per)
        self._counted = [False] * per
        return self._layout

    def _plan_buckets(self, layout: _Layout) -> None:
        """Cut the flat buffers into buckets, last parameters first (backward's order), and
        hook every parameter so that the last shard's backward can send buckets early."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._index = {id(p): i for i, p in enumerate(layout.params)}
        self._plan = [
            (dt, lo, min(n, lo + _BUCKET))
            for dt, n in reversed(layout.sizes.items())
            for lo in reversed(range(0, n, _BUCKET))
        ]
        where = {(dt, lo): b for b, (dt, lo, _) in enumerate(self._plan)}
        self._param_buckets = [[] for _ in layout.params]
        self._where = [(p.dtype, 0) for p in layout.params]
        self._bucket_entries = [[] for _ in self._plan]
        for dt, entries in layout.groups.items():
            for i, off, n in entries:
                self._where[i] = (dt, off)
                if not n:
                    continue
                for lo in range(off - off % _BUCKET, off + n, _BUCKET):
                    b = where[(dt, lo)]
                    self._param_buckets[i].append(b)
                    self._bucket_entries[b].append((i, off, n))
        me = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            canon = me()
            if canon is not None and canon._chain is not None and canon._chain.live:
                canon._chain.ready(p)

        for p in layout.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _harvest(self, layout: _Layout, j: int) -> None:
        """Move the shard's gradients out of ``p.grad`` into its flat buffer."""
        chain = self._chain if self._chain is not None and self._chain.live else None
        for dt, entries in layout.groups.items():
            buf = self._bufs[dt][j]
            for i, off, n in entries:
                p = layout.params[i]
                if chain is not None and chain.taken[i] and p.grad is not None:
                    self._chain = None
                    raise ConfigError(
                        "CanonicalGradients: a parameter's gradient grew again after it was sent "
                        "to the other ranks (a second accumulation in the last shard of a "
                        "synchronised call, e.g. a weight shared across reentrant checkpoints); "
                        "construct CanonicalGradients(..., overlap=False)"
                    )
                self._take(p, i, buf[off : off + n], j)

    def _take(self, p: torch.Tensor, i: int, dst: torch.Tensor, j: int) -> None:
        g = p.grad
        if g is None:
            return
        has = self._has[j]
        if has[i]:
            dst.add_(g.reshape(-1))
        else:
            dst.copy_(g.reshape(-1))
            has[i] = True
        p.grad = None

    def _reduce(self, layout: _Layout) -> None:
        """Sum the K shards' gradients in shard order (every rank alike) into ``p.grad``."""
        assert self._losses is not None
        chain = self._chain
        if chain is None:
            chain = _Chain(self, layout, live=False)
        self._chain = None
        chain.advance(block=True)
        flags = torch.tensor(self._has, dtype=torch.float64).reshape(len(self._has), -1)
        side = torch.cat([self._losses.double()[:, None], flags], 1).to(layout.device)
        # Small, exact in float64; issued after every bucket, in the same order on every rank.
        side_all, side_work = self._gather_async(side)
        sums = chain.finish()
        if side_work is not None:
            side_work.wait()
        side_all = side_all.cpu()  # (K, 1 + params)
        losses = side_all[:, 0].float()
        total = losses[0].clone()
        for k in range(1, self.num_shards):
            total += losses[k]
        self.loss = total / self.num_shards
        has = side_all[:, 1:].amax(0) > 0
        for dt, entries in layout.groups.items():
            flat = sums[dt]
            for i, off, n in entries:
                if has[i]:
                    p = layout.params[i]
                    p.grad = flat[off : off + n].view_as(p)
        self._has = [[False] * len(row) for row in self._has]
        self._losses.zero_()
        self._counted = [False] * len(self._counted)
        self._pending = False

    def _global(self, r: int) -> int:
        """The global rank of this group's rank ``r`` (point-to-point calls take global ranks)."""
        if self.group is None or not 0 <= r < self.world:
            return r
        return int(dist.get_global_rank(self.group, r))

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, like.device, shape)
        buf = self._recv.get(key)
        if buf is None:  # kept: a fresh buffer each step costs its page faults again
            buf = self._recv[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def _gather_async(self, local: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Every rank's rows, in rank order: the K shards in canonical order (small tensors)."""
        if self.world == 1:
            return local, None
        shape = (self.world * local.shape[0], *local.shape[1:])
        out = torch.empty(shape, dtype=local.dtype, device=local.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return out, gather(out, local, group=self.group, async_op=True)

    # ---- Stateful -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self._pending:
            raise ConfigError(
                "CanonicalGradients: saving while gradients are pending (sync=False); save at a "
                "step boundary"
            )
        return {
            "version": STATE_VERSION,
            "shards": self.num_shards,
            "seed": self.seed,
            "threads": torch.get_num_threads(),
            "calls": self.calls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"CanonicalGradients state has version {state.get('version')!r}")
        self.calls = int(state["calls"])
        for key, now in (("shards", self.num_shards), ("seed", self.seed)):
            if state[key] != now:
                warnings.warn(
                    f"CanonicalGradients: {key} was {state[key]} and is {now} now; the run goes "
                    "on, but no longer computes what a run that kept it would",
                    stacklevel=2,
                )
        if state["threads"] != torch.get_num_threads():
            warnings.warn(
                f"CanonicalGradients: the run was saved with {state['threads']} intra-op threads "
                f"and now has {torch.get_num_threads()}; CPU reductions split by thread, so the "
                "bits may differ from an uninterrupted run. Call torch.set_num_threads("
                f"{state['threads']})",
                stacklevel=2,
            )


class _Chain:
    """The mean over all K shards, per dtype: ``(((g0 + g1) + g2) + ...) / K``, bucket by bucket.

    The adds are elementwise and in shard order, so the bits depend neither on W, nor on the
    rank, nor on the thread count. Rank r holds shards r*K/W .. (r+1)*K/W - 1, a contiguous run
    of that order, so the sum is a chain: rank 0 adds its shards and sends the partial sum to
    rank 1, which adds its own onto it, in order, and sends it on; the last rank divides by K and
    broadcasts the result. Each link carries P elements however large K is (an all-gather of
    every shard carried (W-1)/W x K x P to each rank), and no rank adds more than its own rows.

    Buckets go in a fixed order, last parameters first. ``live``: the last shard's backward is
    under way and each parameter's hook (:meth:`ready`) adds its gradient in; a bucket whose
    parameters are all in (and, past rank 0, whose partial sum has arrived) is summed and sent
    on at once, while backward computes the rest. What is left is done in :meth:`finish`.
    """

    def __init__(self, canon: CanonicalGradients, layout: _Layout, *, live: bool) -> None:
        self.canon, self.layout, self.live = canon, layout, live
        self.per = canon.num_shards // canon.world
        self.left = [len(e) for e in canon._bucket_entries]  # parameters not yet complete
        self.seen = [False] * len(layout.params)  # complete in the last shard's backward
        self.taken = [False] * len(layout.params)  # moved into its row: in a bucket under way
        self.next = 0  # the next bucket to sum
        self.works: list[Any] = []
        self.out = {
            dt: torch.empty(n, dtype=dt, device=layout.device) for dt, n in layout.sizes.items()
        }
        rank, world = canon.rank, canon.world
        self.first, self.last = rank == 0, rank == world - 1
        self.prev, self.nxt, self.root = (canon._global(r) for r in (rank - 1, rank + 1, world - 1))
        self.partial: dict[torch.dtype, torch.Tensor] = {}
        if not self.last and not (self.first and self.per == 1):  # rank 0 sends its one row
            self.partial = {
                dt: canon._buffer("partial", (n,), self.out[dt]) for dt, n in layout.sizes.items()
            }
        self.recvs: list[Any] = []
        if not self.first:  # posted at once: a sender never waits for this rank to get here
            for b, (dt, lo, hi) in enumerate(canon._plan):
                into = (self.out if self.last else self.partial)[dt][lo:hi]
                self.recvs.append(dist.irecv(into, src=self.prev, group=canon.group, tag=b))

    def ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient in the last shard is complete: send the buckets that are done.

        The gradient stays in ``p.grad`` until its bucket goes: were it accumulated again in
        this backward, autograd adds it there first, as it always did.
        """
        i = self.canon._index.get(id(p))
        if i is None or self.seen[i]:
            return
        self.seen[i] = True
        for b in self.canon._param_buckets[i]:
            self.left[b] -= 1
        self.advance(block=False)

    def advance(self, block: bool) -> None:
        """Sum and send buckets in order while they are ready (``block``: all, waiting)."""
        canon = self.canon
        plan = canon._plan
        while self.next < len(plan):
            b = self.next
            if not block and (
                self.left[b] > 0 or (not self.first and not self.recvs[b].is_completed())
            ):
                return
            self._bucket(b, *plan[b])
            self.next += 1

    def _bucket(self, b: int, dt: torch.dtype, lo: int, hi: int) -> None:
        canon = self.canon
        rows = canon._bufs[dt]
        if self.live:  # the last shard's gradients, still in p.grad, go into its row
            j = self.per - 1
            for i, _, _ in canon._bucket_entries[b]:
                if not self.taken[i]:
                    self.taken[i] = True
                    p = self.layout.params[i]
                    pdt, off = canon._where[i]
                    canon._take(p, i, canon._bufs[pdt][j][off : off + p.numel()], j)
        # A segment no shard of this call wrote holds an earlier step's values: there the
        # shard's gradient is zero, and the adds must see +0.0 (as they always did).
        for j, has in enumerate(canon._has):
            for i, off, n in canon._bucket_entries[b]:
                if not has[i]:
                    rows[j, max(lo, off) : min(hi, off + n)].zero_()
        if self.first and self.per == 1 and not self.last:
            acc = rows[0, lo:hi]
        elif self.first:
            acc = (self.out if self.last else self.partial)[dt][lo:hi]
            _fold(acc, rows, lo, hi)
        else:
            self.recvs[b].wait()
            acc = (self.out if self.last else self.partial)[dt][lo:hi]
            for j in range(self.per):
                acc.add_(rows[j, lo:hi])
        group = canon.group
        if self.last:
            acc.div_(canon.num_shards)
            if not self.first:
                self.works.append(dist.broadcast(acc, src=self.root, group=group, async_op=True))
        else:
            self.works.append(dist.isend(acc, dst=self.nxt, group=group, tag=b))
            into = self.out[dt][lo:hi]
            self.works.append(dist.broadcast(into, src=self.root, group=group, async_op=True))

    def finish(self) -> dict[torch.dtype, torch.Tensor]:
        self.advance(block=True)
        for work in self.works:
            work.wait()
        return self.out


def _fold(acc: torch.Tensor, rows: torch.Tensor, lo: int, hi: int) -> None:
    """``acc = rows[0] + rows[1] + ...`` over columns ``lo:hi``, added left to right."""
    if rows.shape[0] == 1:
        acc.copy_(rows[0, lo:hi])
        return
    torch.add(rows[0, lo:hi], rows[1, lo:hi], out=acc)
    for j in range(2, rows.shape[0]):
        acc.add_(rows[j, lo:hi])


def _running_stats(m: torch.nn.Module) -> bool:
    """BatchNorm / InstanceNorm that update running statistics in training."""
    return bool(getattr(m, "track_running_stats", False)) and isinstance(
        getattr(m, "running_mean", None), torch.Tensor
    )


@contextmanager
def _forked_rng(seed: int) -> Iterator[None]:
    """Draws inside the block come from ``seed``; the rank's own streams are put back after."""
    # This rank's device only: touching another device's generator creates a context there.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield


def _split(batch: Any, per: int, k: int, world: int) -> list[Any]:
    """``per`` equal pieces of a (nested) batch along dim 0."""
    sizes: set[int] = set()
    _dim0(batch, sizes)
    if len(sizes) != 1:
        raise ConfigError(
            "CanonicalGradients: the batch needs tensors whose first dimensions agree (got "
            f"{sorted(sizes) or 'none'})"
        )
    n = sizes.pop()
    if n % per:
        raise ConfigError(
            f"CanonicalGradients: this rank's batch of {n} samples cannot be cut into {per} equal "
            f"shards; the global batch ({n * world}) must be a multiple of shards={k} (an "
            "epoch's last, smaller batch too: use drop_last=True or a dataset length that is a "
            "multiple of the batch size)"
        )
    size = n // per
    return [_take(batch, j * size, (j + 1) * size) for j in range(per)]


def _dim0(obj: Any, out: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.add(obj.shape[0] if obj.dim() else -1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _dim0(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _dim0(v, out)


def _take(obj: Any, lo: int, hi: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[lo:hi]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_take(v, lo, hi) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_take(v, lo, hi) for v in obj)
    if isinstance(obj, dict):
        return {key: _take(v, lo, hi) for key, v in obj.items()}
    return obj
