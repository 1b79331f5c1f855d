"""A save that fails (ENOSPC, EIO, EROFS, EACCES) raises CheckpointWriteError naming the path,
leaves no temp directory, and the previous checkpoint still loads as it was saved."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests._logs import logged
from tests._store_helpers import (
    REPO,
    assert_same,
    ckpt,
    entries,
    fail_at,
    fail_at_event,
    hook,
    latest,
    make_registry,
    make_run,
    recorder,
    restore,
    snapshot,
    train,
    transients,
)
from unbroken.errors import CheckpointWriteError
from unbroken.store import CheckpointStore, Retention


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Runs with step 1 (``new``: the save under test makes step 2) or steps 1 and 2
    (``resave``: step 2 is saved again), the state to save, and the events of that save."""
    out = {}
    for scenario, steps in (("new", (1,)), ("resave", (1, 2))):
        run = str(tmp_path_factory.mktemp(scenario) / "run")
        snaps = make_run(run, steps)
        reg = make_registry(seed=7)
        train(reg, 3)
        reg.get("counters").step = 2
        scratch = str(tmp_path_factory.mktemp("scratch") / "run")
        shutil.copytree(run, scratch)
        events: list[tuple[str, str]] = []
        with hook(recorder(events)):
            CheckpointStore(scratch).save(2, reg.collect(), {})
        out[scenario] = (run, snaps, reg, events)
    return out


def copy_of(bases, scenario: str, tmp_path) -> tuple[str, dict, object]:
    src, snaps, reg, _ = bases[scenario]
    run = str(tmp_path / scenario)
    shutil.copytree(src, run)
    return run, snaps, reg


def check_failed_save(run: str, snaps, exc: BaseException, path: str) -> None:
    assert isinstance(exc, CheckpointWriteError), repr(exc)
    assert path in str(exc), f"{path} not named in: {exc}"
    assert transients(run) == [], entries(run)
    reader, warned = latest(CheckpointStore(run))
    assert warned == []
    prev = max(snaps)
    assert reader is not None and reader.step == prev
    assert_same(restore(reader), snaps[prev])


def save_with(run: str, reg, fn) -> BaseException:
    with hook(fn), pytest.raises(CheckpointWriteError) as ei:
        CheckpointStore(run).save(2, reg.collect(), {})
    return ei.value


@pytest.mark.parametrize(
    "event, code",
    [
        ("write", errno.ENOSPC),
        ("fsync", errno.ENOSPC),
        ("fsync_dir", errno.ENOSPC),
        ("rename", errno.EIO),
        ("mkdir", errno.EROFS),
        ("create", errno.EROFS),
    ],
    ids=[
        "ENOSPC-write",
        "ENOSPC-fsync",
        "ENOSPC-fsync_dir",
        "EIO-rename",
        "EROFS-mkdir",
        "EROFS-create",
    ],
)
@pytest.mark.parametrize("scenario", ["new", "resave"])
def test_named_fault(bases, tmp_path, scenario, event, code):
    run, snaps, reg = copy_of(bases, scenario, tmp_path)
    reached: list[str] = []
    exc = save_with(run, reg, fail_at_event(event, code, reached))
    assert reached, f"no {event} event was reached"
    assert os.strerror(code) in str(exc)
    check_failed_save(run, snaps, exc, reached[0])


@pytest.mark.parametrize("scenario", ["new", "resave"])
def test_fault_at_every_event_of_the_save(bases, tmp_path, scenario):
    """ENOSPC at each event in turn; in ``resave`` this includes the rename that moves the
    committed copy aside and the commit rename after it: the old copy must come back."""
    events = bases[scenario][3]
    assert len(events) >= 20
    for k, (name, path) in enumerate(events, 1):
        if scenario == "resave" and name == "rmtree":
            continue  # removing the replaced copy after the commit: not a failure (see below)
        run, snaps, reg = copy_of(bases, scenario, tmp_path / f"k{k}")
        reached: list[tuple[str, str]] = []
        exc = save_with(run, reg, fail_at(k, errno.ENOSPC, reached))
        assert [(n, os.path.basename(p)) for n, p in reached] == [(name, os.path.basename(path))], (
            k,
            reached,
        )
        check_failed_save(run, snaps, exc, reached[0][1])


def test_failing_to_remove_the_replaced_copy_keeps_the_new_one(bases, tmp_path):
    run, snaps, reg = copy_of(bases, "resave", tmp_path)
    reached: list[str] = []
    with hook(fail_at_event("rmtree", errno.EIO, reached)):
        CheckpointStore(run).save(2, reg.collect(), {})
    assert [os.path.basename(p) for p in reached] == [".old-step-000000002"]
    store = CheckpointStore(run)
    store.clean_stale()
    assert transients(run) == []
    reader, _ = latest(store)
    assert reader is not None and reader.step == 2
    assert_same(restore(reader), snapshot(reg))


def test_retention_failure_is_a_warning_and_keeps_the_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    snaps = make_run(run, (1, 2))
    store = CheckpointStore(run, Retention(keep_last=1))
    reached: list[str] = []
    with (
        hook(fail_at_event("rename", errno.EIO, reached)),
        logged() as w,
    ):
        assert store.apply_retention(2) == []
    assert reached == [os.path.join(run, "checkpoints", ".del-step-000000001")]
    assert any("could not delete" in x and ckpt(run, 1) in x for x in w), w
    assert_same(restore(store.open(1)), snaps[1])


_AS_NOBODY = """
import json, os, sys
sys.path.insert(0, {repo!r})
from tests._store_helpers import make_registry
from unbroken.store import CheckpointStore
# Everything is imported (and a save has run once, for lazy imports) before dropping root:
# nobody cannot read the interpreter's own files here.
CheckpointStore(sys.argv[2]).save(1, make_registry().collect(), {{}})
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
try:
    CheckpointStore(sys.argv[1]).save(2, make_registry().collect(), {{}})
    out = {{"error": None, "uid": os.geteuid()}}
except Exception as e:
    out = {{"error": type(e).__name__, "message": str(e), "uid": os.geteuid()}}
print(json.dumps(out))
"""


def test_permission_denied_for_real():
    """A writer without write permission on the run directory (root drops to nobody)."""
    base = tempfile.mkdtemp(prefix="unbroken-perm-")
    try:
        os.chmod(base, 0o755)
        run = os.path.join(base, "run")
        snaps = make_run(run, (1,))
        root = os.path.join(run, "checkpoints")
        if os.geteuid() != 0:
            os.chmod(root, 0o555)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HOME": base}
        proc = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY.format(repo=REPO), run, os.path.join(base, "warm")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=base,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["uid"] != 0
        assert out["error"] == "CheckpointWriteError", out
        assert "Permission denied" in out["message"]
        assert os.path.join(root, ".tmp-step-000000002") in out["message"]
        os.chmod(root, 0o755)
        assert entries(run) == ["step-000000001"]
        reader, _ = latest(CheckpointStore(run))
        assert reader is not None and reader.step == 1
        assert_same(restore(reader), snaps[1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
