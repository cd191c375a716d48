"""Triton forward/backward kernels for element-wise CIoU of ``[cx, cy, w, h]`` boxes.

This module imports ``triton`` at its top; ``ciou.py`` imports *this module* only inside the Triton backend, so
CPU-only installs import ``yolo5l_kernels`` cleanly. The kernels also run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), which is how they are tested without a GPU; that is
why the arctangent is written in plain Triton arithmetic (``libdevice.atan`` has no interpreter implementation).

The backward recomputes the forward in registers from the 8 input coordinates instead of saving intermediates:
reading 32 bytes per pair is cheaper than storing and reloading a dozen temporaries.

Reference: ultralytics/yolov5 v7.0 ``utils/metrics.py::bbox_iou(xywh=True, CIoU=True)``; the atan polynomial is
the Cephes ``atanf`` minimax fit (range reduction at tan(pi/8) and tan(3pi/8)), accurate to ~1e-7 in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _atan(x):
    # Cephes atanf: reduce |x| to [0, tan(pi/8)], then an odd degree-9 minimax polynomial.
    ax = tl.abs(x)
    big = ax > 2.414213562373095
    mid = ax > 0.4142135623730950
    xr = tl.where(big, -1.0 / tl.where(big, ax, 1.0), tl.where(mid, (ax - 1.0) / (ax + 1.0), ax))
    y0 = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = xr * xr
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * xr
    r = y0 + (p + xr)
    return tl.where(x < 0, -r, r)


@triton.jit
def _min_w(a, b):
    # Weight of `a` in min(a, b) under torch autograd: 1 if a < b, 0.5 at ties, 0 otherwise.
    return tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0))


@triton.jit
def _load_xywh(ptr, offs, m):
    # (N, 4) cx,cy,w,h rows in fp32; masked lanes get a harmless unit box (no division by zero).
    x = tl.load(ptr + offs * 4 + 0, mask=m, other=0.0).to(tl.float32)
    y = tl.load(ptr + offs * 4 + 1, mask=m, other=0.0).to(tl.float32)
    w = tl.load(ptr + offs * 4 + 2, mask=m, other=1.0).to(tl.float32)
    h = tl.load(ptr + offs * 4 + 3, mask=m, other=1.0).to(tl.float32)
    return x, y, w, h


@triton.jit
def _ciou_fwd_kernel(b1_ptr, b2_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x1, y1, w1, h1 = _load_xywh(b1_ptr, offs, m)
    x2, y2, w2, h2 = _load_xywh(b2_ptr, offs, m)
    lx1, hx1, ly1, hy1 = x1 - w1 * 0.5, x1 + w1 * 0.5, y1 - h1 * 0.5, y1 + h1 * 0.5
    lx2, hx2, ly2, hy2 = x2 - w2 * 0.5, x2 + w2 * 0.5, y2 - h2 * 0.5, y2 + h2 * 0.5
    iw = tl.maximum(tl.minimum(hx1, hx2) - tl.maximum(lx1, lx2), 0.0)
    ih = tl.maximum(tl.minimum(hy1, hy2) - tl.maximum(ly1, ly2), 0.0)
    inter = iw * ih
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = tl.maximum(hx1, hx2) - tl.minimum(lx1, lx2)
    ch = tl.maximum(hy1, hy2) - tl.minimum(ly1, ly2)
    c2 = cw * cw + ch * ch + eps
    dx, dy = x2 - x1, y2 - y1
    rho2 = dx * dx + dy * dy
    dang = _atan(w2 / (h2 + eps)) - _atan(w1 / (h1 + eps))
    v = 0.4052847345693511 * dang * dang
    alpha = v / tl.maximum(v - iou + (1.0 + eps), eps)
    ciou = iou - (rho2 / c2 + alpha * v)
    tl.store(out_ptr + offs, ciou.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ciou_bwd_kernel(b1_ptr, b2_ptr, g_ptr, g1_ptr, g2_ptr, n, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x1, y1, w1, h1 = _load_xywh(b1_ptr, offs, m)
    x2, y2, w2, h2 = _load_xywh(b2_ptr, offs, m)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # Forward, recomputed.
    lx1, hx1, ly1, hy1 = x1 - w1 * 0.5, x1 + w1 * 0.5, y1 - h1 * 0.5, y1 + h1 * 0.5
    lx2, hx2, ly2, hy2 = x2 - w2 * 0.5, x2 + w2 * 0.5, y2 - h2 * 0.5, y2 + h2 * 0.5
    iw_raw = tl.minimum(hx1, hx2) - tl.maximum(lx1, lx2)
    ih_raw = tl.minimum(hy1, hy2) - tl.maximum(ly1, ly2)
    iw = tl.maximum(iw_raw, 0.0)
    ih = tl.maximum(ih_raw, 0.0)
    inter = iw * ih
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = tl.maximum(hx1, hx2) - tl.minimum(lx1, lx2)
    ch = tl.maximum(hy1, hy2) - tl.minimum(ly1, ly2)
    rc2 = 1.0 / (cw * cw + ch * ch + eps)
    dx, dy = x2 - x1, y2 - y1
    rho2 = dx * dx + dy * dy
    hh1, hh2 = h1 + eps, h2 + eps
    dang = _atan(w2 / hh2) - _atan(w1 / hh1)
    v = 0.4052847345693511 * dang * dang
    alpha = v / tl.maximum(v - iou + (1.0 + eps), eps)
    # Backward.
    ru = 1.0 / union
    g_inter = g * (1.0 + iou) * ru
    g_union = -g * iou * ru
    g_iw = tl.where(iw_raw > 0, g_inter * ih, 0.0)  # the reference's relu: no gradient at 0 (touching edges)
    g_ih = tl.where(ih_raw > 0, g_inter * iw, 0.0)
    g_c = 2.0 * g * rho2 * rc2 * rc2
    g_cw = g_c * cw
    g_ch = g_c * ch
    sx = _min_w(hx1, hx2)  # box1's weight in min(hx); in max(hx) it is 1 - sx
    sy = _min_w(hy1, hy2)
    rx = _min_w(lx2, lx1)  # box1's weight in max(lx); in min(lx) it is 1 - rx
    ry = _min_w(ly2, ly1)
    g_hx1 = sx * g_iw + (1.0 - sx) * g_cw
    g_hx2 = (1.0 - sx) * g_iw + sx * g_cw
    g_hy1 = sy * g_ih + (1.0 - sy) * g_ch
    g_hy2 = (1.0 - sy) * g_ih + sy * g_ch
    g_lx1 = -(rx * g_iw + (1.0 - rx) * g_cw)
    g_lx2 = -((1.0 - rx) * g_iw + rx * g_cw)
    g_ly1 = -(ry * g_ih + (1.0 - ry) * g_ch)
    g_ly2 = -((1.0 - ry) * g_ih + ry * g_ch)
    g_rho = -2.0 * g * rc2
    g_a = 0.8105694691387022 * g * alpha * dang  # 2 * 4/pi^2
    ga1 = g_a / (hh1 * hh1 + w1 * w1)
    ga2 = -g_a / (hh2 * hh2 + w2 * w2)
    gx1 = g_hx1 + g_lx1 - g_rho * dx
    gy1 = g_hy1 + g_ly1 - g_rho * dy
    gw1 = (g_hx1 - g_lx1) * 0.5 + g_union * h1 + ga1 * hh1
    gh1 = (g_hy1 - g_ly1) * 0.5 + g_union * w1 - ga1 * w1
    gx2 = g_hx2 + g_lx2 + g_rho * dx
    gy2 = g_hy2 + g_ly2 + g_rho * dy
    gw2 = (g_hx2 - g_lx2) * 0.5 + g_union * h2 + ga2 * hh2
    gh2 = (g_hy2 - g_ly2) * 0.5 + g_union * w2 - ga2 * w2
    ty = g1_ptr.dtype.element_ty
    tl.store(g1_ptr + offs * 4 + 0, gx1.to(ty), mask=m)
    tl.store(g1_ptr + offs * 4 + 1, gy1.to(ty), mask=m)
    tl.store(g1_ptr + offs * 4 + 2, gw1.to(ty), mask=m)
    tl.store(g1_ptr + offs * 4 + 3, gh1.to(ty), mask=m)
    tl.store(g2_ptr + offs * 4 + 0, gx2.to(ty), mask=m)
    tl.store(g2_ptr + offs * 4 + 1, gy2.to(ty), mask=m)
    tl.store(g2_ptr + offs * 4 + 2, gw2.to(ty), mask=m)
    tl.store(g2_ptr + offs * 4 + 3, gh2.to(ty), mask=m)


def ciou_fwd(box1: Tensor, box2: Tensor, eps: float) -> Tensor:
    """CIoU of contiguous (N, 4) boxes of one dtype (fp16/bf16/fp32); computed in fp32, returned in that dtype."""
    n = box1.shape[0]
    out = torch.empty(n, dtype=box1.dtype, device=box1.device)
    if n:  # a grid of 0 programs is not a valid launch
        _ciou_fwd_kernel[(-(-n // _BLOCK),)](box1, box2, out, n, eps, BLOCK=_BLOCK)
    return out


def ciou_bwd(box1: Tensor, box2: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Gradients of ``sum(grad * ciou)`` w.r.t. both (N, 4) boxes, in the boxes' dtype."""
    n = box1.shape[0]
    g1 = torch.empty_like(box1)
    g2 = torch.empty_like(box2)
    if n:
        _ciou_bwd_kernel[(-(-n // _BLOCK),)](box1, box2, grad.contiguous(), g1, g2, n, eps, BLOCK=_BLOCK)
    return g1, g2
