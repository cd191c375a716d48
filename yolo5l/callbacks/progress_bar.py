"""The progress display: Lightning's TQDM bar with the running losses on a terminal, nothing drawn otherwise.

`console_progress` (the `callbacks.progress_bar` node) picks by where stdout goes: on a terminal `YOLOProgressBar`,
elsewhere (a file, a pipe, a batch system's log) `NoBar`, which draws nothing, so that a log holds no bar redraws or
escape codes; `EpochLine` (yolo5l/callbacks/epoch_line.py) prints the one line per epoch either way.
`with_console_progress` gives a Trainer's callback list that choice (Lightning's own default, a RichProgressBar where
`rich` is installed, would draw its bars into a file too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

__all__ = ["STYLES", "NoBar", "YOLOProgressBar", "console_progress", "with_console_progress"]

STYLES = ("auto", "bar", "none")


class YOLOProgressBar(TQDMProgressBar):
    """The training bar shows `box`, `obj` and `cls`: this epoch's mean losses so far, as ultralytics' bar does.

    Lightning turns a `prog_bar=True` step metric into a Python number every step (a host sync each time). This bar
    instead asks the module for its running means (`YOLOv5Module.running_losses`, accumulated on the device) only
    when it redraws: every `refresh_rate` batches and at the end of the epoch.

    Args:
        refresh_rate: batches between redraws (each redraw reads the losses once).
    """

    def __init__(self, refresh_rate: int = 10, leave: bool = True) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)

    @override
    def on_train_start(self, *_: Any) -> None:
        """With `leave`, every epoch opens its own bar (`on_train_epoch_start`) and leaves it on screen when done; the
        bar Lightning would open here, `Training: | 0/?`, would be left behind unused, so a hidden one stands in."""
        if self._leave:
            self.train_progress_bar = Tqdm(disable=True)
        else:
            super().on_train_start()

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        running = getattr(pl_module, "running_losses", None)
        if callable(running) and trainer.training:
            items.update({name: f"{value:.4g}" for name, value in running().items()})
        return items


class NoBar(ProgressBar):
    """A progress bar that draws nothing: where stdout is not a terminal, the epoch lines are the progress.

    Lightning adds its own TQDM bar to a Trainer with `enable_progress_bar=True` and no progress-bar callback; this
    one takes that place.
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True


def console_progress(refresh_rate: int = 10, style: str = "auto") -> ProgressBar:
    """The progress-bar callback for where stdout goes.

    Args:
        refresh_rate: batches between redraws of the bar.
        style: `auto` (a bar on a terminal or in a notebook, none elsewhere), `bar` or `none`.

    Raises:
        ValueError: An unknown style.
    """
    from yolo5l.base.console import is_terminal

    if style not in STYLES:
        raise ValueError(f"callbacks.progress_bar.style={style!r} is not one of: {', '.join(STYLES)}")
    if style == "bar" or (style == "auto" and (is_terminal() or _in_notebook())):
        return YOLOProgressBar(refresh_rate=refresh_rate)
    return NoBar()


def _in_notebook() -> bool:
    """Whether stdout is a Jupyter kernel's output stream, which redraws a bar as a terminal does."""
    import sys

    return type(sys.stdout).__module__.startswith("ipykernel")


def with_console_progress(callbacks: Sequence[Callback], enabled: bool = True) -> list[Callback]:
    """`callbacks` with `console_progress()` added where they hold no progress bar, so that a Trainer draws a bar on
    a terminal only; with `enabled` False (`trainer.enable_progress_bar=false`) without any progress bar, since
    Lightning refuses one then."""
    if not enabled:
        return [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    if any(isinstance(cb, ProgressBar) for cb in callbacks):
        return list(callbacks)
    return [*callbacks, console_progress()]
