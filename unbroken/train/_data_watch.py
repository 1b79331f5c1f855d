"""Changes made through ``Tensor.data`` while an in-memory snapshot's thread copies tensors.

``p.data`` is a new tensor on ``p``'s storage with a version counter of its own: a change
through it (WGAN's weight clipping, ``p.data.clamp_(-c, c)``) or ``p.data = x`` leaves ``p``'s
counter as it was, so the check of the snapshot's background copy (train/_snapshots.py) would
not see it, and a copy holding bytes from either side of the change, or both, would be
committed. This module patches the attribute ``torch.Tensor.data``: a Python property whose
getter and setter call torch's own descriptor (``torch._C.TensorBase.data``) and then, while a
:class:`Watch` is open, look the tensor up by ``id`` among the tensors a snapshot's thread
copies (the tracked optimizers' parameters and state, the EMAs' shadows, and views of or bases
of them):

- the getter registers the alias it returns; its version counter is noted and compared like
  the tensor's own when the copy is judged (a change through the alias, or a view of it, is
  then a change of the tensor); aliases made before the watch began are found once, when it
  begins (:func:`gc.get_objects`: every tensor on the storage of a watched one);
- the setter marks the tensor changed, whatever the new data (conservative: ``p.data = x``
  on a parameter leaves the copied storage as it was, but not on an optimizer's state tensor,
  which the snapshot copies as the very object).

``torch.Tensor.numpy`` is wrapped the same way: a NumPy array writes without any version
counter, whenever it is kept, so a copied tensor that ``.numpy()`` exposes (itself, an alias, a
view's base, or a tensor at its address such as ``p.detach()``) makes the snapshot in flight
not committed and is copied in the step from then on. Not seen: arrays made before the watch
began (NumPy arrays are not tracked by the garbage collector, so no scan finds them), and
writes through ``untyped_storage()``, DLPack or a raw pointer (docs/design.md).

With no watch open the cost is one extra Python call and a global's truth test per ``.data``.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

_DESCRIPTOR: Any = torch._C.TensorBase.__dict__.get("data")
_NUMPY: Any = torch._C.TensorBase.__dict__.get("numpy")
_WATCHES: list[Watch] = []  # the open ones (one per Snapshots with a background copy)
_installed = False
_install_lock = threading.Lock()


def patchable() -> str | None:
    """Why ``torch.Tensor.data`` cannot be watched as this module does (a torch that changed),
    or None."""
    if type(_DESCRIPTOR).__name__ != "getset_descriptor":
        return f"torch._C.TensorBase.data is a {type(_DESCRIPTOR).__name__}, not a descriptor"
    if type(_NUMPY).__name__ != "method_descriptor":
        return f"torch._C.TensorBase.numpy is a {type(_NUMPY).__name__}, not a method"
    for name in ("data", "numpy"):
        owner = next((c for c in torch.Tensor.__mro__ if name in c.__dict__), None)
        if owner is None:
            return f"torch.Tensor has no attribute {name}"
        if not (owner is torch._C.TensorBase or (owner is torch.Tensor and _installed)):
            return f"torch.Tensor.{name} is defined by {owner.__qualname__}, not TensorBase"
    return None


def _get(self: torch.Tensor) -> torch.Tensor:
    out = _DESCRIPTOR.__get__(self)
    if _WATCHES:
        i = id(self)
        for w in _WATCHES:
            if i in w.objs or i in w.aliases or self._base is not None:  # (a miss: no call)
                w.got(self, out)
    return out


def _set(self: torch.Tensor, value: torch.Tensor) -> None:
    if _WATCHES:
        for w in _WATCHES:
            w.replaced(self)
    _DESCRIPTOR.__set__(self, value)


def _numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if _WATCHES:
        for w in _WATCHES:
            w.exposed_by(self)
    return _NUMPY(self, *args, **kwargs)


_numpy.__doc__ = getattr(_NUMPY, "__doc__", None)


def install() -> str | None:
    """Patch ``torch.Tensor.data`` (once per process). Why it could not be, or None."""
    global _installed
    with _install_lock:
        if _installed:
            return None
        why = patchable()
        if why is not None:
            return why
        torch.Tensor.data = property(_get, _set, doc=_DESCRIPTOR.__doc__)  # type: ignore[assignment]
        torch.Tensor.numpy = _numpy  # type: ignore[method-assign,assignment]
        _installed = True
        return None


class Watch:
    """The tensors a snapshot's thread copies, and the ``.data`` aliases of them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objs: dict[int, tuple[torch.Tensor, tuple[str, ...]]] = {}  # id: (live, keys)
        self.aliases: dict[int, tuple[weakref.ref, tuple[str, ...]]] = {}
        self.job: Any = None  # the snapshot whose copy is in flight (a _Job), while open
        self.copying: frozenset[str] = frozenset()  # the keys the thread copies (the window's)
        self.ptrs: dict[int, list[str]] = {}  # the window's keys by data_ptr()
        self.exposed: set[str] = set()  # keys whose memory a NumPy array shares
        self._scanned = False

    # ---- the snapshot's side (the training thread) --------------------------------------------

    def begin(
        self,
        job: Any,
        live: Iterable[tuple[torch.Tensor, int]],
        copied: list,
        ptrs: list[int],
    ) -> None:
        """Open the window of ``job``, whose thread copies ``copied`` ((key, tensor, version)
        entries, extended here with the aliases' versions; ``ptrs``: their ``data_ptr()``s);
        ``live`` are the tensors a training holds (parameters, optimizer state, EMA shadows),
        with theirs. A copied tensor is one of them or an alias at the same address (a state
        dict's ``detach()``)."""
        keys: dict[int, list[str]] = {}
        for (key, _, _), ptr in zip(copied, ptrs, strict=True):
            keys.setdefault(ptr, []).append(key)
        keys.pop(0, None)  # no storage, or an empty one: nothing to tear
        copying = frozenset(k for k, _, _ in copied)
        objs: dict[int, tuple[torch.Tensor, tuple[str, ...]]] = {}
        for t, ptr in live:
            ks = keys.get(ptr)
            if ks:  # (and not 0: popped above)
                objs[id(t)] = (t, tuple(ks))
                base = t._base  # a parameter that is a view of a flat buffer: the buffer too
                if base is not None:
                    objs[id(base)] = (base, tuple(ks))
        if not self._scanned:
            self._scanned = True
            self._scan(copied, objs)
        with self.lock:
            self.objs, self.copying, self.ptrs = objs, copying, keys
            for i, (ref, names) in list(self.aliases.items()):
                a = ref()
                if a is None:
                    del self.aliases[i]
                else:  # (an alias of a key now copied in the step: not watched)
                    copied.extend((k, a, a._version) for k in names if k in copying)
            self.job = job
        if self not in _WATCHES:
            _WATCHES.append(self)

    def end(self) -> None:
        """Close the window (the copy is judged, or given up)."""
        with self.lock:
            self.job = None

    def close(self) -> None:
        self.end()
        if self in _WATCHES:
            _WATCHES.remove(self)
        self.objs, self.aliases = {}, {}

    def _scan(self, copied: list, objs: dict[int, Any]) -> None:
        """Once: the aliases made before the watch began (``w = p.data`` kept from the set-up),
        any tensor on a copied storage (a view of it at another address too)."""
        keys: dict[int, list[str]] = {}
        for key, t, _ in copied:
            keys.setdefault(_storage(t), []).append(key)
        keys.pop(0, None)
        for o in gc.get_objects():
            # (type(): isinstance reads __class__, which some lazy objects warn on)
            if issubclass(type(o), torch.Tensor) and id(o) not in objs:
                ks = keys.get(_storage(o))
                if ks:
                    self._alias(o, tuple(ks))

    # ---- the patched attribute's side ---------------------------------------------------------

    def _keys(self, t: torch.Tensor) -> tuple[str, ...] | None:
        entry = self.objs.get(id(t))
        if entry is not None and entry[0] is t:
            return entry[1]
        alias = self.aliases.get(id(t))
        if alias is not None and alias[0]() is t:
            return alias[1]
        base = t._base
        if base is not None:
            return self._keys(base)
        return None

    def _alias(self, alias: torch.Tensor, keys: tuple[str, ...]) -> None:
        # No callback (it would cost more than the rest): the dead are dropped at begin(), and
        # an id reused meanwhile never matches (_keys compares the referent).
        self.aliases[id(alias)] = (weakref.ref(alias), keys)

    def got(self, t: torch.Tensor, alias: torch.Tensor) -> None:
        """``t.data`` returned ``alias``."""
        keys = self._keys(t)
        if keys is None:
            return
        with self.lock:
            self._alias(alias, keys)
            job = self.job
            if job is not None:
                job.watch_alias([k for k in keys if k in self.copying], alias)

    def exposed_by(self, t: torch.Tensor) -> None:
        """``t.numpy()``, about to be called: a NumPy array writes without any version counter,
        whenever it is kept, so a tensor it shares memory with is copied in the step from the
        next snapshot on, and a snapshot whose copy is in flight is not committed."""
        keys = self._keys(t) or tuple(self.ptrs.get(_ptr(t), ()))
        if not keys:
            return
        with self.lock:
            self.exposed.update(keys)
            job = self.job
            if job is not None:
                job.mark_changed([k for k in keys if k in self.copying])

    def replaced(self, t: torch.Tensor) -> None:
        """``t.data = x``, about to be done."""
        keys = self._keys(t)
        if keys is None:
            return
        with self.lock:
            job = self.job
            if job is not None:
                job.mark_changed([k for k in keys if k in self.copying])


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.data_ptr())
    except Exception:  # no storage
        return 0


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # no storage: sparse, a wrapper subclass, meta
        return 0
