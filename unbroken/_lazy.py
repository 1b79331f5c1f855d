"""Lazy re-exports: a package names its public API without importing the modules behind it.

``import unbroken`` runs in the supervisor, which lives as long as the training and must stay
light (no torch); ``unbroken ls`` and ``--help`` should not pay for what they do not use. A
package declares ``{name: ".module"}`` and gets the module ``__getattr__`` / ``__dir__`` pair
(PEP 562) from :func:`exports`; each name is imported on first use and cached in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose lazy names are ``table``'s keys."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # once: later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
