"""Every public name is documented: docs/api.md names each entry of every package's __all__."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

API = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
PACKAGES = [
    "unbroken",
    "unbroken.data",
    "unbroken.state",
    "unbroken.store",
    "unbroken.train",
    "unbroken.verify",
    "unbroken.integrations",
    "unbroken.cli",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_in_the_api_reference(package: str) -> None:
    section = API.split(f"## `{package}`\n", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"^\| `([^`]+)` \|", section, re.M))
    missing = sorted(set(importlib.import_module(package).__all__) - names)
    assert not missing, f"docs/api.md, section {package}, lacks {missing}"
