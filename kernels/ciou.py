"""Fused CIoU with dispatch (placeholder: every backend currently runs the pure-torch reference)."""

from __future__ import annotations

from torch import Tensor
from yolo5l_kernels import reference

__all__ = ["ciou_xywh"]


def ciou_xywh(box1: Tensor, box2: Tensor, eps: float = 1e-7, backend: str = "auto") -> Tensor:
    """CIoU of element-wise pairs of (N, 4) ``[cx, cy, w, h]`` boxes; see ``reference.ciou_xywh``."""
    if backend not in ("auto", "reference", "triton", "cpu"):
        raise ValueError(f"yolo5l_kernels.ciou: unknown backend {backend!r}; use auto, reference, triton or cpu")
    return reference.ciou_xywh(box1, box2, eps)
