"""CIoU forward and analytic backward written as a few vectorised torch passes (the CPU path).

The 8 coordinates of a pair of boxes are packed into one ``(2 boxes, 4, N)`` tensor so that every step of the
formula is a handful of large element-wise ops on ``(2, 2, N)`` or ``(2, N)`` blocks instead of ~60 tiny ops plus
the autograd graph of the reference. The same two functions can be handed to ``torch.compile`` (see
``ciou.py``), which fuses each of them into one loop.

Gradient conventions match torch autograd on the reference exactly: at ties ``minimum``/``maximum`` split the
gradient half/half, and the intersection's ``relu`` gives no gradient at exactly 0 (touching edges).

Reference: ultralytics/yolov5 v7.0 ``utils/metrics.py::bbox_iou(xywh=True, CIoU=True)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_V_SCALE = 4.0 / math.pi**2


def ciou_fwd(t: Tensor, eps: float, alpha: Tensor | None = None) -> tuple[Tensor, ...]:
    """Forward on packed boxes.

    Args:
        t: (2, 4, N) rows ``cx, cy, w, h`` of box1 (``t[0]``) and box2 (``t[1]``), float32 or float64.
        eps: the CIoU stabiliser.
        alpha: (N,) fixed alpha to use instead of computing it (lets tests gradcheck the backward, which treats
            alpha as a constant).

    Returns:
        ``(ciou (N,), *saved)``; ``saved`` is what :func:`ciou_bwd` needs.
    """
    ctr, wh = t[:, :2], t[:, 2:]  # (2 boxes, 2 axes, N)
    half = wh * 0.5
    lo, hi = ctr - half, ctr + half
    iwh_raw = torch.minimum(hi[0], hi[1]) - torch.maximum(lo[0], lo[1])  # (2 axes, N)
    iwh = iwh_raw.clamp(min=0)
    inter = iwh[0] * iwh[1]
    union = wh[0, 0] * wh[0, 1] + wh[1, 0] * wh[1, 1] - inter + eps
    iou = inter / union
    cwh = torch.maximum(hi[0], hi[1]) - torch.minimum(lo[0], lo[1])  # enclosing box (2 axes, N)
    c2 = (cwh * cwh).sum(0) + eps
    d = ctr[1] - ctr[0]  # centre offsets (2 axes, N)
    rho2 = (d * d).sum(0)
    hh = wh[:, 1] + eps  # (2 boxes, N)
    ang = torch.atan(wh[:, 0] / hh)
    dang = ang[1] - ang[0]
    v = _V_SCALE * dang * dang
    if alpha is None:  # a constant for autograd, as in YOLOv5 (no_grad); clamp: see reference.py
        alpha = v / (v - iou + (1 + eps)).clamp(min=eps)
    rc2 = 1.0 / c2
    ciou = iou - (rho2 * rc2 + alpha * v)
    return ciou, lo, hi, wh, iwh_raw, iwh, union, iou, cwh, rc2, rho2, d, hh, dang, alpha


def ciou_bwd(
    g: Tensor,
    lo: Tensor,
    hi: Tensor,
    wh: Tensor,
    iwh_raw: Tensor,
    iwh: Tensor,
    union: Tensor,
    iou: Tensor,
    cwh: Tensor,
    rc2: Tensor,
    rho2: Tensor,
    d: Tensor,
    hh: Tensor,
    dang: Tensor,
    alpha: Tensor,
) -> Tensor:
    """Analytic backward of :func:`ciou_fwd`.

    Args:
        g: (N,) upstream gradient of the CIoU.
        lo, hi, wh, iwh_raw, iwh, union, iou, cwh, rc2, rho2, d, hh, dang, alpha: saved by :func:`ciou_fwd`.

    Returns:
        (2, 4, N) gradient w.r.t. the packed ``cx, cy, w, h`` of box1 and box2.
    """
    # iou = inter / union with union = area1 + area2 - inter + eps.
    ru = 1.0 / union
    g_inter = g * (1.0 + iou) * ru
    g_union = -g * iou * ru  # -> areas
    g_iwh = (g_inter * iwh.flip(0)) * (iwh_raw > 0)  # (2 axes, N); relu: no gradient at 0
    g_cwh = (2.0 * g * rho2 * rc2 * rc2) * cwh  # from c2 = cw^2 + ch^2 + eps
    # Weights of box1 in min(hi0, hi1) and in max(lo0, lo1) (1, 0.5 at ties, 0); box2 gets the complement, and
    # in the enclosing box's max(hi)/min(lo) the roles swap.
    s = (torch.sign(hi[1] - hi[0]) + 1.0) * 0.5
    r = (torch.sign(lo[0] - lo[1]) + 1.0) * 0.5
    s_w = torch.stack((s, 1.0 - s))  # (2 boxes, 2 axes, N)
    r_w = torch.stack((r, 1.0 - r))
    g_hi = s_w * g_iwh + s_w.flip(0) * g_cwh
    g_lo = -(r_w * g_iwh + r_w.flip(0) * g_cwh)
    g_ctr = g_hi + g_lo
    g_wh = (g_hi - g_lo) * 0.5 + g_union * wh.flip(1)  # d(w*h)/dw = h, /dh = w
    # rho2 = |ctr2 - ctr1|^2.
    g_d = (-2.0 * g * rc2) * d
    g_ctr = g_ctr + torch.stack((-g_d, g_d))
    # v = K (atan(w2/hh2) - atan(w1/hh1))^2; d atan(w/hh)/dw = hh / (hh^2 + w^2), /dh = -w / (hh^2 + w^2).
    w = wh[:, 0]
    g_a = (2.0 * _V_SCALE) * g * alpha * dang  # dCIoU/d atan1 = +g_a, dCIoU/d atan2 = -g_a
    g_ang = torch.stack((g_a, -g_a)) / (hh * hh + w * w)  # (2 boxes, N)
    g_wh = g_wh + torch.stack((g_ang * hh, -g_ang * w), 1)
    return torch.cat((g_ctr, g_wh), 1)


def ciou_bwd_recompute(g: Tensor, t: Tensor, eps: float) -> Tensor:
    """Backward from the packed inputs alone (recomputes the forward; one fused loop under ``torch.compile``).

    Args:
        g: (N,) upstream gradient of the CIoU.
        t: (2, 4, N) packed boxes as given to :func:`ciou_fwd`.
        eps: the CIoU stabiliser.

    Returns:
        (2, 4, N) gradient w.r.t. ``t``.
    """
    return ciou_bwd(g, *ciou_fwd(t, eps)[1:])
