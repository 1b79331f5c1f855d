"""In-memory snapshot areas on a shared node: no other user can reach into a run.

A real second, unprivileged user (``unbroken-eve``, created with useradd) attacks a victim
(this test, root) as she could on a cluster node where /dev/shm is writable by all:

- she plants a "stale" snapshot area, naming the victim's run directory, and waits for the
  victim's next ``unbroken run`` to reap it into the run (it must not);
- she creates the victim's private snapshot directory before the victim ever did (it must be
  refused, and the run go on without snapshots);
- she pre-creates world-writable directories at every name the victim's area could have, for
  the next pids (the area must not be adopted: its name is random, in a private directory).

The end-to-end cases run ``unbroken run`` in a mount namespace of their own whose /dev/shm is a
fresh tmpfs (what they plant no other process sees); the others use the real /dev/shm or a
private tmpfs mounted by the test. Skipped (with the reason printed) when not root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._store_helpers import REPO, make_registry, read_manifest_raw, train, write_manifest_raw
from tests._users import as_eve, eve, in_private_shm, need_root, tmpfs
from tests.golden import ROOT, launch
from unbroken import read_metrics
from unbroken.process import _shm
from unbroken.store import CheckpointStore
from unbroken.store.snapshot._area import SnapshotArea, SnapshotsOff, persist_own, reap_stale

TOY = ROOT / "tests" / "scripts" / "toy_train.py"
VICTIM_ARGS = ["--steps", "3", "--save-every", "1000", "--workers", "0", "--snapshot-every", "1"]
VICTIM_ARGS += ["--step-sleep", "0.2"]


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of the victim's model at step 5: what eve copies (``cp -r``) into the
    areas she plants. Root writes it once; eve reads it from her tmpfs."""
    need_root("attacks by a second user")
    run = tmp_path_factory.mktemp("evil") / "run"
    assert (
        launch(TOY, ["--steps", "5", "--save-every", "5", "--workers", "0", "--run-dir", str(run)])
        == 0
    )
    return run / "checkpoints" / "step-000000005"


def _naming(src: Path, dst: Path, run_dir: Path) -> None:
    """A copy of the checkpoint ``src`` whose manifest names ``run_dir`` as a snapshot does."""
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    m = read_manifest_raw(str(dst))
    m["meta"] = {**(m.get("meta") or {}), "run_dir": str(run_dir), "snapshot": True}
    write_manifest_raw(str(dst), m)


def _supervised(victim: Path, report: Path) -> str:
    cmd = [sys.executable, "-m", "unbroken", "run", "--backoff", "0", "--max-retries", "1"]
    cmd += ["--json", str(report), "--", sys.executable, str(TOY), *VICTIM_ARGS]
    return " ".join([*cmd, "--run-dir", str(victim)])


def _checkpoints(run: Path) -> list[str]:
    return sorted(os.listdir(run / "checkpoints")) if (run / "checkpoints").is_dir() else []


def _resumes(run: Path) -> list[int]:
    return [e["step"] for e in read_metrics(str(run), events=True) if e.get("event") == "resume"]


def test_planted_stale_areas_are_never_persisted_into_the_victims_run(evil, tmp_path) -> None:
    """Eve plants two areas holding her step 5, naming the victim's run directory: one named
    as unbroken 0.1 named supervisor areas (``/dev/shm/unbroken-<uid>-sup-<dead pid>``), one in
    the victim's private directory, which she creates first (world-writable). The victim's
    ``unbroken run`` refuses that directory (snapshots off, said), persists neither, trains
    from scratch and exits 0; eve's files stay as she left them."""
    eve_uid, _ = eve()
    victim, report, planted = tmp_path / "victim", tmp_path / "report.json", tmp_path / "src"
    planted.mkdir()
    _naming(evil, planted / evil.name, victim)
    uid = os.getuid()
    script = textwrap.dedent(
        f"""
        mkdir -m 755 /dev/shm/src && cp -r {planted}/{evil.name} /dev/shm/src/
        chmod -R a+rX /dev/shm/src
        runuser -u unbroken-eve -- sh -c '
          set -e
          umask 0
          old=/dev/shm/unbroken-{uid}-sup-999999
          mkdir -p $old/checkpoints && cp -r /dev/shm/src/{evil.name} $old/checkpoints/
          mkdir -m 777 /dev/shm/unbroken-{uid}
          area=/dev/shm/unbroken-{uid}/sup-1-0123456789abcdef
          mkdir -p $area/checkpoints && cp -r /dev/shm/src/{evil.name} $area/checkpoints/
          printf "{{\\"run_dir\\": \\"{victim}\\"}}" > $area.run
        '
        cd {REPO}
        set +e
        PYTHONPATH={REPO} {_supervised(victim, report)}
        echo "rc=$?"
        find /dev/shm -path /dev/shm/src -prune -o -print | sort
        """
    )
    out = in_private_shm(script, {})
    assert "step-000000005" not in " ".join(_checkpoints(victim)), out[-3000:]
    assert _resumes(victim) == [], _resumes(victim)  # trained from scratch
    assert "rc=0" in out, out[-4000:]
    assert "in-memory snapshots are off" in out and f"/dev/shm/unbroken-{uid}" in out, out[-3000:]
    assert f"belongs to uid {eve_uid}" in out, out[-3000:]
    assert json.loads(report.read_text())["exit_code"] == 0
    for left in (
        f"/dev/shm/unbroken-{uid}-sup-999999/checkpoints/step-000000005/manifest.json",
        f"/dev/shm/unbroken-{uid}/sup-1-0123456789abcdef/checkpoints/step-000000005",
        f"/dev/shm/unbroken-{uid}/sup-1-0123456789abcdef.run",
    ):
        assert left in out, (left, out[-3000:])


def test_predicted_area_names_are_never_adopted(tmp_path) -> None:
    """Eve creates world-writable directories at the names the victim's area would have had
    for the next 3000 pids, and watches them, copying out any manifest that appears (she would
    then swap in her own checkpoint). The victim's run takes its snapshots in its own private
    directory (mode 0700): she sees nothing."""
    eve()
    victim, report = tmp_path / "victim", tmp_path / "report.json"
    uid = os.getuid()
    script = textwrap.dedent(
        f"""
        last=$(cat /proc/sys/kernel/ns_last_pid)
        names="/dev/shm/unbroken-{uid}-sup-%.0f $((last + 1)) $((last + 3000))"
        runuser -u unbroken-eve -- sh -c "umask 0; mkdir -m 777 \\$(seq -f $names)"
        runuser -u unbroken-eve -- sh -c '
          while :; do
            for m in $(find /dev/shm -path "/dev/shm/unbroken-{uid}-sup-*" -name manifest.json); do
              cat $m > /dev/shm/loot-$(date +%s%N) 2>/dev/null
            done
            sleep 0.02
          done' &
        watcher=$!
        cd {REPO}
        set +e
        PYTHONPATH={REPO} {_supervised(victim, report)}
        echo "rc=$?"
        kill $watcher
        hers() {{ find /dev/shm -maxdepth 1 -name "unbroken-{uid}-sup-*" -type d "$@"; }}
        echo "planted=$(hers | wc -l)"
        echo "loot=$(find /dev/shm -maxdepth 1 -name 'loot-*' -size +0 | wc -l)"
        echo "private=$(stat -c '%a %u' /dev/shm/unbroken-{uid})"
        """
    )
    out = in_private_shm(script, {})
    assert "loot=0" in out, out[-3000:]
    assert "rc=0" in out and "planted=3000" in out, out[-4000:]
    assert f"private=700 {uid}" in out, out[-3000:]
    assert "snapshots are off" not in out, out[-3000:]


def test_an_area_is_private_random_and_exclusive() -> None:
    """On the real /dev/shm: the area lies in ``/dev/shm/unbroken-<uid>`` (0700), is named
    ``sup-<pid>-<64 random bits>``, is created afresh each time, and eve can neither list the
    directory, nor read the area, nor write its channel."""
    eve()
    a, b = _shm.SupervisorArea.create(), _shm.SupervisorArea.create()
    try:
        private = f"/dev/shm/unbroken-{os.getuid()}"
        assert os.path.dirname(a.path) == private and a.path != b.path
        for path in (private, a.path):
            st = os.lstat(path)
            assert (st.st_mode & 0o7777, st.st_uid) == (0o700, os.getuid()), path
        name = os.path.basename(a.path)
        assert name.startswith(f"sup-{os.getpid()}-") and len(name.rsplit("-", 1)[1]) == 16
        assert as_eve(["ls", private]).returncode != 0
        assert as_eve(["ls", a.path]).returncode != 0
        assert as_eve(["sh", "-c", f"echo x > {a.channel}"]).returncode != 0
    finally:
        a.discard()
        b.discard()
    assert not os.path.exists(a.path) and not os.path.exists(a.channel)


def test_the_trainer_refuses_an_area_it_does_not_own_alone(tmp_path) -> None:
    """The trainer side: an area given to it that eve created (even one it could write), one
    others can write in, or a link to a private one, is refused -- snapshots off -- and
    nothing is written into it."""
    eve()
    with tmpfs() as base:
        hers = os.path.join(base, "hers")
        assert as_eve(["mkdir", "-m", "777", hers]).returncode == 0
        loose = os.path.join(base, "loose")
        os.mkdir(loose)
        os.chmod(loose, 0o777)
        mine = os.path.join(base, "mine")
        os.mkdir(mine, 0o700)
        link = os.path.join(base, "link")
        os.symlink(mine, link)
        for path, words in ((hers, "belongs to uid"), (loose, "mode is 0777"), (link, "link")):
            with pytest.raises(SnapshotsOff, match=words):
                SnapshotArea(path)
            assert os.listdir(path if path != link else mine) == [], path


def _area_with_snapshots(base: str, told: Path, named: Path | None = None) -> _shm.SupervisorArea:
    """A supervisor's area (in ``base``) whose trainer told ``told`` and took snapshots of
    steps 1 and 2 naming ``named`` (default: the same)."""
    area = _shm.SupervisorArea.create(base)
    told.mkdir(exist_ok=True)
    snaps = SnapshotArea(area.path)
    reg = make_registry()
    for _ in range(2):
        train(reg, 1)
        snaps.save(reg.get("counters").step, reg.collect(), {"run_dir": str(named or told)})
    snaps.close()
    if named is not None:
        _shm.tell_run_dir(area.path, str(told))
    return area


def test_the_run_directory_comes_from_the_channel_not_from_the_snapshot(tmp_path) -> None:
    with tmpfs() as base:
        a, b = tmp_path / "a", tmp_path / "b"
        area = _area_with_snapshots(base, a)
        assert persist_own(area) == (2, str(a))
        assert [r.step for r in CheckpointStore(str(a)).listing()] == [2]
        area.discard()
        # The trainer told a; the snapshots name b: persisted into neither.
        area = _area_with_snapshots(base, a / "x", named=b)
        assert persist_own(area) is None
        assert not (a / "x" / "checkpoints").exists() and not (b / "checkpoints").exists()
        area.discard()


def test_an_area_replaced_under_its_supervisor_is_refused(tmp_path) -> None:
    with tmpfs() as base:
        area = _area_with_snapshots(base, tmp_path / "run")
        os.rename(area.path, area.path + "-moved")
        os.mkdir(area.path, 0o700)
        with pytest.raises(_shm.Refused, match="replaced"):
            persist_own(area)
        assert not (tmp_path / "run" / "checkpoints").exists()
        area.discard()


SUPERVISOR = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from tests._store_helpers import make_registry, train
    from unbroken.process import _shm
    from unbroken.store.snapshot._area import SnapshotArea
    area = _shm.SupervisorArea.create(sys.argv[1])
    snaps = SnapshotArea(area.path)
    reg = make_registry()
    for _ in range(3):
        train(reg, 1)
        snaps.save(reg.get("counters").step, reg.collect(), {{"run_dir": sys.argv[2]}})
    print(area.path, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_supervisors_area_is_reaped_by_the_next(tmp_path) -> None:
    """A supervisor (a real process, holding its area's lock) is SIGKILLed with its trainer:
    while it lived, the next supervisor left its area alone; once dead, it persists the newest
    snapshot into the run directory the trainer told and removes the area. Areas in the
    private directory that are not the user's alone, or not named as areas, are left alone."""
    eve()
    script = tmp_path / "sup.py"
    script.write_text(SUPERVISOR.format(repo=REPO))
    run = tmp_path / "run"
    run.mkdir()
    with tmpfs() as base:
        private = _shm.private_dir(base)
        odd = os.path.join(private, "sup-7-00000000000000ff")
        os.mkdir(odd, 0o755)  # named like an area, but not private: not touched
        proc = subprocess.Popen(
            [sys.executable, str(script), base, str(run)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            path = proc.stdout.readline().strip()
            assert path.startswith(private + "/sup-"), path
            assert reap_stale(base) == [] and os.path.isdir(path)  # alive: left alone
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert reap_stale(base) == [(3, str(run))]
        assert not os.path.exists(path) and not os.path.exists(path + _shm.CHANNEL)
        assert [r.step for r in CheckpointStore(str(run)).listing()] == [3]
        assert os.path.isdir(odd)


def test_a_private_directory_of_another_user_hides_every_area(tmp_path) -> None:
    """Eve's own ``unbroken-<victim uid>`` holding an area that names the victim's run, its
    lock free: the victim's supervisor finds no stale area there at all."""
    eve()
    with tmpfs() as base:
        private = os.path.join(base, f"unbroken-{os.getuid()}")
        assert as_eve(["mkdir", "-m", "700", private]).returncode == 0
        assert as_eve(["mkdir", os.path.join(private, "sup-1-0123456789abcdef")]).returncode == 0
        assert _shm.stale_areas(base) == []
        with pytest.raises(_shm.Refused, match="belongs to uid"):
            _shm.SupervisorArea.create(base)
