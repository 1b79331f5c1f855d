"""The package's shape, as docs/design.md "Layers" draws it: the torch-free wings import no
torch, no module name repeats, format 1 is gone, and each layer imports only from the layers
above it."""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "unbroken"

# docs/design.md's table, top to bottom: a layer may import the leaves and the layers before it.
LAYERS = [
    "process",
    "state",
    "store",
    "data",
    "train",
    "integrations",
    "verify",
    "supervise",
    "cli",
]
LEAVES = {"errors", "_version", "_lazy", "_dist", "_launch"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("wing", ["unbroken.process", "unbroken.supervise", "unbroken.cli"])
def test_the_torch_free_wings_import_no_torch(wing: str) -> None:
    names = sorted(
        f"{wing}.{p.stem}"
        for p in (PACKAGE / wing.split(".")[1]).glob("_*.py")
        if p.stem != "__init__"
    )
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert len(names) >= 5 or wing == "unbroken.cli"
    assert out.stdout.strip() == "[]", f"{wing} imported torch: {out.stdout.strip()[:300]}"


def test_no_module_name_repeats_in_the_package() -> None:
    names = collections.defaultdict(list)
    for p in _modules():
        if p.name != "__init__.py":
            names[p.name].append(str(p.relative_to(PACKAGE)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}


def test_no_format_1_module_is_left() -> None:
    assert [str(p) for p in _modules() if "_v1" in p.stem] == []


def test_the_root_holds_only_the_shared_leaves() -> None:
    root = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert root == LEAVES
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS)


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "unbroken" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _imports(path: Path) -> list[tuple[str, int]]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1]) if path.name != "__init__.py" else list(rel.parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.append((f"{target}.{alias.name}", node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def test_layers_import_only_from_the_layers_above_them() -> None:
    wrong = []
    for path in _modules():
        mine = _layer_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if mine is None:
            continue
        for target, line in _imports(path):
            theirs = _layer_of(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} ({mine}) imports {target}")
    assert wrong == []
