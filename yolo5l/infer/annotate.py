"""Drawing on images and writing them: detections drawn readably (line width by image size, labels on a filled
background, never clipped at an edge), crops of the detected boxes, a batch as a mosaic with its labels
(`draw_batch`: train_batch*.jpg, val_batch*.jpg), and the one JPEG encoder (`encode_jpeg`, `save_rgb`).

Reference: ultralytics/yolov5 v7.0 `utils/plots.py::Annotator` (line width max(round((h + w) / 2 * 0.003), 2),
a label box above the box when there is room, else inside it; `hide_labels`, `hide_conf` as detect.py makes the
labels) and `utils/plots.py::save_one_box` (a crop 1.02 x the box plus 10 pixels, clipped to the image).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import cv2
import numpy as np

from yolo5l.base.files import atomic_write

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "BOX_COLOR",
    "class_color",
    "crop_box",
    "draw_batch",
    "draw_detections",
    "encode_jpeg",
    "line_width",
    "save_rgb",
]

BOX_COLOR = (255, 255, 0)  # the labels of `draw_batch`: yellow (RGB)

_WIDTH_PER_PIXEL = 0.003
_MIN_WIDTH = 2
_FONT = cv2.FONT_HERSHEY_SIMPLEX
_TEXT = (255, 255, 255)


def line_width(shape: Sequence[int]) -> int:
    """Box line width for an (h, w, ...) image: thicker on larger images, at least 2 pixels."""
    return max(round((shape[0] + shape[1]) / 2 * _WIDTH_PER_PIXEL), _MIN_WIDTH)


def class_color(cls: int) -> tuple[int, int, int]:
    """A fixed, distinct BGR colour per class id, dark enough for white text."""
    rng = np.random.default_rng(cls)
    return tuple(int(v) for v in rng.integers(32, 200, 3))  # type: ignore[return-value]


def draw_detections(
    image: np.ndarray,
    dets: np.ndarray,
    names: Sequence[str],
    line_thickness: int | None = None,
    hide_labels: bool = False,
    hide_conf: bool = False,
) -> np.ndarray:
    """Draw (n, 6) detections [x1, y1, x2, y2, score, class] on a BGR uint8 image, in place; returns the image.

    Args:
        image: BGR uint8 (H, W, 3).
        dets: The detections, best first (drawn last, so on top).
        names: Class names.
        line_thickness: Box line width in pixels; None grows it with the image (`line_width`).
        hide_labels: Boxes only.
        hide_conf: Class names without scores.
    """
    h, w = image.shape[:2]
    lw = int(line_thickness) if line_thickness else line_width(image.shape)
    scale, thickness = lw / 3, max(lw - 1, 1)
    for x1, y1, x2, y2, score, cls in np.asarray(dets, dtype=np.float64).reshape(-1, 6)[::-1]:
        c = int(cls)
        color = class_color(c)
        p1 = (int(np.clip(x1, 0, w - 1)), int(np.clip(y1, 0, h - 1)))
        p2 = (int(np.clip(x2, 0, w - 1)), int(np.clip(y2, 0, h - 1)))
        cv2.rectangle(image, p1, p2, color, lw, cv2.LINE_AA)
        if hide_labels:
            continue
        name = names[c] if c < len(names) else str(c)
        label = name if hide_conf else f"{name} {score:.2f}"
        (tw, th), base = cv2.getTextSize(label, _FONT, scale, thickness)
        th += base
        left = min(max(p1[0], 0), max(w - tw, 0))  # slide left rather than run off the right edge
        top = p1[1] - th - lw if p1[1] - th - lw >= 0 else p1[1] + lw  # above the box, else inside it
        top = min(top, max(h - th, 0))
        cv2.rectangle(image, (left, top), (left + tw, top + th), color, cv2.FILLED, cv2.LINE_AA)
        cv2.putText(image, label, (left, top + th - base), _FONT, scale, _TEXT, thickness, cv2.LINE_AA)
    return image


def crop_box(image: np.ndarray, xyxy: Sequence[float], gain: float = 1.02, pad: int = 10) -> np.ndarray:
    """The part of `image` (H, W, C) around an xyxy box: width and height x `gain` + `pad` pixels about its centre,
    clipped to the image (a view)."""
    x1, y1, x2, y2 = (float(v) for v in xyxy)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    bw, bh = (x2 - x1) * gain + pad, (y2 - y1) * gain + pad
    h, w = image.shape[:2]
    left, top = int(np.clip(cx - bw / 2, 0, w)), int(np.clip(cy - bh / 2, 0, h))
    right, bottom = int(np.clip(cx + bw / 2, 0, w)), int(np.clip(cy + bh / 2, 0, h))
    return image[top:bottom, left:right]


def draw_batch(
    images: Tensor, targets: Tensor, names: list[str] | None = None, max_images: int = 16, max_size: int = 1920
) -> np.ndarray:
    """Draw (N, 6) normalised targets [image, class, cx, cy, w, h] on a (B, 3, H, W) batch (uint8, or float in
    [0, 1]); returns an (H', W', 3) uint8 RGB mosaic of up to `max_images` tiles, 4 a row, at most `max_size` px
    (YOLOv5's `plot_images` layout), drawn with OpenCV."""
    imgs = images[:max_images].detach()
    if imgs.is_floating_point():
        imgs = imgs * 255 if float(imgs.max()) <= 1.0 else imgs  # host sync: three batches per run
    imgs = imgs.clamp(0, 255).to("cpu").byte().permute(0, 2, 3, 1).numpy()  # (B, H, W, 3) RGB
    b, h, w, _ = imgs.shape
    cols = min(4, b)
    rows = math.ceil(b / cols)
    scale = min(1.0, max_size / max(rows * h, cols * w))
    hs, ws = max(1, round(h * scale)), max(1, round(w * scale))
    grid = np.full((rows * hs, cols * ws, 3), 255, np.uint8)
    t = targets.detach().float().cpu().numpy()
    for i in range(b):
        r, c = divmod(i, cols)
        tile = cv2.resize(imgs[i], (ws, hs), interpolation=cv2.INTER_AREA) if scale < 1 else imgs[i].copy()
        for _, cls, cx, cy, bw, bh in t[t[:, 0] == i]:
            x1, y1 = int((cx - bw / 2) * ws), int((cy - bh / 2) * hs)
            x2, y2 = int((cx + bw / 2) * ws), int((cy + bh / 2) * hs)
            cv2.rectangle(tile, (x1, y1), (x2, y2), BOX_COLOR, 2)  # YOLOv5 draws at least 2 px
            label = names[int(cls)] if names and int(cls) < len(names) else str(int(cls))
            cv2.putText(tile, label, (x1 + 1, max(y1 - 2, 8)), _FONT, 0.3, BOX_COLOR, 1, cv2.LINE_AA)
        grid[r * hs : (r + 1) * hs, c * ws : (c + 1) * ws] = tile
        cv2.rectangle(grid, (c * ws, r * hs), ((c + 1) * ws - 1, (r + 1) * hs - 1), (255, 255, 255), 1)
    return grid


# ---- image files ----------------------------------------------------------------------------------------------------
def encode_jpeg(image: np.ndarray, quality: int = 90, rgb: bool = True, full_chroma: bool = False) -> bytes:
    """JPEG bytes of an (H, W, 3) uint8 image (RGB, or BGR with `rgb=False`); `full_chroma`: 4:4:4 sampling (crops,
    where colour detail at box edges matters) instead of OpenCV's 4:2:0.

    Raises:
        ValueError: OpenCV could not encode the image.
    """
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)]
    if full_chroma:
        params += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444]
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR) if rgb else image, params)
    if not ok:
        raise ValueError(f"JPEG encoding of a {image.shape} image failed")
    return buf.tobytes()


def save_rgb(rgb: np.ndarray, path: str | os.PathLike, quality: int = 95) -> Path:
    """Write (H, W, 3) uint8 RGB as JPEG (`.jpg`, `encode_jpeg` at `quality`) or PNG (any other suffix)."""
    path = Path(path)
    if path.suffix.lower() in (".jpg", ".jpeg"):
        data = encode_jpeg(rgb, quality)
    else:
        ok, buf = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        if not ok:
            raise OSError(f"could not encode {path}")
        data = buf.tobytes()
    return atomic_write(path, data)
