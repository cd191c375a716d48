"""Where a training run keeps its checkpoints, one owner for finding them: the checkpoint callback's folder
(`checkpoint_dir`) and its `last.ckpt` (`last_checkpoint`), read from a Lightning Trainer's checkpoint callbacks
(yolo5l's `LastCheckpoint`, whose `last_path` names the file, or any `ModelCheckpoint`); and the lock a training
run holds on its folder while it trains (`hold_run_folder`, `training_now`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any

from yolo5l.base.errors import UserError, shown_path

try:
    import fcntl
except ImportError:  # Windows: no lock, every folder counts as not training
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "RUN_LOCK", "checkpoint_dir", "hold_run_folder", "last_checkpoint", "let_go_of_run_folder", "refuse_if_training",
    "training_now",
]  # fmt: skip


def _writers(trainer: Any) -> list[Any]:
    return [cb for cb in getattr(trainer, "checkpoint_callbacks", []) if getattr(cb, "dirpath", None)]


def checkpoint_dir(trainer: Any) -> Path | None:
    """The folder the run's checkpoint callback writes into (`<run>/checkpoints`); None without one."""
    return next((Path(cb.dirpath) for cb in _writers(trainer)), None)


def last_checkpoint(trainer: Any, must_exist: bool = True) -> str | None:
    """The `last.ckpt` of the run's checkpoint callback: with `must_exist`, only when the file is there (whole: every
    write is atomic), for the lines that name a run's resume point; else where it goes. None without a callback."""
    for cb in _writers(trainer):
        path = getattr(cb, "last_path", None) or os.path.join(cb.dirpath, "last.ckpt")
        if not must_exist or os.path.isfile(path):
            return path
    return None


#: The file a training run holds locked in its folder while it runs: `hold_run_folder`, `training_now`.
RUN_LOCK = ".training.lock"
_held: dict[Path, Any] = {}  # run folder -> the open lock file of this process


def _lock(fd: int, exclusive: bool) -> bool:
    """A non-blocking `flock` of `fd`: False when another process holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def training_now(run_dir: str | os.PathLike[str]) -> str | None:
    """Who trains `run_dir` now: the holder that `hold_run_folder` wrote (`process 4242 on host, since ...`), or
    None when no process of this machine holds its lock (finished, stopped or killed: the kernel lets a dead
    process's lock go). Without `fcntl` (Windows) always None."""
    path = Path(run_dir) / RUN_LOCK
    if fcntl is None or Path(run_dir).resolve() in _held or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            if _lock(f.fileno(), exclusive=False):
                return None
            return f.read().decode(errors="replace").strip() or "another process"
    except FileNotFoundError:  # its holder removed it as it ended
        return None


def refuse_if_training(run_dir: str | os.PathLike[str], then: str = "or train into another folder") -> None:
    """Raise `UserError` when another process of this machine trains `run_dir` now (`training_now`).

    Args:
        run_dir: The run folder.
        then: What to do besides waiting for that run or stopping it (the line's end).
    """
    if holder := training_now(run_dir):
        raise UserError(f"{shown_path(run_dir)} is being trained now ({holder}): wait for that run to end or stop it, "
                        f"{then}")  # fmt: skip


def hold_run_folder(run_dir: str | os.PathLike[str]) -> None:
    """Lock `run_dir` for this process's training: a second command that would resume or write into the same folder
    while this one trains is refused in one line (`training_now`). Held until `let_go_of_run_folder` or the process
    ends, when the lock file is removed; a process killed outright leaves it unlocked, which counts as not training.

    Raises:
        UserError: Another process of this machine trains `run_dir` now.
    """
    folder = Path(run_dir).resolve()
    if fcntl is None or folder in _held:
        return
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / RUN_LOCK, "a+b")  # noqa: SIM115 (open until the run ends)
    if not _lock(f.fileno(), exclusive=True):
        f.close()
        refuse_if_training(folder)
        return  # its holder ended between the two looks: this process's next run will hold it
    f.truncate(0)
    f.write(f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    f.flush()
    _held[folder] = f
    atexit.register(_let_go, folder, os.getpid())


def let_go_of_run_folder(run_dir: str | os.PathLike[str]) -> None:
    """End this process's `hold_run_folder` of `run_dir` (a sweep's job ends; the process goes on): its lock file is
    removed. Nothing happens for a folder not held."""
    _let_go(Path(run_dir).resolve(), os.getpid())


def _let_go(folder: Path, pid: int) -> None:
    if os.getpid() != pid:  # a forked child that runs atexit: the lock is its parent's
        return
    f = _held.pop(folder, None)
    if f is None:
        return
    with contextlib.suppress(OSError):
        (folder / RUN_LOCK).unlink()  # while held: no process reads a holder that has gone
    f.close()
