"""The OmegaConf resolvers `conf/` uses, registered on import (`yolo5l.conf` and `yolo5l.config` import this module,
so every composed or reloaded config resolves them)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

__all__ = ["if_file", "register"]


def if_file(file: Any, with_file: Any, without_file: Any) -> Any:
    """``${if_file:${.file},640,320}``: ``with_file`` when a dataset file is given, else ``without_file``."""
    return with_file if file not in (None, "") else without_file


def register() -> None:
    """Register the resolvers once per process."""
    if not OmegaConf.has_resolver("if_file"):
        OmegaConf.register_new_resolver("if_file", if_file)


register()
