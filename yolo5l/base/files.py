"""Files that appear whole or not at all, the one lock between processes, and the user cache folder.

- `atomic_open(path, mode)`: a file object on a temporary file beside `path` (same folder, so the same filesystem);
  when the block ends without an error the file is flushed (and with `fsync=True` synced to the disk) and renamed
  onto `path` in one `os.replace`, which is atomic on POSIX and Windows: a reader sees the old file or the new one,
  never half of one. An error (a full disk, a kill of the block) removes the temporary file and leaves `path` as it
  was. For writers that stream: `torch.save`, `np.save`, csv.
- `atomic_write(path, data)`: the same for bytes or text in hand.
- `file_lock(path, what)`: an exclusive lock between processes on this machine (the `filelock` package: `flock` on
  POSIX), for work that one process does while the others wait and then use its result (downloads, dataset and
  label caches, the sweep's summary). The holder removes the lock file before it lets go, so nothing is left
  beside the data; a waiter that then locks the removed file sees it is gone and locks the current one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from yolo5l.base.console import info

__all__ = ["CACHE_DIR_ENV", "atomic_open", "atomic_write", "file_lock", "user_cache_dir"]

#: Overrides the user cache root (default ``$XDG_CACHE_HOME/yolo5l``, else ``~/.cache/yolo5l``).
CACHE_DIR_ENV = "YOLO5L_CACHE_DIR"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: The process's umask, read once (reading it means setting it): temporary files get the usual permissions.
_UMASK = _umask()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb", *, fsync: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; rename it onto `path` when the block ends without an error.

    Args:
        path: The file to write (its folder is created).
        mode: `"wb"` or `"w"` (text: UTF-8, newlines as written).
        fsync: Sync the data to the disk before the rename (checkpoints and weights: a power cut after the rename
            then cannot leave an empty file).

    Raises:
        OSError: The write failed (full disk, quota, file-size limit, read-only folder); `path` is unchanged.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r}; use 'w' or 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600
        text = {"encoding": "utf-8", "newline": ""} if mode == "w" else {}
        with os.fdopen(fd, mode, **text) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, fsync: bool = False) -> Path:
    """Write `data` (bytes, or text as UTF-8) to `path` through `atomic_open`; returns the path."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", fsync=fsync) as f:
        f.write(data)
    return Path(path)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], what: str = "") -> Iterator[None]:
    """Hold an exclusive lock on `path` (created) for the `with` block, then remove the file.

    A process that has to wait says so once (`[yolo5l] waiting for another process: <what>`, on stderr).

    Args:
        path: The lock file.
        what: What the holder is doing, for the waiting line.
    """
    from filelock import FileLock, Timeout

    path = Path(path)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        info(f"waiting for another process: {what or path}", stream=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        try:
            if os.name != "nt":  # Windows' lock removes its own file when released
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # while held: whoever locks the removed file next tries the current one
        finally:
            lock.release()


def user_cache_dir(kind: str) -> Path:
    """The per-user cache folder of ``kind`` ("labels", "npy"), used where the dataset's folder is read-only.

    ``$YOLO5L_CACHE_DIR/<kind>``, else ``$XDG_CACHE_HOME/yolo5l/<kind>``, else ``~/.cache/yolo5l/<kind>``.
    """
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "yolo5l"
    )
    return Path(base) / kind
