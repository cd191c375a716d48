"""Pure-torch box ops: the CPU fallback and the test oracle for the fused kernels.

Everything here is element-wise, uses ``relu``/``clamp`` instead of boolean masks and never syncs the host, so it
is safe inside a training step and under ``torch.compile``.

Reference: ultralytics/yolov5 v7.0 ``utils/metrics.py::bbox_iou(..., xywh=True, CIoU=True)``;
Zheng et al., "Distance-IoU Loss" (AAAI 2020), arXiv:1911.08287.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["EPS", "ciou_xywh", "ciou_xyxy", "xywh_to_xyxy", "xyxy_to_xywh"]

EPS = 1e-7  # YOLOv5's bbox_iou eps: the default stabiliser of every CIoU here and in yolo5l_kernels.ciou
# 4 / pi^2, the normalisation of the CIoU aspect-ratio term v.
_V_SCALE = 4.0 / math.pi**2


def xywh_to_xyxy(boxes: Tensor) -> Tensor:
    """Convert ``[cx, cy, w, h]`` boxes to ``[x1, y1, x2, y2]``.

    Args:
        boxes: (..., 4) boxes as centre, width, height.

    Returns:
        (..., 4) boxes as top-left and bottom-right corners, same dtype and device.
    """
    ctr, wh = boxes[..., :2], boxes[..., 2:]
    half = wh / 2
    return torch.cat((ctr - half, ctr + half), dim=-1)


def xyxy_to_xywh(boxes: Tensor) -> Tensor:
    """Convert ``[x1, y1, x2, y2]`` boxes to ``[cx, cy, w, h]``.

    Args:
        boxes: (..., 4) boxes as top-left and bottom-right corners.

    Returns:
        (..., 4) boxes as centre, width, height, same dtype and device.
    """
    lo, hi = boxes[..., :2], boxes[..., 2:]
    return torch.cat(((lo + hi) / 2, hi - lo), dim=-1)


def _ciou_from_parts(
    b1_x1: Tensor,
    b1_y1: Tensor,
    b1_x2: Tensor,
    b1_y2: Tensor,
    w1: Tensor,
    h1: Tensor,
    b2_x1: Tensor,
    b2_y1: Tensor,
    b2_x2: Tensor,
    b2_y2: Tensor,
    w2: Tensor,
    h2: Tensor,
    eps: float,
) -> Tensor:
    # Intersection through relu, not masks (no host sync, compile-friendly): YOLOv5's clamp(0) values. Where edges
    # touch (overlap exactly 0) the CIoU has a kink; relu's gradient there is 0 on every torch version, the one-sided
    # derivative of the separated side that the fused backends give, while clamp's backward depends on the version
    # (torch 2.11 passes the gradient at 0, 2.14 blocks it).
    inter = torch.relu(torch.minimum(b1_x2, b2_x2) - torch.maximum(b1_x1, b2_x1)) * torch.relu(
        torch.minimum(b1_y2, b2_y2) - torch.maximum(b1_y1, b2_y1)
    )
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    # Smallest enclosing box: squared diagonal c^2.
    cw = torch.maximum(b1_x2, b2_x2) - torch.minimum(b1_x1, b2_x1)
    ch = torch.maximum(b1_y2, b2_y2) - torch.minimum(b1_y1, b2_y1)
    c2 = cw**2 + ch**2 + eps
    # Squared distance of the centres, written on the corners as YOLOv5 does.
    rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
    # Aspect-ratio consistency; +eps on h keeps zero-height boxes finite (YOLOv5 <= v6.2 put it on h).
    v = _V_SCALE * (torch.atan(w2 / (h2 + eps)) - torch.atan(w1 / (h1 + eps))) ** 2
    with torch.no_grad():  # alpha is a constant weight in YOLOv5: no gradient flows through it.
        # The clamp only acts where rounding lets iou exceed 1 by more than eps (fp32, identical boxes): there
        # YOLOv5 divides 0 by <= 0 and returns NaN; here alpha stays finite.
        alpha = v / (v - iou + (1 + eps)).clamp(min=eps)
    return iou - (rho2 / c2 + v * alpha)


def ciou_xywh(box1: Tensor, box2: Tensor, eps: float = EPS) -> Tensor:
    """Complete IoU of element-wise pairs of ``[cx, cy, w, h]`` boxes (the CIoU, not the loss ``1 - CIoU``).

    With corners derived from centre and size::

        inter = relu(min(x2) - max(x1)) * relu(min(y2) - max(y1))   (no gradient where edges touch)
        union = w1*h1 + w2*h2 - inter + eps,            iou = inter / union
        c^2   = cw^2 + ch^2 + eps                         (cw, ch: enclosing box)
        rho^2 = (cx2 - cx1)^2 + (cy2 - cy1)^2
        v     = 4/pi^2 * (atan(w2 / (h2 + eps)) - atan(w1 / (h1 + eps)))^2
        alpha = v / max(v - iou + 1 + eps, eps)           (no gradient)
        CIoU  = iou - (rho^2 / c^2 + alpha * v)

    Reference: ultralytics/yolov5 v7.0 ``utils/metrics.py::bbox_iou(xywh=True, CIoU=True)``.

    Args:
        box1: (N, 4) boxes ``[cx, cy, w, h]`` (e.g. predictions); any float dtype.
        box2: (N, 4) boxes ``[cx, cy, w, h]`` (e.g. targets), broadcastable against ``box1``.
        eps: stabiliser added to union, enclosing diagonal and heights in the aspect term.

    Returns:
        (N,) CIoU in [-1.5, 1], differentiable w.r.t. both inputs.
    """
    x1, y1, w1, h1 = box1.unbind(-1)
    x2, y2, w2, h2 = box2.unbind(-1)
    w1_, h1_, w2_, h2_ = w1 / 2, h1 / 2, w2 / 2, h2 / 2
    return _ciou_from_parts(
        x1 - w1_,
        y1 - h1_,
        x1 + w1_,
        y1 + h1_,
        w1,
        h1,
        x2 - w2_,
        y2 - h2_,
        x2 + w2_,
        y2 + h2_,
        w2,
        h2,
        eps,
    )


def ciou_xyxy(box1: Tensor, box2: Tensor, eps: float = EPS) -> Tensor:
    """Complete IoU of element-wise pairs of ``[x1, y1, x2, y2]`` boxes (see :func:`ciou_xywh` for the formula).

    Reference: ultralytics/yolov5 v7.0 ``utils/metrics.py::bbox_iou(xywh=False, CIoU=True)``.

    Args:
        box1: (N, 4) boxes ``[x1, y1, x2, y2]``.
        box2: (N, 4) boxes ``[x1, y1, x2, y2]``, broadcastable against ``box1``.
        eps: stabiliser added to union, enclosing diagonal and heights in the aspect term.

    Returns:
        (N,) CIoU, differentiable w.r.t. both inputs.
    """
    b1_x1, b1_y1, b1_x2, b1_y2 = box1.unbind(-1)
    b2_x1, b2_y1, b2_x2, b2_y2 = box2.unbind(-1)
    return _ciou_from_parts(
        b1_x1,
        b1_y1,
        b1_x2,
        b1_y2,
        b1_x2 - b1_x1,
        b1_y2 - b1_y1,
        b2_x1,
        b2_y1,
        b2_x2,
        b2_y2,
        b2_x2 - b2_x1,
        b2_y2 - b2_y1,
        eps,
    )
