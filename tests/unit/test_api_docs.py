"""docs/api.md is the code's public API, read back: each package's section lists exactly its
``__all__``, each row says what the object's docstring says first, and the table of deprecated
names is the packages' own table of them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

API = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
PACKAGES = [
    "unbroken",
    "unbroken.errors",
    "unbroken.data",
    "unbroken.state",
    "unbroken.store",
    "unbroken.train",
    "unbroken.verify",
    "unbroken.integrations",
    "unbroken.cli",
]
# The packages that keep names of the first releases for one release (``_lazy.exports``).
DEPRECATING = ["unbroken", "unbroken.data", "unbroken.integrations", "unbroken.train"]
ROW = re.compile(r"^\| `([^`]+)` \| (.*) \|$", re.M)
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data):`~?([^`]+)`")


def section(title: str) -> str:
    return API.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def summary(doc: str | None) -> str | None:
    """A docstring's first paragraph as api.md writes it: one line, Markdown code spans."""
    if not doc or not doc.strip():
        return None
    first = " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())
    return ROLE.sub(r"`\1`", first).replace("``", "`")


def _source_doc(package: str, name: str) -> str | None:
    """The docstring of ``name`` read from the source of the module that defines it, without
    importing it: the framework adapters import Lightning or transformers (seconds each)."""
    module = importlib.import_module(package)._LAZY[name]
    path = Path(importlib.util.find_spec(module, package).origin)  # type: ignore[union-attr]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return ast.get_docstring(node, clean=False)
    raise AssertionError(f"{name} is not defined in {path}")


def documented(package: str, name: str) -> str | None:
    """What api.md must say of ``package.name``: its docstring's summary; None for a value
    (a constant has no docstring of its own: its row is free text)."""
    if package == "unbroken.integrations" and name[0].isupper():
        return summary(_source_doc(package, name))
    obj: Any = getattr(importlib.import_module(package), name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return None
    doc = obj.__doc__
    if doc and doc.startswith(f"{name}("):  # the signature a dataclass writes in place of one
        doc = None
    assert summary(doc), f"{package}.{name} has no docstring for docs/api.md to say"
    return summary(doc)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_section_is_its_packages_public_api(package: str) -> None:
    rows = dict(ROW.findall(section(f"`{package}`")))
    public = importlib.import_module(package).__all__
    assert sorted(rows) == sorted(public), f"docs/api.md, section {package}, against __all__"
    wrong = {
        name: (rows[name], want)
        for name in public
        if (want := documented(package, name)) is not None and rows[name] != want
    }
    assert not wrong, f"docs/api.md, section {package}: (row, docstring) {wrong}"


def test_the_deprecated_names_are_the_packages_own() -> None:
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|$", section("Deprecated names"), re.M)
    table = {
        f"{package}.{old}": new
        for package in DEPRECATING
        for old, new in importlib.import_module(package)._DEPRECATED.items()
    }
    assert dict(rows) == table
