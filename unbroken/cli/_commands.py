"""The list of subcommand modules, in the order ``--help`` shows them."""

from __future__ import annotations

from types import ModuleType

from . import _average, _demo, _diff, _export, _inspect, _pin, _plot, _run_cmd, _verify

MODULES: list[ModuleType] = [
    _demo,
    _run_cmd,
    _inspect,
    _pin,
    _verify,
    _plot,
    _export,
    _average,
    _diff,
]
