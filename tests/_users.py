"""A real second, unprivileged user and real tmpfs mounts, for the tests of a shared node.

Root only (``useradd``, ``mount``, ``unshare``): CI runs as root. Elsewhere the tests that need
them are skipped, and the reason is printed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

EVE = "unbroken-eve"


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        reason = f"{what} needs root (useradd, mount); CI runs as root"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)


def eve() -> tuple[int, int]:
    """(uid, gid) of the second user, created if missing (several test processes may race)."""
    need_root("a second, unprivileged user")
    for _ in range(2):
        try:
            pw = pwd.getpwnam(EVE)
            return pw.pw_uid, pw.pw_gid
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", EVE],
                capture_output=True,
            )
    pw = pwd.getpwnam(EVE)
    return pw.pw_uid, pw.pw_gid


def as_eve(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` as the second user (no supplementary groups), its output captured."""
    uid, gid = eve()
    return subprocess.run(
        cmd, user=uid, group=gid, extra_groups=[], capture_output=True, text=True, **kw
    )


@contextmanager
def tmpfs(size: str = "64m") -> Iterator[str]:
    """A private tmpfs (mode 1777, like /dev/shm) that both users can reach; unmounted after."""
    need_root("mounting a tmpfs")
    point = tempfile.mkdtemp(prefix="unbroken-shm-")
    os.chmod(point, 0o755)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", point], check=True
    )
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(point, ignore_errors=True)


def in_private_shm(script: str, env: dict[str, str], timeout: float = 300) -> str:
    """Run the bash ``script`` in a mount namespace of its own whose /dev/shm is a fresh tmpfs
    (``$SHM_SIZE``, default 256m): what it plants or fills there no other process sees."""
    need_root("a private /dev/shm (unshare, mount)")
    size = env.get("SHM_SIZE", "256m")
    full = f"set -eu\nmount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm\n{script}"
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", full],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr
