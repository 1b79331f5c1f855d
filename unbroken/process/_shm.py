"""Where in-memory snapshots live, and who may touch them (torch-free: the supervisor imports
this at start-up).

``/dev/shm`` is writable by every user of a node. So each user's snapshots live in one
directory of their own, ``/dev/shm/unbroken-<uid>``: mode 0700, owned by the user, checked
after it is opened (a link, or a directory someone else owns or can write, is refused and
snapshots are off). Nobody else can list, read or plant anything in it; it is the trust root.

Inside it, each supervisor (``unbroken run``) creates its own *area* -- created exclusively,
never adopted, under a name with 64 random bits (``sup-<pid>-<16 hex digits>``) -- and holds
an exclusive ``flock`` on it for its life; the trainer gets the path in :data:`ENV`. Beside the
area is its *channel*, ``<area>.run``, a file the supervisor creates empty and into which the
trainer writes its run directory (:func:`tell_run_dir`): where a snapshot is persisted comes
from there, never from the snapshot itself. An area whose lock is free belongs to a supervisor
that died (kill -9); the next supervisor of the same user persists what it holds and removes
it (store/snapshot/_area.py). Before anything in an area is read, persisted or deleted, its owner,
mode and identity are checked (:meth:`SupervisorArea.check`, :func:`stale_areas`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass

from . import _protocol

ENV = _protocol.SNAPSHOT_DIR
SHM = "/dev/shm"
CHANNEL = ".run"
MAX_CHANNEL_BYTES = 64 << 10
_AREA = re.compile(r"^sup-\d+-[0-9a-f]{16}$")
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """A directory or file of the snapshot machinery is not this user's alone; the message
    says which, whose, and what to do."""


def private_dir(base: str = SHM, *, create: bool = True) -> str:
    """``base/unbroken-<uid>``, created if need be (``create``), after checking that it is a
    directory (not a link) of this user with mode 0700, and that ``base`` cannot be used to
    swap it (owned by root or the user; sticky where others may write). Raises Refused."""
    uid = os.getuid()
    try:
        st = os.stat(base)
    except OSError as e:
        raise Refused(f"{base} cannot be used: {e.strerror}") from None
    if st.st_uid not in (0, uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise Refused(
            f"{base} is writable by other users without the sticky bit (or owned by uid "
            f"{st.st_uid}): another user could replace a directory of ours in it"
        )
    path = os.path.join(base, f"unbroken-{uid}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise Refused(f"cannot create {path}: {e.strerror}") from None
    fd = _open_private(path, "the private snapshot directory of this user")
    os.close(fd)
    return path


def _open_private(path: str, what: str) -> int:
    """An fd of the directory ``path`` -- never through a link -- once it checks out as this
    user's alone (mode 0700); the caller closes it. Raises Refused (FileNotFoundError: gone)."""
    try:
        fd = os.open(path, _OPEN_DIR)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise Refused(
            f"{path} ({what}) cannot be opened as a directory ({e.strerror}): is it a link? "
            "Remove it to use in-memory snapshots"
        ) from None
    st = os.fstat(fd)
    uid = os.getuid()
    why = None
    if st.st_uid != uid:
        why = f"it belongs to uid {st.st_uid}, not to uid {uid}"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        why = f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700: others could write in it"
    if why is None and stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # a umask took some of our own bits from a directory of ours
    if why is not None:
        os.close(fd)
        raise Refused(
            f"{path} ({what}) is not this user's alone: {why}. In-memory snapshots need it "
            "private; remove it (ask its owner or an administrator) to use them"
        )
    return fd


@dataclass
class SupervisorArea:
    """One supervisor's snapshot area, created by :meth:`create` and locked while it lives."""

    path: str
    ident: tuple[int, int]  # (st_dev, st_ino) of the directory created
    channel_ident: tuple[int, int]
    fd: int  # holds the flock

    @property
    def channel(self) -> str:
        return self.path + CHANNEL

    @classmethod
    def create(cls, base: str = SHM) -> SupervisorArea:
        """A new area in this user's private directory. Raises Refused."""
        root = private_dir(base)
        for _ in range(8):
            path = os.path.join(root, f"sup-{os.getpid()}-{secrets.token_hex(8)}")
            try:
                os.mkdir(path, 0o700)  # exclusive: an existing area is never adopted
            except FileExistsError:
                continue
            fd = _open_private(path, "a snapshot area just created")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
                cfd = os.open(
                    path + CHANNEL, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
                )
                cst = os.fstat(cfd)
                os.close(cfd)
            except BaseException:
                os.close(fd)
                raise
            return cls(path, (st.st_dev, st.st_ino), (cst.st_dev, cst.st_ino), fd)
        raise Refused(f"could not create a snapshot area in {root}")

    def check(self) -> None:
        """Raise Refused unless the area is still the directory this supervisor created, the
        user's alone."""
        try:
            st = os.lstat(self.path)
        except OSError as e:
            raise Refused(f"snapshot area {self.path} is gone: {e.strerror}") from None
        if (st.st_dev, st.st_ino) != self.ident or not stat.S_ISDIR(st.st_mode):
            raise Refused(f"snapshot area {self.path} was replaced; it is not ours")
        os.close(_open_private(self.path, "this supervisor's snapshot area"))

    def run_dir(self) -> str | None:
        """The run directory the trainer told through the channel (None if it told none)."""
        return read_channel(self.channel, self.channel_ident)

    def may_hold_snapshot(self) -> bool:
        """Whether there can be anything to persist: the trainer told its run directory (it
        does before its first snapshot) and a snapshot directory is there. Cheap, torch-free:
        a supervisor of a command that takes no snapshots never imports the store."""
        try:
            if os.stat(self.channel).st_size == 0:
                return False
            names = os.listdir(os.path.join(self.path, "checkpoints"))  # (store/_layout.py)
        except OSError:
            return False
        return any(n.startswith("step-") for n in names)

    def discard(self) -> None:
        """Remove the area and its channel, if they are still what this supervisor created."""
        try:
            self.check()
        except (Refused, FileNotFoundError):
            pass
        else:
            remove(self.path)
        os.close(self.fd)


def read_channel(path: str, ident: tuple[int, int] | None = None) -> str | None:
    """The run directory written into a channel: a regular file of this user, one link, not
    larger than :data:`MAX_CHANNEL_BYTES`, (``ident``) the very file the supervisor created;
    the directory named absolute and existing. None when empty, missing or refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        ok = stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_nlink == 1
        ok = ok and (ident is None or (st.st_dev, st.st_ino) == ident)
        if not ok or not 0 < st.st_size <= MAX_CHANNEL_BYTES:
            return None
        raw = os.read(fd, MAX_CHANNEL_BYTES)
    finally:
        os.close(fd)
    try:
        run_dir = json.loads(raw.decode()).get("run_dir")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    if not isinstance(run_dir, str) or not os.path.isabs(run_dir) or not os.path.isdir(run_dir):
        return None
    return run_dir


def tell_run_dir(area: str, run_dir: str) -> bool:
    """The trainer's side of the channel: write ``run_dir`` (absolute) into the channel the
    supervisor created beside ``area``. Never creates one: False when there is none to write
    into (a trainer not under ``unbroken run``) or it is not this user's plain file."""
    try:
        fd = os.open(area + CHANNEL, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
            return False
        data = json.dumps({"run_dir": os.path.abspath(run_dir)}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return True
    finally:
        os.close(fd)


@dataclass
class StaleArea:
    """An area whose supervisor is gone, locked (``fd``) by the one that found it."""

    path: str
    fd: int

    def run_dir(self) -> str | None:
        return read_channel(self.path + CHANNEL)

    def discard(self) -> None:
        remove(self.path)
        self.release()

    def release(self) -> None:
        os.close(self.fd)


def stale_areas(base: str = SHM) -> list[StaleArea]:
    """The areas in this user's private directory whose supervisor died (their lock is free),
    each locked now by the caller; only directories that check out as the user's alone. An
    unusable private directory yields none (nothing in it is trusted)."""
    try:
        root = private_dir(base, create=False)
        names = os.listdir(root)
    except (Refused, OSError):
        return []
    out = []
    for name in sorted(names):
        if not _AREA.match(name):
            continue
        path = os.path.join(root, name)
        try:
            fd = _open_private(path, "a snapshot area")
        except (Refused, OSError):
            continue  # not a directory of ours: left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # its supervisor is alive
            continue
        out.append(StaleArea(path, fd))
    return out


def any_stale(base: str = SHM) -> bool:
    """Whether :func:`stale_areas` would find any (their locks released again)."""
    found = stale_areas(base)
    for area in found:
        area.release()
    return bool(found)


def remove(area: str) -> None:
    """Delete an area and its channel (links inside are removed, never followed)."""
    shutil.rmtree(area, ignore_errors=True)
    try:
        os.unlink(area + CHANNEL)
    except OSError:
        pass


def check_private(path: str) -> str | None:
    """Why the trainer must not use ``path`` as its snapshot area (None: it may): it must be a
    directory of this user, mode 0700, not a link, in a directory that others cannot use to
    swap it (the user's or root's; sticky where others may write)."""
    try:
        os.close(_open_private(path, "the snapshot area given in " + ENV))
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
    except Refused as e:
        return str(e)
    except OSError as e:
        return f"{path} cannot be used as a snapshot area: {e.strerror}"
    loose = parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX
    if parent.st_uid not in (0, os.getuid()) or loose:
        return f"{path} lies in a directory other users can write: not a private snapshot area"
    return None
