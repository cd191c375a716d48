"""Triton forward/backward kernels for nearest-neighbour 2x upsampling of (N, C, H, W) tensors.

One program handles ``BLOCK`` *input* elements in logical NCHW order and addresses memory through explicit
strides, so contiguous and channels_last tensors take the same kernel. The forward writes each input value to
its 2x2 output block; the backward sums that block back in fp32 (one writer per input element: no atomics, the
OneFlow "loop over dx" scheme). Imported only by the Triton backend of ``upsample.py``; also runs under
``TRITON_INTERPRET=1``.

Reference: OneFlow PRs 9415/9424 (UpsampleNearest2D x2 specialisation); ``F.interpolate(mode="nearest")``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _up2x_kernel(
    src_ptr,
    dst_ptr,
    total,
    C,
    H,
    W,
    s_n,
    s_c,
    s_h,
    s_w,
    d_n,
    d_c,
    d_h,
    d_w,
    BACKWARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    w = offs % W
    h = (offs // W) % H
    c = (offs // (W * H)) % C
    n = offs // (W * H * C)
    if BACKWARD:
        # src: grad of the (2H, 2W) output; dst: grad of the (H, W) input.
        base = src_ptr + n * s_n + c * s_c + (2 * h) * s_h + (2 * w) * s_w
        acc = tl.load(base, mask=m, other=0.0).to(tl.float32)
        acc += tl.load(base + s_w, mask=m, other=0.0).to(tl.float32)
        acc += tl.load(base + s_h, mask=m, other=0.0).to(tl.float32)
        acc += tl.load(base + s_h + s_w, mask=m, other=0.0).to(tl.float32)
        tl.store(dst_ptr + n * d_n + c * d_c + h * d_h + w * d_w, acc.to(dst_ptr.dtype.element_ty), mask=m)
    else:
        val = tl.load(src_ptr + n * s_n + c * s_c + h * s_h + w * s_w, mask=m)
        base = dst_ptr + n * d_n + c * d_c + (2 * h) * d_h + (2 * w) * d_w
        tl.store(base, val, mask=m)
        tl.store(base + d_w, val, mask=m)
        tl.store(base + d_h, val, mask=m)
        tl.store(base + d_h + d_w, val, mask=m)


def _launch(src: Tensor, dst: Tensor, small: Tensor, backward: bool) -> None:
    n, c, h, w = small.shape
    total = n * c * h * w
    if total:  # a grid of 0 programs is not a valid launch
        _up2x_kernel[(triton.cdiv(total, _BLOCK),)](
            src, dst, total, c, h, w, *src.stride(), *dst.stride(), BACKWARD=backward, BLOCK=_BLOCK
        )


def up2x_fwd(x: Tensor, memory_format: torch.memory_format) -> Tensor:
    """(N, C, H, W) -> (N, C, 2H, 2W) in ``memory_format``."""
    n, c, h, w = x.shape
    out = torch.empty((n, c, 2 * h, 2 * w), dtype=x.dtype, device=x.device, memory_format=memory_format)
    _launch(x, out, x, backward=False)
    return out


def up2x_bwd(grad: Tensor, memory_format: torch.memory_format) -> Tensor:
    """(N, C, 2H, 2W) gradient -> (N, C, H, W) sums of each 2x2 block, in ``memory_format``."""
    n, c, h2, w2 = grad.shape
    gx = torch.empty((n, c, h2 // 2, w2 // 2), dtype=grad.dtype, device=grad.device, memory_format=memory_format)
    _launch(grad, gx, gx, backward=True)
    return gx
