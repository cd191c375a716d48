"""The first look at a dataset's training labels that YOLOv5 leaves in a run folder before the first epoch.

- `labels.jpg`: 2 x 2 panels: instances per class (bars in the class colours, named when there are fewer than 30
  classes), up to 1000 boxes drawn at their size around a common centre, and 2D histograms of the box centres (x, y)
  and sizes (width, height), all normalised to the image.
- `labels_correlogram.jpg`: the pairwise distributions of x, y, width and height: a histogram of each on the
  diagonal, a 2D histogram of each pair below it.

The 2D histograms saturate their colour scale where the cells below it hold 90% of the boxes, so a few crowded
cells do not wash the rest out. Drawn with matplotlib's Agg canvas (no pyplot, no seaborn).

Reference: ultralytics/yolov5 v7.0 `utils/plots.py::plot_labels`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import cv2
import numpy as np

from yolo5l.eval.plots import new_figure, render
from yolo5l.infer.annotate import class_color, save_rgb

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["LABEL_FILES", "correlogram_figure", "labels_figure", "write_label_plots"]

#: The files `write_label_plots` writes.
LABEL_FILES = ("labels.jpg", "labels_correlogram.jpg")
_COLUMNS = ("x", "y", "width", "height")
_BINS = 50
_PMAX = 0.9  # the colour scale tops out where the cells below it hold this share of the boxes
_SHAPES_DRAWN = 1000
_CANVAS = 2000  # pixels of the box-shape panel


def _rgb(color_bgr: tuple[int, int, int]) -> tuple[float, float, float]:
    b, g, r = color_bgr
    return r / 255, g / 255, b / 255


def _saturation(counts: np.ndarray, pmax: float = _PMAX) -> float:
    """The count at which the cells at or below it hold `pmax` of the total."""
    values = np.sort(counts[counts > 0].ravel())
    if values.size == 0:
        return 1.0
    cum = np.cumsum(values) / values.sum()
    return float(values[min(int(np.searchsorted(cum, pmax)), values.size - 1)])


def _hist2d(ax: Axes, x: np.ndarray, y: np.ndarray, xlabel: str, ylabel: str) -> None:
    counts, xe, ye = np.histogram2d(x, y, bins=_BINS)
    shown = np.ma.masked_equal(counts.T, 0)  # empty cells stay white
    ax.pcolormesh(xe, ye, shown, cmap="Blues", vmin=0, vmax=_saturation(counts), shading="flat")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _hide_spines(ax: Axes) -> None:
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def _shapes_canvas(labels: np.ndarray) -> np.ndarray:
    """The first 1000 boxes drawn at their normalised size around the canvas centre, in class colours (RGB)."""
    canvas = np.full((_CANVAS, _CANVAS, 3), 255, np.uint8)
    for cls, _, _, w, h in labels[:_SHAPES_DRAWN]:
        x1, y1 = round((0.5 - w / 2) * _CANVAS), round((0.5 - h / 2) * _CANVAS)
        x2, y2 = round((0.5 + w / 2) * _CANVAS), round((0.5 + h / 2) * _CANVAS)
        cv2.rectangle(canvas, (x1, y1), (x2, y2), class_color(int(cls))[::-1], 1)
    return canvas


def labels_figure(labels: np.ndarray, names: Sequence[str]) -> Figure:
    """`labels.jpg` for (N, 5) training labels ``[cls, x, y, w, h]`` (normalised) and the dataset's class names."""
    labels = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
    nc = max(len(names), int(labels[:, 0].max()) + 1 if len(labels) else 1)
    fig = new_figure(8, 8)
    axes = fig.subplots(2, 2).ravel()
    counts = np.bincount(labels[:, 0].astype(int), minlength=nc)
    axes[0].bar(np.arange(nc), counts, width=0.8, color=[_rgb(class_color(i)) for i in range(nc)])
    axes[0].set_ylabel("instances")
    if 0 < len(names) < 30:
        axes[0].set_xticks(range(len(names)))
        axes[0].set_xticklabels(list(names), rotation=90, fontsize=10)
    else:
        axes[0].set_xlabel("classes")
    axes[1].imshow(_shapes_canvas(labels))
    axes[1].axis("off")
    _hist2d(axes[2], labels[:, 1], labels[:, 2], "x", "y")
    _hist2d(axes[3], labels[:, 3], labels[:, 4], "width", "height")
    for ax in axes:
        _hide_spines(ax)
    return fig


def correlogram_figure(labels: np.ndarray) -> Figure:
    """`labels_correlogram.jpg`: histograms of x, y, width, height on the diagonal, 2D histograms below it."""
    boxes = np.asarray(labels, dtype=np.float64).reshape(-1, 5)[:, 1:]
    n = len(_COLUMNS)
    fig = new_figure(2.5 * n, 2.5 * n)
    axes = fig.subplots(n, n, squeeze=False)
    for i in range(n):
        for j in range(n):
            ax = axes[i, j]
            if j > i:
                ax.remove()  # the lower triangle only: the upper one repeats it
                continue
            if i == j:
                ax.hist(boxes[:, i], bins=_BINS, color="#4c72b0", edgecolor="white", linewidth=0.3)
            else:
                _hist2d(ax, boxes[:, j], boxes[:, i], "", "")
            ax.set_xlabel(_COLUMNS[j] if i == n - 1 else "")
            ax.set_ylabel(_COLUMNS[i] if j == 0 and i > 0 else "")
            ax.spines["top"].set_visible(False)
            ax.spines["right"].set_visible(False)
    return fig


def write_label_plots(labels: np.ndarray, names: Sequence[str], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `labels.jpg` and `labels_correlogram.jpg` into `out_dir`; returns {file name: path}."""
    out = Path(out_dir)
    return {
        "labels.jpg": save_rgb(render(labels_figure(labels, names)), out / "labels.jpg"),
        "labels_correlogram.jpg": save_rgb(render(correlogram_figure(labels)), out / "labels_correlogram.jpg"),
    }
