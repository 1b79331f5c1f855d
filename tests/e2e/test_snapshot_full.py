"""A /dev/shm that fills up while a run takes in-memory snapshots: no SIGBUS, no crash.

The slots are allocated in full when they are created, so a later write into their mapping
cannot meet a full tmpfs; what cannot be written (a slot, a JSON file) fails the snapshot
cleanly, snapshots turn off for the run with a message, and durable saves go on. Real tmpfs
mounts (root only; skipped with the reason printed otherwise): a small one mounted here, and a
private /dev/shm for a supervised run that something else fills in the middle.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests._store_helpers import REPO
from tests._users import in_private_shm, tmpfs
from tests.golden import ROOT, assert_identical, launch

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {repo!r})
    from unbroken.state import Registry
    from unbroken.store.snapshot._area import SnapshotArea, persist
    base, run = sys.argv[1], sys.argv[2]
    area = SnapshotArea(os.path.join(base, "area"))
    box = torch.nn.Module()
    box.w = torch.nn.Parameter(torch.zeros(64 << 10))  # 256 KiB: a slot
    reg = Registry()
    reg.add("model", box)
    with torch.no_grad():
        box.w.fill_(1)
    assert area.fits(256 << 10)
    assert area.save(1, reg.collect(), {{}}) is not None
    # Someone else fills the tmpfs (another job's /dev/shm, say).
    with open(os.path.join(base, "filler"), "wb") as f:
        try:
            while True:
                f.write(bytes(64 << 10))
                f.flush()
        except OSError:
            pass
    with torch.no_grad():
        box.w.fill_(2)
    got = area.save(2, reg.collect(), {{}})  # the second slot: no room left
    print("saved" if got else "off:", area.disabled, flush=True)
    assert area.save(3, reg.collect(), {{}}) is None  # off for good
    area.close()
    print("persisted", persist(os.path.join(base, "area"), run), flush=True)
    """
)


def test_a_full_tmpfs_turns_snapshots_off_without_sigbus(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=REPO))
    with tmpfs("1m") as base:
        proc = subprocess.run(
            [sys.executable, str(script), base, str(tmp_path / "run")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    # Before: the sparse slot's pages were taken at the first write into its mapping, and a
    # full tmpfs killed the process with SIGBUS there.
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "off: the in-memory snapshot of step 2 could not be written" in proc.stdout
    assert "No space left on device" in proc.stdout and "durable saves go on" in proc.stdout
    assert "persisted 1" in proc.stdout  # the previous snapshot stayed complete


TOY = ROOT / "tests" / "scripts" / "toy_train.py"
ARGS = ["--steps", "8", "--save-every", "4", "--workers", "0", "--snapshot-every", "1"]


def test_a_supervised_run_whose_shm_fills_up_finishes_bitwise(tmp_path: Path) -> None:
    """``unbroken run`` with a snapshot every step; once the first snapshot is in, something
    fills /dev/shm (a private one, 16 MiB). The trainer says so, goes on with durable saves
    only, and the run ends in one attempt, bitwise equal to an uninterrupted one."""
    ref, run, report = tmp_path / "ref", tmp_path / "run", tmp_path / "report.json"
    assert launch(TOY, [*ARGS, "--run-dir", str(ref)]) == 0
    cmd = [sys.executable, "-m", "unbroken", "run", "--backoff", "0", "--json", str(report)]
    cmd += ["--", sys.executable, str(TOY), *ARGS, "--run-dir", str(run), "--step-sleep", "0.2"]
    script = textwrap.dedent(
        f"""
        snapshot() {{
          compgen -G "/dev/shm/unbroken-*/*/checkpoints/step-*" ||
            compgen -G "/dev/shm/unbroken-*/checkpoints/step-*"  # (as unbroken 0.1 named it)
        }}
        (
          for _ in $(seq 20000); do snapshot >/dev/null && break; sleep 0.01; done
          dd if=/dev/zero of=/dev/shm/filler bs=64k 2>/dev/null || true
          echo filled
        ) &
        cd {REPO}
        set +e
        PYTHONPATH={REPO} {" ".join(cmd)}
        echo "rc=$?"
        wait
        """
    )
    out = in_private_shm(script, {"SHM_SIZE": "16m"})
    assert "filled" in out and "rc=0" in out, out[-4000:]
    attempts = json.loads(report.read_text())["attempts"]
    assert [a["status"] for a in attempts] == ["ok"], (attempts, out[-4000:])
    assert "in-memory snapshots are off" in out and "durable saves go on" in out, out[-4000:]
    assert_identical(ref, run)
