"""YOLOv5's evolve files for the hyperparameter search (`hparams_search=evolve`), in the sweep folder.

- `evolve.csv`: a row per finished trial, appended as the trial ends (`append_generation`), in v7.0's layout: the
  validation metrics (`metrics/precision`, `metrics/recall`, `metrics/mAP_0.5`, `metrics/mAP_0.5:0.95`,
  `val/box_loss`, `val/obj_loss`, `val/cls_loss`), then every hyperparameter of the trial's hyp (`lr0`, `lrf`, ...),
  names and values right-aligned in 20 characters. A script written for v7.0's file (pandas with stripped column
  names, numpy's `loadtxt(..., delimiter=",", skiprows=1)`) reads it as it is. The metrics are those of the trial's
  best validation, so YOLOv5's fitness of a row (0.1 mAP@0.5 + 0.9 mAP@0.5:0.95) is what the trial returned to the
  sweeper; values are written in full (v7.0 rounds to 5 significant digits), so a row gives the trial's hyp exactly.
- `evolve.png` (`plot_evolve`, at the end of the search): a scatter of fitness against each searched hyperparameter,
  a panel each, the best trial marked with a black cross and named in the panel's title.

Reference: ultralytics/yolov5 v7.0 `utils/general.py::print_mutation` (evolve.csv), `utils/plots.py::plot_evolve`.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from yolo5l.base.files import atomic_write, file_lock
from yolo5l.tracking.loggers import RESULTS_COLUMNS

__all__ = ["METRIC_COLUMNS", "append_generation", "evolve_fitness", "plot_evolve", "read_evolve_csv"]

#: evolve.csv's first columns, v7.0's names with the metrics.csv key each one holds: results.csv's metric and
#: validation-loss columns, in their order (v7.0 train.py's `keys` before `print_mutation`).
METRIC_COLUMNS = tuple((name, key) for name, key in RESULTS_COLUMNS if name.startswith(("metrics/", "val/")))
#: The figure's panels a row.
PANELS_PER_ROW = 5


def _cell(value: float | int) -> str:
    # Full precision (the shortest text that reads back as the same float), right-aligned as v7.0's `%20.5g`.
    return f"{value if isinstance(value, int) else repr(float(value)):>20}"


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_evolve_csv(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of an evolve.csv (this module's or v7.0's) as {stripped column name: value}."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader, [])]
        return [{k: float(v) for k, v in zip(header, row, strict=True)} for row in reader if row]


def append_generation(
    sweep_dir: str | os.PathLike, metrics: Mapping[str, float], hyp: Mapping[str, Any]
) -> tuple[Path, dict[str, float]]:
    """Append a trial's row to `<sweep_dir>/evolve.csv`, under the file's lock (trials that end together keep both).

    Args:
        sweep_dir: The search's folder.
        metrics: The trial's validation, by metrics.csv key (`val/precision`, ..., `val/loss_cls`); a key it lacks
            is written as nan.
        hyp: The trial's hyperparameters; the numeric ones are written, in their order.

    Returns:
        The file and the row written, by column name.
    """
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / "evolve.csv"
    row = {name: float(metrics.get(key, math.nan)) for name, key in METRIC_COLUMNS}
    row |= {str(k): v for k, v in hyp.items() if _numeric(v)}
    with file_lock(sweep_dir / ".evolve.lock", "the search's evolve.csv"):
        text = path.read_text() if path.is_file() else ""
        header = [name.strip() for name in text.splitlines()[0].split(",")] if text else []
        if header and header != list(row):  # a trial with other hyp keys (hyp=a file with more): one table for all
            rows = [*read_evolve_csv(path), row]
            columns = list(dict.fromkeys([*header, *row]))
            text = ""
        else:
            rows, columns = [row], list(row)
        lines = [] if text else [",".join(f"{name:>20}" for name in columns)]
        lines += [",".join(_cell(r.get(name, math.nan)) for name in columns) for r in rows]
        atomic_write(path, text + "\n".join(lines) + "\n")
    return path, row


def evolve_fitness(row: Mapping[str, float]) -> float:
    """YOLOv5's fitness of an evolve.csv row: 0.1 mAP@0.5 + 0.9 mAP@0.5:0.95 (ultralytics/yolov5 v7.0
    `utils/metrics.py::fitness`)."""
    return 0.1 * row["metrics/mAP_0.5"] + 0.9 * row["metrics/mAP_0.5:0.95"]


def plot_evolve(csv_path: str | os.PathLike, keys: Sequence[str] | None = None) -> tuple[Path, list[str]] | None:
    """Draw `evolve.png` beside `csv_path`: fitness against each hyperparameter of `keys` (default: every one the
    file has), a panel each, points coloured by trial order (the latest brightest), the best trial's value marked
    and in the title.

    Returns:
        (the PNG, the hyperparameters drawn, in panel order), or None when the file has no row.
    """
    import numpy as np

    from yolo5l.eval.plots import new_figure, render
    from yolo5l.infer.annotate import save_rgb

    csv_path = Path(csv_path)
    rows = read_evolve_csv(csv_path)
    if not rows:
        return None
    names = [k for k in rows[0] if k not in dict(METRIC_COLUMNS)]
    drawn = [k for k in names if keys is None or k in keys]
    fitness = np.array([evolve_fitness(r) for r in rows])
    best = int(np.nanargmax(fitness)) if np.isfinite(fitness).any() else 0
    n_rows = max(1, math.ceil(len(drawn) / PANELS_PER_ROW))
    fig = new_figure(2.0 * min(len(drawn), PANELS_PER_ROW) + 0.5, 2.0 * n_rows)
    for i, key in enumerate(drawn):
        ax = fig.add_subplot(n_rows, PANELS_PER_ROW, i + 1)
        values = np.array([r.get(key, math.nan) for r in rows])
        ax.scatter(values, fitness, c=np.arange(len(rows)), cmap="viridis", s=12, alpha=0.8, edgecolors="none")
        ax.plot(values[best], fitness[best], "k+", markersize=15)
        ax.set_title(f"{key} = {values[best]:.3g}", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.locator_params(axis="x", nbins=4)  # small values (weight_decay) print wide tick labels
        if i % PANELS_PER_ROW:
            ax.set_yticklabels([])
        else:
            ax.set_ylabel("fitness", fontsize=8)
    png = save_rgb(render(fig), csv_path.with_suffix(".png"))
    return png, drawn
