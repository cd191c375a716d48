"""A Lightning logger that writes one CSV row per epoch.

Lightning's `CSVLogger` writes a row per logging call, so step and epoch metrics land on different rows. This one
merges every value logged during an epoch into that epoch's row (the last value wins), and always writes the
columns people look for first: losses, precision, recall, mAP@0.5, mAP@0.5:0.95, images/s and the data-wait share.
Beside it, the same rows in YOLOv5's `results.csv` layout, for scripts written against YOLOv5's run folders.

`fitting` tells the run's loggers whether the trainer that starts is fitting: what a `trainer.validate` or
`trainer.test` of the same trainer logs is no training epoch, and stays out of the run's tables and curves.
"""

from __future__ import annotations

import csv
import os
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from yolo5l.base.files import atomic_open, atomic_write

#: Columns always present, in this order; anything else logged follows, sorted.
CORE_COLUMNS = (
    "epoch",
    "train/loss_box",
    "train/loss_obj",
    "train/loss_cls",
    "val/precision",
    "val/recall",
    "val/map_50",
    "val/map",
    "train/images_per_sec",
    "train/data_wait",
)

#: The end of a per-step value's name (`train/loss_box_step`; Lightning's too, for on_step and on_epoch values).
STEP_SUFFIX = "_step"

#: YOLOv5's results.csv columns after `epoch`, in its order, with the metrics.csv column each one shows
#: (ultralytics/yolov5 v7.0 `utils/loggers/__init__.py::Loggers`, its `keys`).
RESULTS_COLUMNS = (
    ("train/box_loss", "train/loss_box"), ("train/obj_loss", "train/loss_obj"), ("train/cls_loss", "train/loss_cls"),
    ("metrics/precision", "val/precision"), ("metrics/recall", "val/recall"), ("metrics/mAP_0.5", "val/map_50"),
    ("metrics/mAP_0.5:0.95", "val/map"), ("val/box_loss", "val/loss_box"), ("val/obj_loss", "val/loss_obj"),
    ("val/cls_loss", "val/loss_cls"), ("x/lr0", "train/lr0"), ("x/lr1", "train/lr1"), ("x/lr2", "train/lr2"),
)  # fmt: skip


class EpochCSVLogger(Logger):
    """Per-epoch metrics table at `<save_dir>/<filename>`, rewritten atomically whenever a value changes.

    A table already in the folder (a resumed or extended run) is continued: its rows before the first epoch this
    logger sees are kept, and rows from that epoch on are replaced, so a fresh run in a reused folder starts clean
    and a resumed one loses no earlier row.

    `results_filename` (YOLOv5's `results.csv`) gets the same epochs in YOLOv5's columns and format (names and
    values right-aligned in 20 characters, values to 5 significant digits); an epoch without validation repeats the
    last validation's metrics (zeros before the first), as YOLOv5's file does.

    Rows hold the fit's values only: a `trainer.validate` or `trainer.test` after (or before) `trainer.fit` trained
    no epoch, so its metrics (returned by the call) make no row (`fitting`). Per-step values (names ending in
    `_step`) stay out of the rows too: a row holds the epoch's values (`train/loss_box` is the epoch's mean).
    `history` keeps every value of the fit, per-step ones included.

    Args:
        save_dir: Folder of the CSV file (the run folder).
        filename: Name of the CSV file.
        results_filename: Name of the YOLOv5-layout file beside it; None writes none.
    """

    def __init__(
        self, save_dir: str | os.PathLike, filename: str = "metrics.csv", results_filename: str | None = None
    ) -> None:
        super().__init__()
        self._save_dir = str(save_dir)
        self.path = Path(save_dir) / filename
        self.results_path = Path(save_dir) / results_filename if results_filename else None
        self.rows: dict[int, dict[str, float]] = {}
        #: Every value logged for each key, in order (the sweep summary takes medians from it).
        self.history: dict[str, list[float]] = {}
        self._epoch = 0
        self._dirty = False
        self._recording = True  # False while the trainer validates or tests outside fit (`log_graph`)
        self._earlier: dict[int, dict[str, float | str]] | None = {}  # rows of a table already in the folder
        if self.path.is_file():
            for old in read_metrics_csv(self.path):
                if str(old.get("epoch", "")).isdigit():
                    self._earlier[int(old["epoch"])] = {k: v for k, v in old.items() if v != ""}

    @property
    @override
    def name(self) -> str:
        return ""

    @property
    @override
    def version(self) -> str:
        return ""

    @property
    @override
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @override
    def log_dir(self) -> str:
        return self._save_dir

    @override
    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass  # Hydra already saves the full config under <run>/.hydra/

    @override
    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        self._recording = fitting(model)  # Lightning calls it as each fit, validate and test starts

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self._recording:
            return
        # Lightning adds "epoch" to what it logs itself; values logged straight to the logger by callbacks
        # belong to the last epoch seen.
        if "epoch" in metrics:
            self._epoch = int(metrics["epoch"])
        if self._earlier is not None:  # the first values of this run: earlier rows from here on are superseded
            self.rows = {e: r for e, r in self._earlier.items() if e < self._epoch}  # type: ignore[misc]
            self._earlier = None
            self._dirty = True
        for key, value in metrics.items():
            if key == "epoch":
                continue
            value = float(value)
            self.history.setdefault(key, []).append(value)
            if not key.endswith(STEP_SUFFIX):
                self.rows.setdefault(self._epoch, {"epoch": self._epoch})[key] = value
                self._dirty = True

    @override
    @rank_zero_only
    def save(self) -> None:
        if not self._dirty:
            return
        keys = {k for row in self.rows.values() for k in row}
        columns = list(CORE_COLUMNS) + sorted(keys - set(CORE_COLUMNS))
        with atomic_open(self.path, "w") as f:  # readers never see a half-written table
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            for epoch in sorted(self.rows):
                writer.writerow({k: _fmt(v) for k, v in self.rows[epoch].items()})
        if self.results_path is not None:
            write_results_csv(self.rows, self.results_path)
        self._dirty = False

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()


def fitting(module: Any) -> bool:
    """Whether the trainer of `module` (the LightningModule that Lightning passes to `Logger.log_graph` as each
    `fit`, `validate` and `test` starts) is fitting; True when that cannot be told."""
    try:
        return module.trainer.state.fn == "fit"  # a `TrainerFn`, a str
    except Exception:  # no trainer attached (a module outside Lightning): everything is logged
        return True


def _fmt(value: float | str) -> str | int:
    return value if isinstance(value, int | str) else f"{value:.6g}"


def write_results_csv(rows: Mapping[int, Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write per-epoch rows (metrics.csv's keys) as YOLOv5's results.csv, atomically; returns the path."""
    path = Path(path)
    names = ["epoch", *(name for name, _ in RESULTS_COLUMNS)]
    lines = [",".join(f"{n:>20s}" for n in names)]
    last: dict[str, float] = {}
    for epoch in sorted(rows):
        row = rows[epoch]
        values = [float(epoch)]
        for _, key in RESULTS_COLUMNS:
            if key in row and row[key] != "":
                last[key] = float(row[key])
            values.append(last.get(key, 0.0))
        lines.append(",".join(f"{v:>20.5g}" for v in values))
    return atomic_write(path, "\n".join(lines) + "\n")


def read_metrics_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a metrics.csv written by `EpochCSVLogger` (values as strings, '' where not logged)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
