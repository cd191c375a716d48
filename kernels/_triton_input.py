"""Triton kernels of the device input path: a training batch's pixels in two launches.

- ``resize``: many images of different sizes resized at once, bilinear, with OpenCV's 8-bit ``INTER_LINEAR``
  arithmetic (11-bit weights, its vector path's shifts) and the EXIF orientation folded into the reads. One program
  makes ``BLOCK`` output pixels of one image.
- ``compose``: every output pixel of a sample in one pass: the warp of its layer (a mosaic of 4 quadrants or one
  letterboxed image; bilinear taps read from the tile covering each canvas pixel, 114 elsewhere), the second layer
  and mixup's blend, v7.0's HSV jitter (OpenCV's 8-bit RGB -> HSV, the sample's lookup tables, its HSV -> RGB) and
  the flips. One program makes ``BLOCK`` pixels of one sample.

Both compute exactly what the torch ops of ``yolo5l.data.render`` compute (the same float32 / float64 / integer
steps; fused multiply-adds off, float64 where OpenCV fuses), which is what the tests compare them with, on CUDA and
under ``TRITON_INTERPRET=1``.

Reference: OpenCV ``imgproc`` resize.cpp, warp_kernels.simd.hpp, color_hsv.simd.hpp (behaviour).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024
_FILL = 114.0


@triton.jit
def _rint(v):
    """Round half to even (``torch.round``, OpenCV's ``cvRound``), float in, float out."""
    r = tl.floor(v)
    d = v - r
    up = (d > 0.5) | ((d == 0.5) & ((r.to(tl.int64) & 1) == 1))
    return r + up.to(v.dtype)


@triton.jit
def _axis(dst, n_src, n_dst):
    """OpenCV's INTER_LINEAR source indices and 11-bit weights along one axis (``render._axis_coefs``)."""
    scale = 1.0 / (n_dst.to(tl.float64) / n_src.to(tl.float64))
    f = ((dst.to(tl.float64) + 0.5) * scale - 0.5).to(tl.float32)
    i0f = tl.floor(f)
    f = f - i0f
    i0 = i0f.to(tl.int64)
    low = i0 < 0
    high = i0 >= n_src - 1
    f = tl.where(low | high, 0.0, f)
    i0 = tl.where(low, 0, tl.where(high, n_src - 1, i0))
    a0 = _rint((1.0 - f) * 2048.0).to(tl.int64)
    a1 = _rint(f * 2048.0).to(tl.int64)
    return i0, tl.minimum(i0 + 1, n_src - 1), a0, a1


@triton.jit
def _row(src_ptr, off, plane, hs, ws, orient, yd, x0, x1, a0, a1, c, m):
    """Horizontal pass of displayed row ``yd``, channel ``c``: int sums of weight x stored pixel."""
    swap = (orient >= 5) & (orient <= 8)
    flip_y = (orient == 3) | (orient == 4) | (orient == 6) | (orient == 7)
    flip_x = (orient == 2) | (orient == 3) | (orient == 7) | (orient == 8)
    acc = tl.zeros_like(x0)
    for k in tl.static_range(2):
        xd = x0 if k == 0 else x1
        a = a0 if k == 0 else a1
        ys = tl.where(swap, xd, yd)
        xs = tl.where(swap, yd, xd)
        ys = tl.where(flip_y, hs - 1 - ys, ys)
        xs = tl.where(flip_x, ws - 1 - xs, xs)
        px = tl.load(src_ptr + off + c * plane + ys * ws + xs, mask=m, other=0).to(tl.int64)
        acc += px * a
    return acc


@triton.jit
def _resize_kernel(src_ptr, src_info_ptr, out_ptr, out_info_ptr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    off = tl.load(src_info_ptr + t * 4)
    hs = tl.load(src_info_ptr + t * 4 + 1)
    ws = tl.load(src_info_ptr + t * 4 + 2)
    orient = tl.load(src_info_ptr + t * 4 + 3)
    dst = tl.load(out_info_ptr + t * 3)
    h = tl.load(out_info_ptr + t * 3 + 1)
    w = tl.load(out_info_ptr + t * 3 + 2)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < h * w
    y = j // w
    x = j % w
    swap = (orient >= 5) & (orient <= 8)
    hd = tl.where(swap, ws, hs)
    wd = tl.where(swap, hs, ws)
    x0, x1, a0, a1 = _axis(x, wd, w)
    y0, y1, b0, b1 = _axis(y, hd, h)
    plane = hs * ws
    for c in tl.static_range(3):
        r0 = _row(src_ptr, off, plane, hs, ws, orient, y0, x0, x1, a0, a1, c, m)
        r1 = _row(src_ptr, off, plane, hs, ws, orient, y1, x0, x1, a0, a1, c, m)
        v = (((r0 >> 4) * b0) >> 16) + (((r1 >> 4) * b1) >> 16)
        pix = tl.minimum(tl.maximum((v + 2) >> 2, 0), 255)
        tl.store(out_ptr + dst + j * 3 + c, pix.to(tl.uint8), mask=m)


def resize(src: Tensor, src_info: Tensor, out: Tensor, out_info: Tensor, max_hw: int) -> None:
    """``yolo5l.data.render.resize_tiles`` in one launch; ``max_hw``: the largest output h * w (a host number)."""
    if len(src_info) and max_hw:
        grid = (len(src_info), triton.cdiv(max_hw, _BLOCK))
        _resize_kernel[grid](src, src_info, out, out_info, BLOCK=_BLOCK, enable_fp_fusion=False)


@triton.jit
def _tap(flat_ptr, slot_ptr, xc, yc, cx, cy, c, m):
    """The canvas pixel (cx, cy), channel c, of a layer (its 4 quadrants' rows at slot_ptr): float32, 114 outside."""
    q = 2 * (cy >= yc).to(tl.int64) + (cx >= xc).to(tl.int64)
    row = slot_ptr + q * 7
    base = tl.load(row, mask=m, other=0)
    stride = tl.load(row + 1, mask=m, other=0)
    x1 = tl.load(row + 2, mask=m, other=0)
    y1 = tl.load(row + 3, mask=m, other=0)
    x2 = tl.load(row + 4, mask=m, other=0)
    y2 = tl.load(row + 5, mask=m, other=0)
    inside = m & (cx >= x1) & (cx < x2) & (cy >= y1) & (cy < y2)
    idx = tl.where(inside, base + (cy * stride + cx) * 3 + c, 0)
    return tl.load(flat_ptr + idx, mask=inside, other=114).to(tl.float32)


@triton.jit
def _layer(flat_ptr, slot_ptr, inv_ptr, split_ptr, xo, yo, m, PERSPECTIVE: tl.constexpr):
    """One layer's warped pixel at output position (xo, yo) (flips applied): 3 float32 channels in 0..255."""
    m00 = tl.load(inv_ptr)
    m01 = tl.load(inv_ptr + 1)
    m02 = tl.load(inv_ptr + 2)
    m10 = tl.load(inv_ptr + 3)
    m11 = tl.load(inv_ptr + 4)
    m12 = tl.load(inv_ptr + 5)
    sx = m00 * xo + (m01 * yo + m02)
    sy = m10 * xo + (m11 * yo + m12)
    if PERSPECTIVE:
        sw = tl.load(inv_ptr + 6) * xo + (tl.load(inv_ptr + 7) * yo + tl.load(inv_ptr + 8))
        sx = sx / sw
        sy = sy / sw
    fx0 = tl.floor(sx)
    fy0 = tl.floor(sy)
    fx = sx - fx0
    fy = sy - fy0
    x0 = fx0.to(tl.int64)
    y0 = fy0.to(tl.int64)
    xc = tl.load(split_ptr)
    yc = tl.load(split_ptr + 1)
    out0 = tl.zeros_like(fx)
    out1 = tl.zeros_like(fx)
    out2 = tl.zeros_like(fx)
    for c in tl.static_range(3):
        p00 = _tap(flat_ptr, slot_ptr, xc, yc, x0, y0, c, m)
        p01 = _tap(flat_ptr, slot_ptr, xc, yc, x0 + 1, y0, c, m)
        p10 = _tap(flat_ptr, slot_ptr, xc, yc, x0, y0 + 1, c, m)
        p11 = _tap(flat_ptr, slot_ptr, xc, yc, x0 + 1, y0 + 1, c, m)
        top = p00 + fx * (p01 - p00)
        bottom = p10 + fx * (p11 - p10)
        v = tl.minimum(tl.maximum(_rint(top + fy * (bottom - top)), 0.0), 255.0)
        if c == 0:
            out0 = v
        elif c == 1:
            out1 = v
        else:
            out2 = v
    return out0, out1, out2


@triton.jit
def _fnma(a, b):
    """1 - a * b rounded once (OpenCV's fused multiply-add), through float64 as ``render._fnma``."""
    return (1.0 - a.to(tl.float64) * b.to(tl.float64)).to(tl.float32)


@triton.jit
def _compose_kernel(
    flat_ptr, slots_ptr, inv_ptr, split_ptr, flip_ptr, layers_ptr, r_ptr, s_ptr, hsv_ptr, luts_ptr,
    sdiv_ptr, hdiv_ptr, out_ptr, H, W, PERSPECTIVE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n_layers = tl.load(layers_ptr + b)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (j < H * W) & (n_layers > 0)
    y = j // W
    x = j % W
    flip_ud = tl.load(flip_ptr + b * 2)
    flip_lr = tl.load(flip_ptr + b * 2 + 1)
    xo = tl.where(flip_lr != 0, W - 1 - x, x).to(tl.float32)
    yo = tl.where(flip_ud != 0, H - 1 - y, y).to(tl.float32)
    first = b * 2
    r, g, bl = _layer(flat_ptr, slots_ptr + first * 28, inv_ptr + first * 9, split_ptr + first * 2, xo, yo, m,
                      PERSPECTIVE)  # fmt: skip
    if n_layers == 2:  # mixup: (a * r + b * (1 - r)).astype(uint8)
        r2, g2, b2 = _layer(flat_ptr, slots_ptr + (first + 1) * 28, inv_ptr + (first + 1) * 9,
                            split_ptr + (first + 1) * 2, xo, yo, m, PERSPECTIVE)  # fmt: skip
        ra = tl.load(r_ptr + b)
        sa = tl.load(s_ptr + b)
        r = (r * ra + r2 * sa).to(tl.int32).to(tl.float32)
        g = (g * ra + g2 * sa).to(tl.int32).to(tl.float32)
        bl = (bl * ra + b2 * sa).to(tl.int32).to(tl.float32)
    if tl.load(hsv_ptr + b) != 0:
        ri = r.to(tl.int64)
        gi = g.to(tl.int64)
        bi = bl.to(tl.int64)
        v = tl.maximum(tl.maximum(ri, gi), bi)
        diff = v - tl.minimum(tl.minimum(ri, gi), bi)
        s = (diff * tl.load(sdiv_ptr + v, mask=m, other=0) + 2048) >> 12
        h = tl.where(v == ri, gi - bi, tl.where(v == gi, bi - ri + 2 * diff, ri - gi + 4 * diff))
        h = (h * tl.load(hdiv_ptr + diff, mask=m, other=0) + 2048) >> 12
        h = tl.where(h < 0, h + 180, h)
        lut = luts_ptr + b * 768
        hf = tl.load(lut + h, mask=m, other=0).to(tl.float32)
        sf = tl.load(lut + 256 + s, mask=m, other=0).to(tl.float32) * (1.0 / 255.0)
        vf = tl.load(lut + 512 + v, mask=m, other=0).to(tl.float32) * (1.0 / 255.0)
        hx = hf * (6.0 / 180.0)
        pre = hx.to(tl.int32).to(tl.float32)  # trunc (hx >= 0)
        hx = hx - pre
        sector = pre - (pre * (1.0 / 6.0)).to(tl.int32).to(tl.float32) * 6.0
        t0 = vf
        t1 = vf * (1.0 - sf)
        t2 = vf * _fnma(sf, hx)
        t3 = vf * _fnma(sf, 1.0 - hx)
        bl = tl.where(sector < 2, t1, tl.where(sector == 2, t3, tl.where(sector <= 4, t0, t2)))
        g = tl.where(sector < 1, t3, tl.where(sector <= 2, t0, tl.where(sector == 3, t2, t1)))
        r = tl.where(
            sector < 1, t0, tl.where(sector == 1, t2, tl.where(sector <= 3, t1, tl.where(sector == 4, t3, t0)))
        )
        r = tl.minimum(tl.maximum((r * 255.0).to(tl.int32), 0), 255).to(tl.float32)
        g = tl.minimum(tl.maximum((g * 255.0).to(tl.int32), 0), 255).to(tl.float32)
        bl = tl.minimum(tl.maximum((bl * 255.0).to(tl.int32), 0), 255).to(tl.float32)
    dst = out_ptr + (b * H * W + j) * 3
    tl.store(dst, r.to(tl.uint8), mask=m)
    tl.store(dst + 1, g.to(tl.uint8), mask=m)
    tl.store(dst + 2, bl.to(tl.uint8), mask=m)


def compose(
    flat: Tensor,
    slots: Tensor,
    inv: Tensor,
    split: Tensor,
    flip: Tensor,
    layers: Tensor,
    mix: Tensor,
    hsv: Tensor,
    luts: Tensor,
    tables: tuple[Tensor, Tensor],
    out: Tensor,
    perspective: bool,
) -> None:
    """``yolo5l.data.render.compose`` in one launch: writes the samples with ``layers`` > 0 into ``out``."""
    n, height, width, _ = out.shape
    if not n or flat.numel() == 0:
        return
    r32 = mix.float()
    s32 = (1.0 - mix).float()
    grid = (n, triton.cdiv(height * width, _BLOCK))
    _compose_kernel[grid](
        flat, slots.contiguous(), inv.float().contiguous(), split.contiguous(), flip.to(torch.int8).contiguous(),
        layers.contiguous(), r32, s32, hsv.to(torch.int8).contiguous(), luts.contiguous(), *tables, out,
        height, width, PERSPECTIVE=perspective, BLOCK=_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
