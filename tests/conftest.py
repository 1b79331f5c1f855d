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


# The tiers are folders: tests/unit (in this process, no other process or server: the fast tier,
# `./scripts/test.sh --fast`, about a minute), tests/process (real processes, signals, servers),
# tests/e2e (whole training runs interrupted and compared bit for bit). A marker per tier, so
# `-m unit` works on the whole suite too.
TIERS = ("unit", "process", "e2e")


# The files that take longest (minutes, each on one worker: `--dist loadfile`) go to the workers
# first, so that the run does not end with one worker on a long file and the other idle (the
# longest-first rule). Only an order: a file missing here runs all the same, after them.
LONGEST_FIRST = (
    "e2e/test_seeded_bugs.py",
    "process/test_standby.py",
    "e2e/test_docs.py",
    "e2e/test_recovery.py",
    "e2e/test_multinode.py",
    "e2e/test_verify.py",
    "process/test_safe_defaults.py",
    "process/test_standby_torchrun.py",
    "e2e/test_frameworks_ddp.py",
    "process/test_tree_signals.py",
    "process/test_store_fuzz.py",
    "e2e/test_torchrun_verify.py",
    "e2e/test_verify_forks.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(here).parts[0] if item.path.is_relative_to(here) else ""
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> int:
        inside = item.path.is_relative_to(here)
        return rank.get(item.path.relative_to(here).as_posix(), len(rank)) if inside else len(rank)

    items.sort(key=order)  # stable: a file's tests keep their order
