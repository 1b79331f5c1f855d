"""Packaging: the wheel a user installs holds the whole package and the demo's files, the
metadata agrees with the docs, and ``unbroken demo`` runs from a fresh virtual environment."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch

from tests.golden import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_one_torch_floor_everywhere() -> None:
    deps = PYPROJECT["project"]["dependencies"]
    (floor,) = [m.group(1) for d in deps if (m := re.fullmatch(r"torch>=([\d.]+)", d))]
    readme = (ROOT / "README.md").read_text()
    stated = re.findall(r"PyTorch ≥ (\d+(?:\.\d+)*)", readme)
    assert stated and set(stated) == {floor}, f"README says PyTorch ≥ {stated}, pyproject {floor}"
    design = (ROOT / "docs" / "design.md").read_text()
    assert re.findall(r"declared floor \((\d+(?:\.\d+)*)\)", design) == [floor], "docs/design.md"
    installed = _version(torch.__version__.split("+")[0])
    assert installed >= _version(floor), f"torch {torch.__version__} is below the floor {floor}"
    pinned = (ROOT / "requirements-dev.txt").read_text()
    assert re.search(rf"^torch=={re.escape(torch.__version__.split('+')[0])}$", pinned, re.M)


def test_license_and_metadata() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 11000  # the full text
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    classifiers = project["classifiers"]
    assert "Operating System :: POSIX" in classifiers and "Typing :: Typed" in classifiers
    assert not any("Windows" in c for c in classifiers)
    assert (ROOT / "unbroken" / "py.typed").is_file()
    readme = (ROOT / "README.md").read_text()
    assert "POSIX" in readme


def _install_blocks() -> tuple[list[str], list[str]]:
    """The README's two install blocks: from a checkout, from a built wheel (comments cut)."""
    readme = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in readme.split("```bash\n")[1:]]
    assert len(blocks) == 2, blocks
    lines = [[ln.split("#", 1)[0].strip() for ln in b.splitlines()] for b in blocks]
    checkout, wheel = ([ln for ln in b if ln] for b in lines)
    return checkout, wheel


def test_the_readme_installs_only_what_exists() -> None:
    """No install line the registry cannot serve: unbroken is not published, so the README
    installs from a checkout or a built wheel, and says so."""
    readme = (ROOT / "README.md").read_text()
    checkout, wheel = _install_blocks()
    assert checkout == ["pip install .", "unbroken demo"]
    assert wheel[0].startswith("pip wheel --no-deps -w dist .")
    assert wheel[1:] == ["pip install dist/unbroken-*.whl"]
    assert "not on PyPI yet: `pip install unbroken` finds nothing" in readme
    every_block = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert not any(re.search(r"pip install unbroken\b", b) for b in every_block)


def test_every_subpackage_is_listed() -> None:
    """pyproject.toml lists the packages (the demo's files are mapped in from examples/):
    a new subpackage must be added there, or the wheel would lack it."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "unbroken").rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == {"unbroken._examples", "unbroken._examples.data"}
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"unbroken._examples": "examples"}


def _package_files() -> set[str]:
    """Every file of the package as the wheel must hold it (relative, with ``/``)."""
    files = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "unbroken").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    return files | {"unbroken/py.typed"}


def _build_wheel(tmp: Path) -> Path:
    """Build from a copy of the sources, so the checkout gets no build/ or egg-info."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("unbroken", "examples"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-w", str(dist), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("unbroken-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_the_demo_runs(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    missing = _package_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}: list the subpackage in pyproject.toml"
    demo_files = {"unbroken/_examples/char_lm.py", "unbroken/_examples/data/corpus.txt"}
    assert demo_files <= names
    assert not any("parallel" in n for n in names)  # seq2seq's 1.7 MB corpus stays out
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Dist: torch>=" in metadata

    # A fresh environment without pip: the wheel goes in with this interpreter's pip, against
    # the new interpreter. Its dependencies (torch and the rest) come from this environment's
    # site-packages through a .pth line -- the same as --system-site-packages where torch is
    # installed system-wide -- so pip still checks that every dependency is satisfied. A .pth
    # line adds a directory without running the .pth files in it: the checkout's editable
    # install stays out, and `import unbroken` can only find the wheel's copy.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "_unbroken_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    # The README's own lines: `pip wheel ... -w dist .` wrote dist/ (above, from a copy of the
    # checkout), then `pip install dist/unbroken-*.whl` as written, run by this interpreter's pip
    # for the new one (--no-index: the dependencies are already there).
    _, readme_wheel = _install_blocks()
    install_line = shlex.split(readme_wheel[-1])
    assert install_line[:2] == ["pip", "install"]
    targets = [p for arg in install_line[2:] for p in glob.glob(str(tmp_path / arg))]
    assert targets == [str(wheel)], targets
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", *targets],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    work = tmp_path / "elsewhere"  # not the checkout: nothing can be found relative to it
    work.mkdir()
    out = work / "demo-out"
    # The README's `unbroken demo`, shortened: the whole demo is timed in docs/performance.md.
    checkout, _ = _install_blocks()
    assert checkout[-1] == "unbroken demo"
    args = ["--out", str(out), "--steps", "6", "--save-every", "2", "--kills", "1"]
    proc = subprocess.run(
        [str(venv / "bin" / "unbroken"), "demo", *args, "--seed", "1"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"script: {Path(purelib) / 'unbroken' / '_examples' / 'char_lm.py'}" in proc.stdout
    assert "RESULT: bit-for-bit identical" in proc.stdout
    assert (out / "interrupted" / "final.safetensors").is_file()
    # Each launch has its line as it ends, in order, though stdout is a pipe (flushed).
    launches = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("launch ")]
    assert [ln.split(":")[0].strip() for ln in launches] == ["launch 1", "launch 2"], proc.stdout
    plot = next(ln for ln in proc.stdout.splitlines() if ln.startswith("loss curves:"))
    try:
        import matplotlib  # noqa: F401

        assert plot.endswith("demo.png"), plot
    except ImportError:
        assert "pip install matplotlib" in plot, plot
