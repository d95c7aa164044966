"""Atomic, locked HDF5 writes: a temporary file beside the target, fsynced, renamed, the
directory fsynced; one writer per output at a time; stale temporaries of dead writers removed.

Every OS failure (no space, read-only file system, a parent that is a file, permissions)
becomes one :class:`~posterior_fusion.errors.OutputError` line naming the output.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py

from posterior_fusion.errors import OutputError

_TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)$")


def _describe(path: Path, exc: OSError) -> str:
    reason = {errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only file system",
              errno.EACCES: "permission denied", errno.ENOTDIR: "a parent is not a folder",
              errno.EEXIST: "a parent is not a folder", errno.EDQUOT: "disk quota exceeded"}.get(exc.errno, exc.strerror)
    return f"{path}: cannot write ({reason or exc})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete ``.<name>.tmp-<pid>`` files beside ``path`` left by writers that no longer run."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            m = _TMP_RE.match(entry.name)
            if m and m.group("name") == path.name and not _pid_alive(int(m.group("pid"))):
                entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


def check_writable(path: str | os.PathLike) -> None:
    """Refuse, before any work starts, an output whose folder cannot be created or written."""
    path = Path(path)
    try:
        if path.is_dir():
            raise OutputError(f"{path}: is a folder, expected a file name")
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".{path.name}.probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(_describe(path, exc)) from None


@contextlib.contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``path``; a second writer to the same output is refused."""
    path = Path(path)
    check_writable(path)
    lock = path.parent / f".{path.name}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise OutputError(_describe(lock, exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(f"{path}: another process is writing this output (lock {lock})") from None
    try:
        yield
    finally:
        # Removing the lock file keeps folders clean; the price is a narrow race (a writer that opened
        # the old file just before the unlink can lock that orphan while a third locks a new file).
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def atomic_h5_write(path: str | os.PathLike, fill: Callable[[h5py.File], None]) -> None:
    """Create ``path`` by calling ``fill(file)`` on a temporary HDF5 file, then renaming it.

    A reader never sees a half-written file: either the old file (or none) or the new one.
    Large attributes are allowed (``libver="latest"`` stores them densely).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(_describe(path, exc)) from None
    remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w", libver=("v110", "latest")) as f:
            fill(f)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise OutputError(_describe(path, exc)) from None
    finally:
        with contextlib.suppress(OSError):
            if tmp.exists():
                tmp.unlink()
