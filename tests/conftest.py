from __future__ import annotations

from pathlib import Path

import pytest

from tests.golden import launch

TOY = Path(__file__).parent / "scripts" / "toy_train.py"


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted toy runs, one per distinct argument list, shared by the tests."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(args: list[str]) -> Path:
        key = tuple(args)
        if key not in cache:
            d = tmp_path_factory.mktemp("reference")
            assert launch(TOY, [*args, "--run-dir", str(d)]) == 0
            cache[key] = d
        return cache[key]

    return get
