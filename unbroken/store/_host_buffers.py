"""Host copies of a state's tensors in reused buffers: pinned, and issued on a side stream, for
GPU tensors.

A device-to-host copy into pageable memory runs at a fraction of the link's bandwidth and
blocks the calling thread; into pinned (page-locked) memory it runs at the link's speed and
can be issued asynchronously. :class:`Stage` keeps one host buffer per tensor name (pinned
for CUDA tensors), reused from save to save. For CUDA tensors the copies are issued on a side
stream that first waits for the training stream (so they see the step's final values); the
training stream then waits for the side stream on the GPU (so the next step cannot overwrite
a tensor before it is copied) without blocking the host. :meth:`Staged.wait` blocks until the
copies are done: the background writer calls it, not the training thread. CPU tensors are
copied at once, in a few threads (``_par``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _par


class Staged:
    """Host tensors being filled; :meth:`wait` returns once they hold the values."""

    def __init__(self, tensors: list[torch.Tensor], events: list[Any] | None = None) -> None:
        self.tensors = tensors
        self._events = events or []

    @property
    def pending(self) -> bool:
        """Copies from a GPU may still be running."""
        return any(not e.query() for e in self._events)

    def wait(self) -> list[torch.Tensor]:
        for e in self._events:
            e.synchronize()
        self._events = []
        return self.tensors


class Stage:
    """Reused host buffers, one per name (pinned where the source is a CUDA tensor)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[Any, Any] = {}  # device -> its side stream

    def buffer(self, name: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        pin = src.device.type == "cuda"
        if (
            buf is None
            or buf.shape != src.shape
            or buf.dtype != src.dtype
            or buf.is_pinned() != pin
        ):
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            self._buffers[name] = buf
        return buf

    def copy(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Staged:
        """Copy ``tensors`` into the buffers of ``names``; CUDA copies are issued, not waited
        for (see the module docstring)."""
        bufs = [self.buffer(n, t) for n, t in zip(names, tensors, strict=True)]
        cpu = [(b, t) for b, t in zip(bufs, tensors, strict=True) if t.device.type != "cuda"]
        gpu = [(b, t) for b, t in zip(bufs, tensors, strict=True) if t.device.type == "cuda"]
        if cpu:
            nbytes = sum(t.numel() * t.element_size() for _, t in cpu)
            _par.each(cpu, lambda p: p[0].copy_(p[1]), nbytes)
        devices = list(dict.fromkeys(t.device for _, t in gpu))
        events = [self._issue(d, [(b, t) for b, t in gpu if t.device == d]) for d in devices]
        return Staged(bufs, events)

    def _issue(self, device: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device=device)
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for buf, t in pairs:
                buf.copy_(t, non_blocking=True)
                t.record_stream(side)  # the allocator must not hand t's memory out meanwhile
        main.wait_stream(side)  # the next step waits on the GPU, not on the host
        event = torch.cuda.Event()
        event.record(side)
        return event
