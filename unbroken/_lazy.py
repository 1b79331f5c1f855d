"""Lazy re-exports: a package names its public API without importing the modules behind it.

``import unbroken`` runs in the supervisor, which lives as long as the training and must stay
light (no torch); ``unbroken ls`` and ``--help`` should not pay for what they do not use. A
package declares ``{name: ".module"}`` and gets the module ``__getattr__`` / ``__dir__`` pair
(PEP 562) from :func:`exports`; each name is imported on first use and cached in the package.

A name that moved or was renamed keeps working for one release: ``deprecated`` maps the old
name to its new home (``"unbroken.train.Settings"``); using it warns with a
``DeprecationWarning`` that names that home. Such names are neither cached (every use warns,
subject to the warnings filters) nor listed by ``dir()``, so completion offers only the new
ones.

``subpackages`` are imported on first attribute access too, so ``import unbroken`` then
``unbroken.train.Settings`` works as it reads, without an ``import unbroken.train``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any


def exports(
    package: str,
    table: Mapping[str, str],
    deprecated: Mapping[str, str] | None = None,
    subpackages: Collection[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose lazy names are ``table``'s keys, whose
    deprecated names are ``deprecated``'s (old name -> ``"module.NewName"``) and whose public
    ``subpackages`` import on first use."""
    moved = dict(deprecated or {})

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
            setattr(sys.modules[package], name, value)  # once: later lookups skip this function
            return value
        if name in subpackages:
            return importlib.import_module(f"{package}.{name}")  # the import binds it here
        target = moved.get(name)
        if target is not None:
            home, new = target.rsplit(".", 1)
            warnings.warn(
                f"{package}.{name} is deprecated and will be removed in the next release; "
                f"use {target}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(home), new)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table) | set(subpackages))

    return __getattr__, __dir__
