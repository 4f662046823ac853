"""Writing files and folders so that a reader never sees them half-written.

Every writer of the package goes through these helpers: the content goes to a temporary name next to the
destination, is flushed (and with ``durable=True`` fsynced, with its folder), and is renamed into place, which
is atomic on POSIX filesystems. A crash at any moment leaves the previous file, or none, never a torn one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_file_mode() -> int:
    """The permissions ``open`` gives a new file: 0o666 less the process's umask."""
    try:  # Linux names the umask here; reading it with os.umask would change it for a moment, for every thread
        with open("/proc/self/status") as fh:
            umask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def give_new_file_mode(path: str | os.PathLike) -> None:
    """Add to ``path`` (a file, or every file under a folder) the permissions a new file gets, so that what the package
    writes is readable as its other files are (0644 under the usual umask). safetensors writes through a private
    temporary file and leaves mode 0600, which a serving account of the same group cannot read. Only adds: bits the
    file has (an executable's) stay; files of another owner are left as they are."""
    path, mode = Path(path), new_file_mode()
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for file in files:
        with contextlib.suppress(PermissionError, FileNotFoundError):
            current = file.stat().st_mode & 0o7777
            if current | mode != current:
                os.chmod(file, current | mode)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write ``path`` through; it replaces ``path`` only if the block succeeds.

    For writers that want a file name (``savefig``, ``safetensors.save_file``). The temporary name keeps
    the suffix, since some writers pick the format from it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        give_new_file_mode(tmp)
        if durable:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str, durable: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary name (fsynced first when ``durable``)."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, payload, durable: bool = False) -> None:
    """``payload`` as indented JSON (values JSON cannot hold are written with ``str``)."""
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n", durable=durable)


def remove_path(path: str | os.PathLike) -> None:
    """Delete a file, a link or a folder tree; nothing if absent."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def temp_dir_for(dest: str | os.PathLike) -> Path:
    """A fresh temporary folder next to ``dest`` (same filesystem, so the final rename is atomic)."""
    dest = Path(dest)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    remove_path(tmp)  # left by a crashed run that had the same process id
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def install_dir(tmp: str | os.PathLike, dest: str | os.PathLike, overwrite: bool) -> None:
    """Rename the finished folder ``tmp`` to ``dest``.

    An existing ``dest`` is replaced only with ``overwrite``, and only moved aside once the new folder is
    complete; it is deleted after the new one is in place, so ``dest`` is always a complete folder or absent.
    """
    tmp, dest = Path(tmp), Path(dest)
    if not (dest.exists() or dest.is_symlink()):
        os.rename(tmp, dest)
        return
    if not overwrite:
        raise FileExistsError(f"{dest} already exists")
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    remove_path(old)
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    remove_path(old)


@contextlib.contextmanager
def building_dir(dest: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder to fill; it becomes ``dest`` when the block succeeds, and is removed otherwise."""
    tmp = temp_dir_for(dest)
    try:
        yield tmp
        give_new_file_mode(tmp)
        install_dir(tmp, dest, overwrite)
    except BaseException:
        remove_path(tmp)
        raise


@contextlib.contextmanager
def removing_new_empty_dirs(*paths: str | os.PathLike) -> Iterator[None]:
    """If the block fails, remove those of ``paths`` that it created and left empty (deepest last in ``paths``).

    Only empty folders are removed (``rmdir``), so nothing written inside them is ever lost.
    """
    new = [Path(p) for p in paths if not os.path.lexists(p)]
    try:
        yield
    except BaseException:
        for path in reversed(new):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def is_disk_full(err: BaseException, path: str | os.PathLike | None = None, needed: int = 1 << 20) -> bool:
    """Whether ``err``, raised while writing, came from a full disk (or quota).

    Its errno or message says so (safetensors reports "os error 28" in its message); a writer that says nothing of
    the cause (torch's "unexpected pos") counts as full when ``path``'s filesystem has less than ``needed`` bytes
    free. Check before removing what the failed write left, which would free the space.
    """
    if getattr(err, "errno", None) in _FULL_ERRNOS or any(text in str(err) for text in _FULL_TEXTS):
        return True
    if path is None:
        return False
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < needed
    except OSError:
        return False
