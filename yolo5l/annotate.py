"""Draw detections readably: line width by image size, labels on a filled background, never clipped at an edge;
crops of the detected boxes.

Reference: ultralytics/yolov5 v7.0 `utils/plots.py::Annotator` (line width max(round((h + w) / 2 * 0.003), 2),
a label box above the box when there is room, else inside it; `hide_labels`, `hide_conf` as detect.py makes the
labels) and `utils/plots.py::save_one_box` (a crop 1.02 x the box plus 10 pixels, clipped to the image).
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

__all__ = ["class_color", "crop_box", "draw_detections", "line_width"]

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
