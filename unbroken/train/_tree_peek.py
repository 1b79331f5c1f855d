"""Reading one value out of a checkpoint's counters before anything is loaded."""

from __future__ import annotations

from typing import Any

from ..state import _tree


def saved_stage(trees: dict[str, Any]) -> Any:
    counters = trees.get("counters")
    if not isinstance(counters, dict):
        return None
    return _tree.join(counters.get("stage"), {})
