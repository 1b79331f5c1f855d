from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._s3server import s3, s3_backend  # noqa: F401  (the S3 server fixtures)
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


# Variables that make a launched script join a process group; a test that leaves one behind
# breaks every later launch from this process, so the leaking test itself fails.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")


@pytest.fixture(autouse=True)
def _launch_environment_unchanged() -> Iterator[None]:
    before = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    yield
    after = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    assert after == before, f"the test changed the launch environment: {before} -> {after}"


# The fast tier (`./scripts/test.sh --fast`): modules whose tests run in this process, start no
# other process and no server, and each take well under a second; about a minute in all.
FAST_MODULES = frozenset(
    {
        "test_audit",
        "test_choice",
        "test_cli_umask",
        "test_api_docs",
        "test_config_api",
        "test_data_streams",
        "test_determinism",
        "test_direct_writer",
        "test_hooks",
        "test_node_layout",
        "test_parallel_copy",
        "test_policy",
        "test_rng_cuda",
        "test_run",
        "test_staging",
        "test_store_corrupt",
        "test_store_retention",
        "test_triggers",
        "test_untracked_parameter",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
