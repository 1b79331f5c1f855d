"""Split a nested state dict into a JSON tree and a flat dict of tensors, and join them back.

Tensors go to torch.distributed.checkpoint (so they reshard and load in place); everything else
goes to JSON, so loading never unpickles anything. The JSON keeps Python types exact: tuples,
non-string dict keys, non-finite floats, bytes, dtypes and NumPy arrays are written as one-key
objects whose key starts with ``$`` (a user dict that happens to use such a key is escaped).
"""

from __future__ import annotations

import base64
import math
import sys
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError, StateError

if TYPE_CHECKING:  # imported where used: decoding plain JSON (``unbroken inspect``) needs neither
    import numpy as np
    import torch

Json = Any
SEP = "/"

_MARKERS = frozenset(
    {"$tensor", "$tuple", "$dict", "$float", "$bytes", "$dtype", "$device", "$ndarray", "$size"}
)


def escape(segment: str) -> str:
    """Make a key usable as one path segment of a tensor name."""
    return segment.replace("%", "%25").replace(SEP, "%2F")


def split(obj: Any, prefix: str) -> tuple[Json, dict[str, torch.Tensor]]:
    """Return (json_tree, tensors); each tensor is named ``prefix/<path>`` in ``tensors``."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, prefix, tensors)
    return tree, tensors


def _encode(obj: Any, path: str, out: dict[str, torch.Tensor]) -> Json:
    # bool before int: bool is an int subclass and must stay a bool.
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    # Without torch (or NumPy) imported, no tensor (or array) can exist: no import needed.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if path in out:
            raise StateError(f"two tensors map to the name {path!r}; rename one of the keys")
        out[path] = obj
        return {"$tensor": path}
    if torch is not None and isinstance(obj, torch.Size):
        return {"$size": list(obj)}
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, f"{path}{SEP}{i}", out) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        if all(type(v) is int for v in obj):
            # What each element would encode to (a plain int is itself), without a path per
            # element: the RNG states are lists of ~625 ints, most of a snapshot's tree.
            return list(obj)
        return [_encode(v, f"{path}{SEP}{i}", out) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return _encode_dict(obj, path, out)
    if torch is not None and isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    if torch is not None and isinstance(obj, torch.device):
        return {"$device": str(obj)}
    if isinstance(obj, bytes):
        return {"$bytes": base64.b64encode(obj).decode("ascii")}
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype.hasobject:
            raise StateError(f"state at {path!r} is a NumPy object array, which cannot be saved")
        return {
            "$ndarray": {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "data": base64.b64encode(arr.tobytes()).decode("ascii"),
            }
        }
    if np is not None and isinstance(obj, np.generic):
        return _encode(obj.item(), path, out)
    raise StateError(
        f"state at {path!r} has type {type(obj).__qualname__}, which unbroken cannot save "
        "without pickling; return tensors, numbers, strings, lists, tuples or dicts from "
        "state_dict() (or convert the value yourself)"
    )


def _encode_dict(obj: dict[Any, Any], path: str, out: dict[str, torch.Tensor]) -> Json:
    plain = all(isinstance(k, str) and not k.startswith("$") for k in obj)
    if plain:
        return {k: _encode(v, f"{path}{SEP}{escape(k)}", out) for k, v in obj.items()}
    pairs = []
    for k, v in obj.items():
        if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
            raise StateError(f"state at {path!r} has a dict key of type {type(k).__qualname__}")
        pairs.append([_encode(k, path, {}), _encode(v, f"{path}{SEP}{escape(str(k))}", out)])
    return {"$dict": pairs}


def join(tree: Json, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split`; raises CorruptCheckpointError on a malformed tree."""
    try:
        return _join(tree, tensors)
    except (TypeError, ValueError, RuntimeError, OverflowError, AttributeError) as e:
        # A consistent but hostile file ({"$device": "nope"}, {"$size": ["x"]}, ...).
        raise CorruptCheckpointError(f"malformed state value: {str(e)[:200]}") from None


class _AnyTensor(dict[str, Any]):
    """Stands for the loaded tensors while a tree is only being validated."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str)

    def __getitem__(self, key: object) -> None:
        return None


def validate(tree: Json, where: str) -> None:
    """Decode ``tree`` as a load would, without tensors; a malformed node raises
    CorruptCheckpointError naming ``where`` (so inspect refuses what a load refuses)."""
    try:
        join(tree, _AnyTensor())
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None


def _join(tree: Json, tensors: dict[str, torch.Tensor]) -> Any:
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [_join(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"unexpected JSON value of type {type(tree).__name__}")
    if len(tree) == 1:
        (key,) = tree
        if key in _MARKERS:
            return _decode_marker(key, tree[key], tensors)
    if any(k.startswith("$") for k in tree):
        raise CorruptCheckpointError(f"unknown state marker in {sorted(tree)!r}")
    return {k: _join(v, tensors) for k, v in tree.items()}


def _decode_marker(key: str, value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if key == "$tensor":
        if not isinstance(value, str) or value not in tensors:
            raise CorruptCheckpointError(f"tensor {value!r} is referenced but was not loaded")
        return tensors[value]
    if key == "$tuple":
        return tuple(_join(v, tensors) for v in _as_list(value, key))
    if key == "$dict":
        out = {}
        for pair in _as_list(value, key):
            if not isinstance(pair, list) or len(pair) != 2:
                raise CorruptCheckpointError("malformed $dict entry")
            out[_hashable(_join(pair[0], tensors))] = _join(pair[1], tensors)
        return out
    if key == "$size":
        import torch

        return torch.Size([int(v) for v in _as_list(value, key)])
    if key == "$float":
        if value not in ("nan", "inf", "-inf"):
            raise CorruptCheckpointError(f"bad $float value {value!r}")
        return float(value)
    if key == "$bytes":
        return base64.b64decode(str(value), validate=True)
    if key == "$dtype":
        import torch

        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"unknown dtype {value!r}")
        return dtype
    if key == "$device":
        import torch

        return torch.device(str(value))
    return _decode_ndarray(value)


def _decode_ndarray(value: Any) -> np.ndarray:
    import numpy as np

    try:
        dtype = np.dtype(value["dtype"])
        shape = tuple(int(s) for s in value["shape"])
        raw = base64.b64decode(value["data"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"malformed $ndarray: {e}") from None
    if dtype.hasobject or math.prod(shape) * dtype.itemsize != len(raw):
        raise CorruptCheckpointError("malformed $ndarray: size does not match shape")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _as_list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{key} must hold a list")
    return value


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def tensor_names(tree: Json) -> list[str]:
    """Names of the tensors a JSON tree refers to, in order."""
    names: list[str] = []
    _collect(tree, names)
    return names


def _collect(tree: Json, names: list[str]) -> None:
    if isinstance(tree, list):
        for v in tree:
            _collect(v, names)
    elif isinstance(tree, dict):
        if len(tree) == 1 and "$tensor" in tree:
            names.append(tree["$tensor"])
            return
        for v in tree.values():
            _collect(v, names)
