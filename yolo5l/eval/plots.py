"""What ultralytics' val.py and train.py leave in a run folder after validation, drawn from yolo5l's own results.

- `format_per_class_table` / `write_per_class_csv`: the per-class table (class, images, instances, P, R, mAP@0.5,
  mAP@0.5:0.95, the `all` row first) of a `yolo5l.eval.metrics.PerClassResults`, printed and as `per_class.csv`.
- `validation_figures`: `confusion_matrix.png` (YOLOv5's matrix, columns normalised), `PR_curve.png`,
  `F1_curve.png`, `P_curve.png`, `R_curve.png` (ultralytics/yolov5 v7.0 `utils/metrics.py::ConfusionMatrix.plot`,
  `plot_pr_curve`, `plot_mc_curve`: per-class lines with a legend up to 20 classes, the class mean in bold).
- `results_figure`: `results.png`, the run's losses, P, R and mAPs per epoch from its metrics.csv (yolov5
  `utils/plots.py::plot_results`: 2 x 5 panels, each with a smoothed line).
- `draw_val_batch`: `val_batch{i}_labels.jpg` / `val_batch{i}_pred.jpg`, a validation batch with its labels and
  with its detections above 0.25 (drawn with `yolo5l.infer.annotate.draw_batch`).

matplotlib draws on its Agg canvas without pyplot (no global figure state, nothing to close); a figure is rendered
once, and the same RGB pixels go to the PNG file and to the loggers.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from yolo5l.base.files import atomic_open
from yolo5l.eval.per_class import PerClassResults
from yolo5l.infer.annotate import draw_batch, save_rgb

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "PER_CLASS_COLUMNS",
    "RESULTS_PANELS",
    "draw_val_batch",
    "format_per_class_table",
    "new_figure",
    "per_class_rows",
    "render",
    "results_figure",
    "to_letterbox",
    "validation_figures",
    "write_per_class_csv",
    "write_validation_files",
]

#: Columns of the per-class table and of per_class.csv (ultralytics' val.py order).
PER_CLASS_COLUMNS = ("Class", "Images", "Instances", "P", "R", "mAP@0.5", "mAP@0.5:0.95")
#: metrics.csv columns of results.png, row by row (yolov5's layout: train losses and P, R; val losses and mAPs).
RESULTS_PANELS = (
    "train/loss_box", "train/loss_obj", "train/loss_cls", "val/precision", "val/recall",
    "val/loss_box", "val/loss_obj", "val/loss_cls", "val/map_50", "val/map",
)  # fmt: skip
PLOT_DPI = 150  # ultralytics saves at 250; 150 keeps the figures readable at about a third of the pixels
PRED_CONF = 0.25  # detections drawn on val_batch*_pred.jpg (ultralytics' plot_images threshold)


# ---- the per-class table -------------------------------------------------------------------------------------------
def _name(names: Sequence[str], cls: int) -> str:
    return str(names[cls]) if 0 <= cls < len(names) else str(cls)


def per_class_rows(results: PerClassResults, names: Sequence[str]) -> list[tuple[Any, ...]]:
    """The table's rows: `all` first (all images, all labels, the means over classes), then one per class with
    labels, as (class, images, instances, P, R, mAP@0.5, mAP@0.5:0.95)."""
    o = results.overall()
    rows: list[tuple[Any, ...]] = [
        ("all", o["images"], o["instances"], o["precision"], o["recall"], o["map_50"], o["map"])
    ]
    for i, c in enumerate(results.classes.tolist()):
        rows.append((
            _name(names, int(c)), int(results.images[i]), int(results.instances[i]), float(results.precision[i]),
            float(results.recall[i]), float(results.map_50[i]), float(results.map[i]),
        ))  # fmt: skip
    return rows


def format_per_class_table(results: PerClassResults, names: Sequence[str]) -> str:
    """The per-class table as ultralytics' val.py prints it (right-aligned, 3 decimals), header included."""
    rows = per_class_rows(results, names)
    width = max(22, *(len(r[0]) + 2 for r in rows))
    lines = [f"{PER_CLASS_COLUMNS[0]:>{width}}" + "".join(f"{c:>13}" for c in PER_CLASS_COLUMNS[1:])]
    for name, images, instances, *values in rows:
        lines.append(f"{name:>{width}}{images:>13}{instances:>13}" + "".join(f"{v:>13.3f}" for v in values))
    return "\n".join(lines)


def write_per_class_csv(results: PerClassResults, names: Sequence[str], path: str | os.PathLike) -> Path:
    """Write the table as CSV (a `class_id` column added, empty for `all`; values to 6 significant digits), through a
    temporary file so that a reader never sees half of it."""
    with atomic_open(path, "w") as f:
        writer = csv.writer(f)
        writer.writerow(("class_id", *PER_CLASS_COLUMNS))
        ids = ["", *(str(int(c)) for c in results.classes)]
        for cid, (name, images, instances, *values) in zip(ids, per_class_rows(results, names), strict=True):
            writer.writerow((cid, name, images, instances, *(f"{v:.6g}" for v in values)))
    return Path(path)


# ---- figures --------------------------------------------------------------------------------------------------------
def new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=PLOT_DPI, layout="tight")
    FigureCanvasAgg(fig)
    return fig


def render(fig: Figure) -> np.ndarray:
    """Draw a figure once on its Agg canvas; returns (H, W, 3) uint8 RGB."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _box_smooth(y: np.ndarray, fraction: float = 0.05) -> np.ndarray:
    """ultralytics' `smooth`: a box filter over `fraction` of the points, edges replicated."""
    nf = round(len(y) * fraction * 2) // 2 + 1
    padded = np.concatenate((np.full(nf // 2, y[0]), y, np.full(nf // 2, y[-1])))
    return np.convolve(padded, np.ones(nf) / nf, mode="valid")


def _legend_names(results: PerClassResults, names: Sequence[str]) -> list[str] | None:
    """Class names for a per-class legend, or None past 20 classes (ultralytics draws those grey, unnamed)."""
    k = results.classes.shape[0]
    return [_name(names, int(c)) for c in results.classes] if 0 < k < 21 else None


def _pr_figure(results: PerClassResults, names: Sequence[str]) -> Figure:
    fig = new_figure(9, 6)
    ax = fig.add_subplot()
    px, py, legend = results.pr_recall, results.pr_curve, _legend_names(results, names)
    for i, y in enumerate(py):
        if legend is not None:
            ax.plot(px, y, linewidth=1, label=f"{legend[i]} {results.map_50[i]:.3f}")
        else:
            ax.plot(px, y, linewidth=1, color="grey")
    if py.shape[0]:
        label = f"all classes {results.map_50.mean():.3f} mAP@0.5"
        ax.plot(px, py.mean(0), linewidth=3, color="blue", label=label)
    ax.set(xlabel="Recall", ylabel="Precision", xlim=(0, 1), ylim=(0, 1), title="Precision-Recall Curve")
    if py.shape[0]:
        ax.legend(bbox_to_anchor=(1.04, 1), loc="upper left")
    return fig


def _mc_figure(results: PerClassResults, names: Sequence[str], curves: np.ndarray, ylabel: str) -> Figure:
    fig = new_figure(9, 6)
    ax = fig.add_subplot()
    px, legend = results.conf_grid, _legend_names(results, names)
    for i, y in enumerate(curves):
        if legend is not None:
            ax.plot(px, y, linewidth=1, label=legend[i])
        else:
            ax.plot(px, y, linewidth=1, color="grey")
    if curves.shape[0]:
        y = _box_smooth(curves.mean(0))
        best = int(y.argmax())
        ax.plot(px, y, linewidth=3, color="blue", label=f"all classes {y[best]:.2f} at {px[best]:.3f}")
        ax.legend(bbox_to_anchor=(1.04, 1), loc="upper left")
    ax.set(xlabel="Confidence", ylabel=ylabel, xlim=(0, 1), ylim=(0, 1), title=f"{ylabel}-Confidence Curve")
    return fig


def _confusion_figure(matrix: np.ndarray, names: Sequence[str]) -> Figure:
    """The confusion matrix with each true class's column normalised to 1 (ultralytics' default), cells below
    0.005 left blank; annotated below 30 classes, named below 99."""
    nc = matrix.shape[0] - 1
    array = matrix / (matrix.sum(0, keepdims=True) + 1e-9)
    array[array < 0.005] = np.nan
    fig = new_figure(12, 9)
    ax = fig.add_subplot()
    image = ax.imshow(array, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if nc < 30:
        for (row, col), value in np.ndenumerate(array):
            if not np.isnan(value):
                color = "white" if value > 0.5 else "black"
                ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=8, color=color)
    if 0 < len(names) < 99 and len(names) == nc:
        ticks = [*map(str, names), "background"]
        ax.set_xticks(range(nc + 1), ticks, rotation=90)
        ax.set_yticks(range(nc + 1), ticks)
    ax.set(xlabel="True", ylabel="Predicted", title="Confusion Matrix")
    return fig


def validation_figures(results: PerClassResults, names: Sequence[str]) -> dict[str, Figure]:
    """ultralytics' validation figures by file stem: confusion_matrix (when the metric kept one), PR_curve,
    F1_curve, P_curve, R_curve."""
    figures: dict[str, Figure] = {}
    if results.confusion is not None:
        figures["confusion_matrix"] = _confusion_figure(results.confusion, names)
    figures["PR_curve"] = _pr_figure(results, names)
    figures["F1_curve"] = _mc_figure(results, names, results.f1_curve, "F1")
    figures["P_curve"] = _mc_figure(results, names, results.p_curve, "Precision")
    figures["R_curve"] = _mc_figure(results, names, results.r_curve, "Recall")
    return figures


def write_validation_files(
    results: PerClassResults,
    names: Sequence[str],
    out_dir: str | os.PathLike,
    plots: bool = True,
    figures: Mapping[str, Figure] | None = None,
    on_image: Callable[[str, np.ndarray], None] | None = None,
) -> dict[str, Path]:
    """Write per_class.csv and, with `plots`, the validation figures (and `figures`, by stem) as PNG into `out_dir`.

    Args:
        results: the metric's `per_class()`.
        names: class names.
        out_dir: the run folder.
        plots: False writes the CSV only.
        figures: more figures to write (results.png after training).
        on_image: called with (stem, RGB pixels) of each figure, for the loggers.

    Returns:
        {file name: path} of what was written.
    """
    out = Path(out_dir)
    files = {"per_class.csv": write_per_class_csv(results, names, out / "per_class.csv")}
    if plots:
        for stem, fig in {**validation_figures(results, names), **(figures or {})}.items():
            rgb = render(fig)
            files[f"{stem}.png"] = save_rgb(rgb, out / f"{stem}.png")
            if on_image is not None:
                on_image(stem, rgb)
    return files


def _gaussian_smooth(y: np.ndarray, sigma: float = 3.0) -> np.ndarray:
    """A Gaussian filter truncated at 4 sigma with mirrored edges (scipy's `gaussian_filter1d` defaults, which
    yolov5's results.png uses for its dotted line)."""
    radius = int(4 * sigma + 0.5)
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    return np.convolve(np.pad(y, radius, mode="symmetric"), kernel / kernel.sum(), mode="valid")


def results_figure(rows: Sequence[Mapping[str, str]]) -> Figure | None:
    """results.png from metrics.csv rows (`yolo5l.tracking.loggers.read_metrics_csv`): each `RESULTS_PANELS` column
    against the epoch, with a smoothed line; None when no row has a value to draw."""

    def column(key: str) -> tuple[np.ndarray, np.ndarray]:
        pairs = [(float(r["epoch"]), float(r[key])) for r in rows if r.get(key, "") != "" and r.get("epoch", "")]
        pairs = [(x, y) for x, y in pairs if math.isfinite(y)]
        return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])

    from matplotlib.ticker import MaxNLocator

    data = {key: column(key) for key in RESULTS_PANELS}
    if not any(x.size for x, _ in data.values()):
        return None
    fig = new_figure(12, 6)
    axes = fig.subplots(2, 5).ravel()
    for ax, (key, (x, y)) in zip(axes, data.items(), strict=True):
        if x.size:
            ax.plot(x, y, marker=".", linewidth=2, markersize=8, label="results")
            if x.size >= 5:  # fewer points: the smoothed line says nothing the points do not
                ax.plot(x, _gaussian_smooth(y), ":", linewidth=2, label="smooth")
        ax.set_title(key, fontsize=12)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs
    axes[1].legend()
    return fig


# ---- validation batches ---------------------------------------------------------------------------------------------
def to_letterbox(det: Tensor, img_hw: Sequence[int], shape: Any) -> Tensor:
    """Map (n, 4+) xyxy boxes from original-image pixels into the letterboxed batch image (the inverse of
    `yolo5l.infer.boxes.scale_boxes`); `shape` is the batch's ((h0, w0), ((ratio_h, ratio_w), (pad_w, pad_h))) or None
    (the boxes already are in batch pixels). Returns a new tensor."""
    out = det.clone()
    if shape is None:
        return out
    (h0, w0), ratio_pad = shape[0], shape[1] if len(shape) > 1 else None
    if ratio_pad is None:
        gain = min(img_hw[0] / h0, img_hw[1] / w0)
        pad_w, pad_h = (img_hw[1] - w0 * gain) / 2, (img_hw[0] - h0 * gain) / 2
    else:
        gain, (pad_w, pad_h) = ratio_pad[0][0], ratio_pad[1]
    out[:, :4] *= gain
    out[:, [0, 2]] += pad_w
    out[:, [1, 3]] += pad_h
    return out


def draw_val_batch(
    images: Tensor,
    targets: Tensor,
    dets: Sequence[Tensor],
    names: Sequence[str],
    max_images: int = 16,
    conf: float = PRED_CONF,
) -> tuple[np.ndarray, np.ndarray]:
    """A validation batch drawn twice: with its labels and with its detections above `conf`.

    Args:
        images: (B, 3, H, W) uint8 (or float in [0, 1]) letterboxed batch.
        targets: (N, 6) [image, class, cx, cy, w, h] normalised to the batch, as the dataloader gives them.
        dets: per image (n, 6) [x1, y1, x2, y2, score, class] in batch pixels (`to_letterbox`).
        names: class names.
        max_images: images drawn (ultralytics: 16).
        conf: score a detection needs to be drawn.

    Returns:
        (labels, predictions) as (H', W', 3) uint8 RGB mosaics.
    """
    h, w = images.shape[2:]
    scale = torch.tensor([w, h, w, h], dtype=torch.float32)
    rows = []
    for i, d in enumerate(dets[:max_images]):
        d = d.detach().float().cpu()
        d = d[d[:, 4] > conf]
        xyxy = d[:, :4] / scale
        cxcywh = torch.cat(((xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]), 1)
        rows.append(torch.cat((torch.full((d.shape[0], 1), float(i)), d[:, 5:6], cxcywh), 1))
    pred_targets = torch.cat(rows) if rows else torch.zeros((0, 6))
    names = list(names)
    labels = draw_batch(images, targets.detach().float().cpu(), names, max_images)
    return labels, draw_batch(images, pred_targets, names, max_images)
