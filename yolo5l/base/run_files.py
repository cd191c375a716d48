"""Where a training run keeps its checkpoints, one owner for finding them: the checkpoint callback's folder
(`checkpoint_dir`) and its `last.ckpt` (`last_checkpoint`), read from a Lightning Trainer's checkpoint callbacks
(yolo5l's `LastCheckpoint`, whose `last_path` names the file, or any `ModelCheckpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_dir", "last_checkpoint"]


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
