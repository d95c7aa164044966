"""Every file the tool reads or creates goes through here (one rule per class, ``docs/security.md``).

Outputs
    * created in a private folder (``mkdtemp``: a random name, mode 0700, never an existing
      path) beside the target, fsynced and renamed over the target: no predictable name, no
      link ever followed, a reader sees the old file or the whole new one;
    * an output that is one of the command's inputs is refused (:func:`check_output`);
    * multi-file outputs are built in a private folder and renamed into place as a whole
      (:func:`atomic_folder`);
    * one writer per output (:func:`output_lock`); OS failures are one :class:`OutputError` line.

Inputs
    * only regular files are opened (a FIFO, device or socket would block or stream forever):
      :func:`require_regular_file`;
    * folders are walked without leaving the tree through a link (:func:`regular_files_in`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import h5py

from posterior_fusion.errors import DataError, OutputError

_TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)-[A-Za-z0-9_]+$")


def _describe(path: Path, exc: OSError) -> str:
    reason = {errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only file system",
              errno.EACCES: "permission denied", errno.ENOTDIR: "a parent is not a folder",
              errno.EEXIST: "a parent is not a folder", errno.EDQUOT: "disk quota exceeded",
              errno.ELOOP: "a symbolic link is in the way (refusing to follow it)"}.get(exc.errno, exc.strerror)
    return f"{path}: cannot write ({reason or exc})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete the private folders ``.<name>.tmp-<pid>-<random>`` beside ``path`` left by writers
    that no longer run (real folders only: a link of that name is removed, never followed)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            m = _TMP_RE.match(entry.name)
            if not (m and m.group("name") == path.name and not _pid_alive(int(m.group("pid")))):
                continue
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink(missing_ok=True)
            else:
                shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name the same file (links and hard links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Refuse, before any work starts, an output that is a folder, whose folder cannot be created
    or written, or that is one of the command's ``inputs`` (writing it would destroy the input).

    The writability probe is a fresh ``mkstemp`` file (random name, exclusive, never a link)."""
    path = Path(path)
    for source in inputs:
        if source is not None and not str(source).startswith("sklearn:") and same_file(path, source):
            raise OutputError(f"{path}: is also an input of this command ({source}); the output must differ "
                              "from every input")
    try:
        if path.is_dir() and not path.is_symlink():
            raise OutputError(f"{path}: is a folder, expected a file name")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(_describe(path, exc)) from None


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = ()) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``path``; a second writer to the same output is refused.
    The lock file is opened without following a link (a planted link is refused)."""
    path = Path(path)
    check_output(path, inputs)
    lock = path.parent / f".{path.name}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(f"{lock}: the lock beside the output is not a regular file; remove it")
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


def _fsync_dir(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _private_folder(path: Path) -> Path:
    """A fresh folder beside ``path`` only this process can write (random name, mode 0700)."""
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))


@contextlib.contextmanager
def _workspace(target: Path) -> Iterator[Path]:
    """A fresh private folder beside ``target`` (stale ones of dead writers removed first), removed
    afterwards; any OS failure, making it or inside the block, is one :class:`OutputError` naming ``target``."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        folder = _private_folder(target)
    except OSError as exc:
        raise OutputError(_describe(target, exc)) from None
    try:
        yield folder
    except OSError as exc:
        raise OutputError(_describe(target, exc)) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_atomically(path: str | os.PathLike, produce: Callable[[Path], None],
                     check: Callable[[Path], None] | None = None) -> None:
    """Create ``path`` by calling ``produce(tmp)`` on a path inside a private folder, then
    renaming ``tmp`` over ``path`` (a link at ``path`` is replaced, never followed). ``check(tmp)``,
    where given, runs on the finished file before the rename: an error there leaves ``path`` as it was."""
    path = Path(path)
    with _workspace(path) as folder:
        tmp = folder / path.name
        produce(tmp)
        if check is not None:
            check(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OutputError(f"{path}: the writer did not produce a regular file")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)


def atomic_h5_write(path: str | os.PathLike, fill: Callable[[h5py.File], None],
                    check: Callable[[Path], None] | None = None) -> None:
    """Create the HDF5 file ``path`` by calling ``fill(file)`` (see :func:`write_atomically`, ``check``).
    Large attributes are allowed (``libver="latest"`` stores them densely)."""
    def produce(tmp: Path) -> None:
        with h5py.File(tmp, "w", libver=("v110", "latest")) as f:
            fill(f)

    write_atomically(path, produce, check)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`write_atomically`."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


@contextlib.contextmanager
def atomic_folder(out_dir: str | os.PathLike, owned: Callable[[str], bool]) -> Iterator[Path]:
    """Build a multi-file output in a private folder beside ``out_dir``, then put it in place.

    ``out_dir`` may be absent, empty or hold only files for which ``owned(name)`` is true (an
    earlier output of the same command, replaced as a whole); anything else is refused so
    nobody's files are lost. A run killed half-way leaves ``out_dir`` as it was: never a mix.
    """
    out = Path(out_dir)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{out}: exists and is not a folder")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if not owned(p.name) or p.is_symlink() or not p.is_file()]
        if foreign:
            raise OutputError(f"{out}: holds files this command did not write ({', '.join(sorted(foreign)[:3])}); "
                              "choose an empty or new folder")
    with _workspace(out) as folder:
        yield folder
        os.chmod(folder, 0o755)
        for entry in folder.iterdir():
            with open(entry, "rb") as fh:
                os.fsync(fh.fileno())
        if out.is_dir():
            old = _private_folder(out)
            os.rename(out, old / "old")
            os.rename(folder, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(folder, out)
        _fsync_dir(out.parent)


# ----------------------------------------------------------------------------------------- inputs


def own_private_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder of this user's only: created with mode 0700 where it is missing (its parents with the
    default mode), and refused in one :class:`OutputError` line naming ``what`` when it is a symbolic link, not a
    folder, another user's, or open to the group or to others (a folder another local user can write into or
    swap lets them redirect or read what is kept there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise OutputError(f"{what} {path}: {_describe(path, exc)}") from None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise OutputError(f"{what} {path}: is a symbolic link; refused (it must be this user's own folder)")
    if not stat.S_ISDIR(info.st_mode):
        raise OutputError(f"{what} {path}: is not a folder")
    if info.st_uid != os.getuid():
        raise OutputError(f"{what} {path}: belongs to another user (uid {info.st_uid}); refused")
    if info.st_mode & 0o077:
        raise OutputError(f"{what} {path}: is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
                          f"make it 0700 (chmod 700 {path}) or name another folder")
    return path


def user_data_folder() -> Path:
    """This user's data folder: ``$XDG_DATA_HOME``, else ``~/.local/share`` (never a world-writable one)."""
    base = os.environ.get("XDG_DATA_HOME")
    return Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "share"


def require_regular_file(path: str | os.PathLike, what: str = "input") -> Path:
    """``path`` as a :class:`Path` if it is a regular file (links to one are fine); else one
    :class:`DataError` line. FIFOs, devices and sockets are refused: opening one can block forever."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise DataError(f"{path}: is a folder, expected a file ({what})")
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: is not a regular file (a FIFO, device or socket); refusing to read it ({what})")
    return path


def _entries(folder: Path, follow_links: bool) -> list[Path]:
    """Sorted entries of ``folder``; a link that leaves its tree is refused unless ``follow_links``."""
    root = os.path.realpath(folder)
    entries = sorted(folder.iterdir())
    for entry in entries:
        if entry.is_symlink() and not follow_links:
            target = os.path.realpath(entry)
            if os.path.commonpath([root, target]) != root:
                raise DataError(f"{entry}: a link out of {folder} (to {target}); pass `follow_links` to read it")
    return entries


def regular_files_in(folder: str | os.PathLike, follow_links: bool = False) -> list[Path]:
    """The entries of ``folder`` (sorted) that are regular files. A link that leaves ``folder``'s
    tree is refused unless ``follow_links``; FIFOs, devices and sockets are refused."""
    return [require_regular_file(e) for e in _entries(Path(folder), follow_links) if not e.is_dir()]


def subfolders(folder: str | os.PathLike, follow_links: bool = False) -> list[Path]:
    """Sorted sub-folders of ``folder``, with the same link rule as :func:`regular_files_in`."""
    return [e for e in _entries(Path(folder), follow_links) if e.is_dir()]
