"""yolo5l_kernels: fused box and upsample ops for YOLOv5 training (import name `yolo5l_kernels`).

Importing this package never imports ``triton``; the Triton kernels load on first use on CUDA.
"""

from __future__ import annotations

from yolo5l_kernels.ciou import ciou_xywh
from yolo5l_kernels.reference import ciou_xyxy, xywh_to_xyxy, xyxy_to_xywh
from yolo5l_kernels.upsample import UpsampleNearest2x, upsample_nearest2x

__all__ = ["UpsampleNearest2x", "ciou_xywh", "ciou_xyxy", "upsample_nearest2x", "xywh_to_xyxy", "xyxy_to_xywh"]
