"""DDP gradient reduction in one layout for the whole run, whenever the process started.

Why: a new ``DistributedDataParallel`` (``find_unused_parameters=False``, its default, or
``static_graph=True``) reduces its first backward in one flat bucket per dtype, then rebuilds its
buckets in the order the gradients arrived and keeps that layout. A relaunched process is a new
DDP, so the first step after a resume reduces in the flat layout while the uninterrupted run's
same step used the rebuilt one. An all-reduce adds the ranks' values in an order set by the
element's position in the buffer it reduces (gloo's ring and NCCL's ring and tree alike): at 3
ranks and more, the same gradients reduced at other positions differ in the last bit, and the
run drifts from there. At 2 ranks a + b = b + a hides it.

What: :func:`fix_reduction_layout` registers a DDP communication hook (public API) that reduces
every backward in one *reduction layout*: the buckets DDP's own rebuild makes from the order the
gradients arrive, computed here from that order (``register_post_accumulate_grad_hook``) during
the process's first synchronised backward and agreed on rank 0's. When DDP's bucket is exactly a
layout bucket (every step after the first, as long as DDP buckets as computed here) the hook
reduces DDP's buffer as DDP would: no copy. Otherwise (the first step's flat bucket, or a DDP
bucket that differs) it gathers each layout bucket's gradients into a buffer of its own, reduces
that, and copies the result back: the same additions at the same positions, whatever DDP's
buckets. Gradients are scaled by ``1 / world size`` before the reduction, the very
multiplication DDP makes without a hook, so the hook changes no bits of the steps where DDP's
layout already is the layout.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ResumeWarning
from ..process import _log

log = _log.get("run")

# DDP's default first-bucket cap (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB). Only the
# zero-copy path depends on matching DDP's bucketing; the reduction is exact without it.
_FIRST_BUCKET_BYTES = 1024 * 1024


def fix_layouts(modules: Iterator[Any] | list[Any]) -> None:
    """:func:`fix_reduction_layout` for every DDP among ``modules``; what cannot be fixed is a
    :class:`ResumeWarning`, since a resume at 3 ranks or more is then not bit for bit."""
    from torch.nn.parallel import DistributedDataParallel

    for module in modules:
        if isinstance(module, DistributedDataParallel):
            problem = fix_reduction_layout(module)
            if problem is not None:
                warnings.warn(problem, ResumeWarning, stacklevel=3)


def needs_fixed_layout(ddp: Any) -> bool:
    """Whether ``ddp`` (a DistributedDataParallel) changes its bucket layout after its first
    backward: DDP rebuilds unless it looks for unused parameters without a static graph."""
    return bool(getattr(ddp, "static_graph", False) or not ddp.find_unused_parameters)


def fix_reduction_layout(ddp: Any) -> str | None:
    """Make ``ddp`` reduce every backward in one layout (module docstring). Returns ``None``
    when done or not needed, else why it could not be done (a hook of the user's, say): the
    caller names that loudly, since a resume at 3+ ranks is then not bit for bit."""
    if getattr(ddp, "_unbroken_reduction", None) is not None:
        return None
    if not needs_fixed_layout(ddp):
        return None  # no rebuild: the layout is the same in every process already
    if getattr(ddp, "_comm_hooks", None):
        return (
            "the DistributedDataParallel model has a communication hook of its own, so unbroken "
            "cannot fix its reduction layout: the first step after a resume reduces the "
            "gradients in DDP's first-iteration layout, which at 3 ranks or more is not bit for "
            "bit (docs/distributed.md, 'What is bitwise where')"
        )
    sparse = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    if any(isinstance(m, sparse) and m.sparse for m in ddp.module.modules()):
        # DDP gives a sparse gradient a bucket of its own, reduced as sparse: not flattened.
        return (
            "the DistributedDataParallel model has a sparse embedding (sparse=True): unbroken "
            "does not fix its reduction layout, so the first step after a resume at 3 ranks or "
            "more is not bit for bit (docs/distributed.md, 'What is bitwise where')"
        )
    reduction = _FixedLayout(ddp)
    try:
        ddp.register_comm_hook(reduction, _reduce_bucket)
    except (RuntimeError, AssertionError, ValueError) as e:
        reduction.remove()
        return f"unbroken could not fix the DDP reduction layout ({e}): not bit for bit at 3+ ranks"
    ddp._unbroken_reduction = reduction
    return None


def _reduce_bucket(state, bucket):  # noqa: ANN001, ANN201
    # Unannotated on purpose: DDP's register_comm_hook rejects any bucket annotation but the
    # GradBucket class itself, and this module's annotations are strings.
    return state(bucket)


def reducer_parameters(ddp: Any) -> list[torch.nn.Parameter]:
    """DDP's parameters in its reducer's order: module by module, those that require grad and
    are not ignored, each once (DistributedDataParallel._build_params_for_reducer)."""
    seen: set[int] = set()
    out = []
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    for mname, module in ddp.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{mname}.{pname}" not in ignored and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def bucket_layout(
    order: list[int], params: list[torch.Tensor], limits: list[int]
) -> list[list[int]]:
    """DDP's rebuilt buckets for gradients that arrived in ``order`` (positions into
    ``params``): per dtype and device, a bucket closes once it reaches the current size limit,
    and the limit advances to the next one (the last one repeats)."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int, int]] = {}
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        indices, size, limit_at = open_.get(key, ([], 0, 0))
        indices = [*indices, i]
        size += p.numel() * p.element_size()
        if size >= limits[limit_at]:
            buckets.append(indices)
            open_[key] = ([], 0, min(limit_at + 1, len(limits) - 1))
        else:
            open_[key] = (indices, size, limit_at)
    buckets.extend(indices for indices, _, _ in open_.values() if indices)
    if os.environ.get("DDP_SET_LAST_BUCKET_AS_SMALL", "0") == "1":
        buckets.reverse()
    return buckets


def _limits(ddp: Any) -> list[int]:
    custom = list(getattr(ddp, "bucket_bytes_cap_list", []) or [])
    if custom:
        return custom
    cap = int(ddp.bucket_bytes_cap)
    config = getattr(ddp, "_bucket_config", None)
    first = int(getattr(config, "first_bucket_bytes_cap", _FIRST_BUCKET_BYTES))
    return [first, cap] if first < cap else [cap]


class _Backward:
    """One backward's reduction: which gradients are ready, which layout buckets were launched,
    and the future of each DDP bucket, completed once every layout bucket it shares is reduced."""

    def __init__(self) -> None:
        self.ready: dict[int, torch.Tensor] = {}  # parameter position -> flat gradient view
        self.launched = 0  # layout buckets launched, in layout order
        # DDP bucket index -> [future, its buffer, its parameter positions, the layout buckets
        # it shares that are still being reduced (None until the layout is known)]
        self.waiting: dict[int, list[Any]] = {}


class _FixedLayout:
    """The communication hook (module docstring). Called by DDP's reducer for each bucket once
    its gradients are ready, in bucket order, identically on every rank."""

    def __init__(self, ddp: Any) -> None:
        self.group = ddp.process_group
        self.scale = 1.0 / dist.get_world_size(self.group)
        self.params = reducer_parameters(ddp)
        self.position = {id(p): i for i, p in enumerate(self.params)}
        self.limits = _limits(ddp)
        self.layout: list[list[int]] | None = None
        self.owner: list[int] = []  # parameter position -> its layout bucket
        self.lock = threading.Lock()
        self.backward = _Backward()
        self.zero_copy = 0  # layout buckets reduced in DDP's own buffer (tests read it)
        self.gathered = 0  # ... and through a buffer of their own
        # The arrival order of the gradients of the current backward, until the layout is set.
        self.arrivals: list[int] = []
        self.handles = [ddp.register_forward_pre_hook(self._forward)]
        for i, p in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(self._arrived(i)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _forward(self, module: Any, args: Any) -> None:
        self.arrivals = []  # a new forward: the next backward's order is recorded afresh

    def _arrived(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            self.arrivals.append(i)

        return hook

    # ---- the layout ---------------------------------------------------------------------------

    def _set_layout(self) -> None:
        """From this backward's arrival order, rank 0's on every rank (DDP's rebuild too takes
        rank 0's): every rank must launch the same reductions in the same order."""
        seen = set(self.arrivals)
        order = [i for i in dict.fromkeys(self.arrivals)]
        order += [i for i in reversed(range(len(self.params))) if i not in seen]
        device = self.params[0].device
        mine = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(mine, src=dist.get_global_rank(self.group, 0), group=self.group)
        order = [int(i) for i in mine.tolist()]
        self.layout = bucket_layout(order, list(self.params), self.limits)
        self.owner = [0] * len(self.params)
        for b, members in enumerate(self.layout):
            for i in members:
                self.owner[i] = b
        self.remove()  # the order is known: no hook per gradient from now on
        self.handles = []
        log.debug("DDP reduction layout: %d buckets", len(self.layout))

    # ---- the hook -----------------------------------------------------------------------------

    def __call__(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.mul_(self.scale)  # what DDP does without a hook, as it copies each gradient in
        members = [self.position[id(p)] for p in bucket.parameters()]
        with self.lock:
            bw = self.backward
            for i, g in zip(members, bucket.gradients(), strict=True):
                bw.ready[i] = g.view(-1)
            devices = [buffer.device] if buffer.device.type != "cpu" else None
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
            bw.waiting[bucket.index()] = [future, buffer, members, None]
            if self.layout is None and len(bw.ready) < len(self.params):
                # The first backward's other flat buckets (other dtypes) are still to come.
                return future
            if self.layout is None:
                self._set_layout()
            assert self.layout is not None
            for entry in bw.waiting.values():  # the layout buckets each DDP bucket shares
                if entry[3] is None:
                    entry[3] = {self.owner[i] for i in entry[2]}
            launches = list(self._ready_buckets(bw))
            if bucket.is_last() or bw.launched == len(self.layout):
                self.backward = _Backward()
        for b in launches:
            self._launch(bw, b, members, buffer)
        return future

    def _ready_buckets(self, bw: _Backward) -> Iterator[int]:
        assert self.layout is not None
        while bw.launched < len(self.layout) and all(
            i in bw.ready for i in self.layout[bw.launched]
        ):
            bw.launched += 1
            yield bw.launched - 1

    def _launch(self, bw: _Backward, b: int, members: list[int], buffer: torch.Tensor) -> None:
        assert self.layout is not None
        wanted = self.layout[b]
        if wanted == members:  # DDP's bucket is this layout bucket: reduce it in place
            self.zero_copy += 1
            flat, views = buffer, None
        else:
            self.gathered += 1
            views = [bw.ready[i] for i in wanted]
            flat = torch.cat(views)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        assert work is not None
        work.get_future().then(lambda fut: self._reduced(bw, b, fut, flat, views))

    def _reduced(
        self,
        bw: _Backward,
        b: int,
        fut: torch.futures.Future[Any],
        flat: torch.Tensor,
        views: list[torch.Tensor] | None,
    ) -> None:
        try:
            fut.wait()  # raises the reduction's error, if any
            if views is not None:
                offset = 0
                for v in views:
                    v.copy_(flat[offset : offset + v.numel()])
                    offset += v.numel()
        except Exception as e:  # noqa: BLE001 -- handed to every bucket that waits for it
            with self.lock:
                entries = [e_ for e_ in bw.waiting.values() if e_[3] and b in e_[3]]
            for entry in entries:
                if not entry[0].done():
                    entry[0].set_exception(e)
            return
        done = []
        with self.lock:
            for entry in bw.waiting.values():
                if entry[3] is not None and b in entry[3]:
                    entry[3].discard(b)
                    if not entry[3]:
                        done.append(entry)
        for entry in done:
            entry[0].set_result(entry[1])
