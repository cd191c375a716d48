"""The released P5 detectors' table (yolov5n/s/m/l/x): v7.0's backbone and head before depth and width scaling.

Reference: ultralytics/yolov5 v7.0 ``models/yolov5{n,s,m,l,x}.yaml`` and ``models/yolo.py::parse_model`` (the
scaling rules).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LAYERS", "SAVE", "SCALES", "make_divisible", "p5_rows", "scaled_repeats"]


# depth_multiple, width_multiple of the released sizes (models/yolov5{n,s,m,l,x}.yaml).
SCALES: dict[str, tuple[float, float]] = {
    "yolov5n": (0.33, 0.25),
    "yolov5s": (0.33, 0.50),
    "yolov5m": (0.67, 0.75),
    "yolov5l": (1.0, 1.0),
    "yolov5x": (1.33, 1.25),
}

# The v7.0 backbone + head before scaling: (from, repeats, block, args).
# Conv args (c2, k, s[, p]); C3 args (c2[, shortcut]); SPPF (c2, k); Concat (dim,).
LAYERS: tuple[tuple[int | tuple[int, ...], int, str, tuple[Any, ...]], ...] = (
    (-1, 1, "Conv", (64, 6, 2, 2)),  # 0  P1/2
    (-1, 1, "Conv", (128, 3, 2)),  # 1  P2/4
    (-1, 3, "C3", (128,)),  # 2
    (-1, 1, "Conv", (256, 3, 2)),  # 3  P3/8
    (-1, 6, "C3", (256,)),  # 4
    (-1, 1, "Conv", (512, 3, 2)),  # 5  P4/16
    (-1, 9, "C3", (512,)),  # 6
    (-1, 1, "Conv", (1024, 3, 2)),  # 7  P5/32
    (-1, 3, "C3", (1024,)),  # 8
    (-1, 1, "SPPF", (1024, 5)),  # 9
    (-1, 1, "Conv", (512, 1, 1)),  # 10
    (-1, 1, "Upsample", ()),  # 11
    ((-1, 6), 1, "Concat", (1,)),  # 12 cat backbone P4
    (-1, 3, "C3", (512, False)),  # 13
    (-1, 1, "Conv", (256, 1, 1)),  # 14
    (-1, 1, "Upsample", ()),  # 15
    ((-1, 4), 1, "Concat", (1,)),  # 16 cat backbone P3
    (-1, 3, "C3", (256, False)),  # 17 (P3/8 out)
    (-1, 1, "Conv", (256, 3, 2)),  # 18
    ((-1, 14), 1, "Concat", (1,)),  # 19 cat head P4
    (-1, 3, "C3", (512, False)),  # 20 (P4/16 out)
    (-1, 1, "Conv", (512, 3, 2)),  # 21
    ((-1, 10), 1, "Concat", (1,)),  # 22 cat head P5
    (-1, 3, "C3", (1024, False)),  # 23 (P5/32 out)
    ((17, 20, 23), 1, "Detect", ()),  # 24
)
SAVE: tuple[int, ...] = (4, 6, 10, 14, 17, 20, 23)


def make_divisible(x: float, divisor: int = 8) -> int:
    """``ceil(x / divisor) * divisor``: channel counts after the width multiple."""
    return int(math.ceil(x / divisor) * divisor)


def scaled_repeats(n: int, depth: float) -> int:
    """A row's ``number`` after the depth multiple, as v7.0's ``models/yolo.py::parse_model``:
    ``max(round(n * depth), 1)`` when ``n > 1`` (3 -> 1, 6 -> 2, 9 -> 3 at 0.33)."""
    return max(round(n * depth), 1) if n > 1 else n


def p5_rows() -> list[list[Any]]:
    """The P5 table as v7.0 model-yaml rows (``backbone + head``), e.g. to recognise a checkpoint's yaml."""
    rows: list[list[Any]] = []
    for f, n, block, args in LAYERS:
        if block == "Upsample":
            block, args = "nn.Upsample", (None, 2, "nearest")
        elif block == "Detect":
            args = ("nc", "anchors")
        rows.append([f if isinstance(f, int) else list(f), n, block, list(args)])
    return rows
