"""The device half of the device input path: batched tensor ops that make a training batch's pixels from what the
workers planned (:mod:`yolo5l.data.plan`), on the device the tensors live on (CUDA in training; the CPU in tests).

Each op reproduces the OpenCV call that ultralytics/yolov5 v7.0 makes for the same step, so that a sample's pixels
are those of the host path (`yolo5l.data.dataset`) within a grey level of rounding:

- :func:`decode_jpegs`: the JPEG decode, one batched call (nvjpeg on CUDA), as stored (the orientation follows).
- :func:`resize_tiles`: ``cv2.resize(..., INTER_LINEAR)`` of many images of different sizes at once, EXIF orientation
  folded into the reads; OpenCV's 8-bit arithmetic (11-bit fixed-point weights, its vector path's rounding).
- :func:`warp_layers`: the mosaic's (or the letterboxed image's) ``cv2.warpAffine`` / ``warpPerspective`` of the
  canvas into the output, bilinear, 114 outside, without building the canvas: each bilinear tap reads the tile that
  covers its canvas pixel, or 114 (OpenCV 4.11+'s float coordinates and weights). Flips reverse the output's rows
  or columns, as ``cv2.flip`` after the warp does.
- :func:`blend_mixup`: v7.0's ``mixup``, ``(im * r + im2 * (1 - r)).astype(uint8)`` in float32.
- :func:`albumentations`: v7.0's Blur, MedianBlur and ToGray (``cv2.blur``, ``cv2.medianBlur``,
  ``cv2.cvtColor(RGB2GRAY)``), equal to OpenCV's; CLAHE stays on the host.
- :func:`hsv_lut`: v7.0's ``augment_hsv``: OpenCV's 8-bit RGB -> HSV (its integer tables), the three lookup tables
  the worker computed from the sample's gains, and OpenCV's 8-bit HSV -> RGB (its vector path: float32, a fused
  multiply-add, truncation), equal to ``cv2.cvtColor`` on every 8-bit colour. (OpenCV converts the last
  ``width % 64`` pixels of a row (AVX-512; ``% 32`` with AVX2) with scalar code that rounds instead; v7.0's 640 px
  rows have none.)

:func:`compose` runs the last four for a whole batch. On CUDA the resize and the composition are one Triton kernel
each (``yolo5l_kernels._triton_input``, the same arithmetic step for step; ``backend="triton"``); the torch ops here
are the CPU's path and the kernels' oracle. Memory of the torch ops: chunks of at most ``max_pixels`` output pixels,
~``40 * max_pixels`` bytes above the batch; the kernels need none beyond their output.

Reference: OpenCV ``imgproc`` resize.cpp (``HResizeLinear``, ``VResizeLinearVec_32s8u``), warp_kernels.simd.hpp,
color_hsv.simd.hpp (``RGB2HSV_b``, ``HSV2RGB_b``) (behaviour).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "BACKENDS",
    "DEFAULT_MAX_PIXELS",
    "FILL",
    "albumentations",
    "blend_mixup",
    "box_blur",
    "compose",
    "decode_jpegs",
    "hsv_lut",
    "hsv_tables",
    "median_blur",
    "orient_hw",
    "resize_tiles",
    "to_grey",
    "warp_layers",
]

BACKENDS = ("auto", "torch", "triton")  # auto: the Triton kernels on CUDA, the torch ops elsewhere

FILL = 114
DEFAULT_MAX_PIXELS = 1 << 23  # output pixels a chunk of a warp, resize or HSV pass works on (~8.4 M: 20 at 640 px)
_COEF_BITS = 11  # OpenCV's INTER_RESIZE_COEF_BITS: 8-bit bilinear resize weights are multiples of 1/2048
_COEF_ONE = 1 << _COEF_BITS
_HSV_SHIFT = 12  # OpenCV's hsv_shift: the fixed point of its 8-bit RGB -> HSV tables
_HUE_RANGE = 180
_GREY_R, _GREY_G, _GREY_B, _GREY_SHIFT = 9798, 19235, 3735, 15  # OpenCV's 8-bit RGB -> grey: 0.299, 0.587, 0.114
_ROTATED = (5, 6, 7, 8)  # EXIF orientations that swap height and width


def _triton(backend: str, device: torch.device) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return False
        try:
            import triton  # noqa: F401
        except ImportError:  # a CUDA build without Triton: the torch ops
            return False
        return True
    return backend == "triton"


def decode_jpegs(data: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
    """Decode JPEGs to (3, H, W) uint8 RGB on ``device``, as stored (no EXIF orientation): one batched nvjpeg call on
    CUDA, libjpeg-turbo on the CPU.

    Args:
        data: 1-D uint8 CPU tensors of the files' bytes (baseline or extended JPEGs with 3 components, see
            :attr:`~yolo5l.data.jpeg_header.JpegHeader.gpu_decodable`).

    This is the one place yolo5l decodes on a device: torchvision's decoders are moving to TorchCodec, and a
    replacement goes here.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    if not data:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.2x: "use TorchCodec"; this is the seam
        return decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device)


def orient_hw(h: int, w: int, orientation: int) -> tuple[int, int]:
    """The (h, w) an image stored as (h, w) shows with EXIF ``orientation``."""
    return (w, h) if orientation in _ROTATED else (h, w)


def _stored_yx(yd: Tensor, xd: Tensor, hs: Tensor, ws: Tensor, orientation: Tensor) -> tuple[Tensor, Tensor]:
    """Stored (row, column) of the displayed pixel (``yd``, ``xd``) of an image stored as (hs, ws) with EXIF
    ``orientation`` (1-8, elementwise), as ``PIL.ImageOps.exif_transpose`` and OpenCV's ``imread`` display it."""
    o = orientation
    swap = (o >= 5) & (o <= 8)
    ys = torch.where(swap, xd, yd)  # 5 (transpose) reads stored[xd, yd]
    xs = torch.where(swap, yd, xd)
    flip_y = (o == 3) | (o == 4) | (o == 6) | (o == 7)  # rows read from the bottom
    flip_x = (o == 2) | (o == 3) | (o == 7) | (o == 8)  # columns read from the right
    ys = torch.where(flip_y, hs - 1 - ys, ys)
    xs = torch.where(flip_x, ws - 1 - xs, xs)
    return ys, xs


def _axis_coefs(dst: Tensor, n_src: Tensor, n_dst: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OpenCV's INTER_LINEAR source indices and 11-bit weights along one axis, elementwise: ``(i0, i1, a0, a1)`` for
    destination coordinates ``dst`` of an axis resized from ``n_src`` to ``n_dst``."""
    scale = 1.0 / (n_dst.double() / n_src.double())  # OpenCV: 1 / inv_scale, inv_scale = dsize / ssize (doubles)
    f = ((dst.double() + 0.5) * scale - 0.5).float()
    i0 = torch.floor(f)
    f = f - i0
    i0 = i0.long()
    low = i0 < 0
    high = i0 >= n_src - 1
    f = torch.where(low | high, torch.zeros_like(f), f)
    i0 = torch.where(low, torch.zeros_like(i0), torch.where(high, n_src - 1, i0))
    a0 = torch.round((1.0 - f) * _COEF_ONE).long()
    a1 = torch.round(f * _COEF_ONE).long()
    return i0, torch.minimum(i0 + 1, n_src - 1), a0, a1


def resize_tiles(
    src: Tensor,
    src_info: Tensor,
    out: Tensor,
    out_info: Tensor,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    sizes: Sequence[tuple[int, int]] | None = None,
    backend: str = "auto",
) -> None:
    """Resize many images of different sizes, bilinear as OpenCV's 8-bit ``INTER_LINEAR``, into ``out``.

    Args:
        src: flat uint8 buffer of the source images, each planar (3, hs, ws) as stored.
        src_info: (T, 4) int64 per image: offset in ``src``, hs, ws, EXIF orientation (applied while reading).
        out: flat uint8 buffer the results are written to, each (h, w, 3) interleaved.
        out_info: (T, 3) int64 per image: offset in ``out``, h, w (the displayed image's resized size).
        max_pixels: output pixels per chunk.
        sizes: the (h, w) of ``out_info`` as host numbers, when ``out_info`` is on a device (no read-back then).
        backend: one of :data:`BACKENDS`.
    """
    if sizes is None:
        sizes = out_info[:, 1:3].tolist()  # a host tensor's numbers; on a device, a read-back: pass `sizes`
    counts = [int(h) * int(w) for h, w in sizes]
    if _triton(backend, src.device):
        from yolo5l_kernels import _triton_input

        _triton_input.resize(src, src_info, out, out_info, max(counts, default=0))
        return
    start = 0
    while start < len(counts):
        stop, total = start, 0
        while stop < len(counts) and (stop == start or total + counts[stop] <= max_pixels):
            total += counts[stop]
            stop += 1
        _resize_chunk(src, src_info[start:stop], out, out_info[start:stop], total)
        start = stop


def _resize_chunk(src: Tensor, src_info: Tensor, out: Tensor, out_info: Tensor, total: int) -> None:
    device = src.device
    h, w = out_info[:, 1], out_info[:, 2]
    tile = torch.repeat_interleave(torch.arange(len(out_info), device=device), h * w, output_size=total)
    first = torch.cumsum(h * w, 0) - h * w
    j = torch.arange(total, device=device) - first[tile]
    wt, ht = w[tile], h[tile]
    y, x = j // wt, j % wt
    off, hs, ws, orient = (src_info[:, k][tile] for k in range(4))
    swap = (orient >= 5) & (orient <= 8)
    hd, wd = torch.where(swap, ws, hs), torch.where(swap, hs, ws)  # displayed size
    x0, x1, a0, a1 = _axis_coefs(x, wd, wt)
    y0, y1, b0, b1 = _axis_coefs(y, hd, ht)
    plane = hs * ws

    def row(yd: Tensor) -> Tensor:  # (N, 3) horizontal pass of the displayed row yd: int32 sums of weight x pixel
        acc = None
        for xd, a in ((x0, a0), (x1, a1)):
            ys, xs = _stored_yx(yd, xd, hs, ws, orient)
            base = off + ys * ws + xs
            px = src[base[:, None] + plane[:, None] * torch.arange(3, device=device)].long()
            acc = px * a[:, None] if acc is None else acc + px * a[:, None]
        return acc

    # OpenCV's vector path: (h >> 4) as int16, times the row weight, high 16 bits; the two rows summed, then
    # rounded by >> 2: ((h0 >> 4) * b0 >> 16) + ((h1 >> 4) * b1 >> 16), (v + 2) >> 2.
    v = (((row(y0) >> 4) * b0[:, None]) >> 16) + (((row(y1) >> 4) * b1[:, None]) >> 16)
    pix = ((v + 2) >> 2).clamp_(0, 255).to(torch.uint8)
    dst = out_info[:, 0][tile] + j * 3
    out[dst[:, None] + torch.arange(3, device=device)] = pix


def warp_layers(
    flat: Tensor,
    slots: Tensor,
    inv: Tensor,
    split: Tensor,
    flip: Tensor,
    size: tuple[int, int],
    perspective: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Tensor:
    """The warped canvases of L layers (a mosaic of 4 tiles, or one letterboxed image), (L, H, W, 3) uint8.

    Args:
        flat: flat uint8 buffer of the tiles' pixels, (h, w, 3) interleaved each.
        slots: (L, 4, 7) int64 per layer and canvas quadrant: [base, row stride, x1, y1, x2, y2, -]: a canvas pixel
            (X, Y) of the quadrant inside [x1, x2) x [y1, y2) is at ``flat[base + (Y * stride + X) * 3]``; outside
            it (or an empty quadrant, x1 = x2) it is 114.
        inv: (L, 3, 3) output -> canvas matrices (OpenCV's inverse of the warp; last row 0, 0, 1 when affine).
        split: (L, 2) the canvas point (xc, yc) where the quadrants meet: a pixel is in quadrant
            ``2 * (Y >= yc) + (X >= xc)`` (a letterbox layer puts its image in quadrant 3 with split (0, 0)).
        flip: (L, 2) bool (up-down, left-right) of the output.
        size: output (H, W).
        perspective: some matrix is a homography (the host knows it from the plan: no device read decides it).
    """
    height, width = size
    out = torch.empty((len(inv), height, width, 3), dtype=torch.uint8, device=flat.device)
    per = max(1, max_pixels // (height * width))
    for s in range(0, len(inv), per):
        e = min(s + per, len(inv))
        out[s:e] = _warp_chunk(flat, slots[s:e], inv[s:e], split[s:e], flip[s:e], height, width, perspective)
    return out


def _warp_chunk(
    flat: Tensor, slots: Tensor, inv: Tensor, split: Tensor, flip: Tensor, height: int, width: int, perspective: bool
) -> Tensor:
    device, n = flat.device, len(inv)
    xs = torch.arange(width, device=device, dtype=torch.float32)
    ys = torch.arange(height, device=device, dtype=torch.float32)
    xo = torch.where(flip[:, 1:2], width - 1 - xs, xs)[:, None, :]  # (n, 1, W): the output column read, flipped
    yo = torch.where(flip[:, 0:1], height - 1 - ys, ys)[:, :, None]  # (n, H, 1)
    m = inv.float()
    mm = [m[:, r, c][:, None, None] for r in range(3) for c in range(3)]
    # OpenCV 4.11+: float32 coordinates, m00 * x + (m01 * y + m02)
    sx = mm[0] * xo + (mm[1] * yo + mm[2])
    sy = mm[3] * xo + (mm[4] * yo + mm[5])
    if perspective:
        sw = mm[6] * xo + (mm[7] * yo + mm[8])
        sx, sy = sx / sw, sy / sw
    fx0, fy0 = torch.floor(sx), torch.floor(sy)
    fx, fy = (sx - fx0)[..., None], (sy - fy0)[..., None]
    x0, y0 = fx0.long(), fy0.long()
    table = slots.reshape(n * 4, 7)
    lq0 = (torch.arange(n, device=device) * 4)[:, None, None]
    xc, yc = split[:, 0, None, None], split[:, 1, None, None]
    chans = torch.arange(3, device=device)
    last = flat.numel() - 3

    def tap(dx: int, dy: int) -> Tensor:
        cx, cy = x0 + dx, y0 + dy  # the tap's canvas pixel
        q = lq0 + 2 * (cy >= yc).long() + (cx >= xc).long()
        base, stride, x1, y1, x2, y2 = (table[:, k][q] for k in range(6))
        inside = (cx >= x1) & (cx < x2) & (cy >= y1) & (cy < y2)
        idx = torch.where(inside, base + (cy * stride + cx) * 3, 0).clamp_(0, max(last, 0))
        px = flat[idx[..., None] + chans].float() if flat.numel() else torch.zeros((*idx.shape, 3), device=device)
        return torch.where(inside[..., None], px, float(FILL))

    top = tap(0, 0)
    top = top + fx * (tap(1, 0) - top)
    bottom = tap(0, 1)
    bottom = bottom + fx * (tap(1, 1) - bottom)
    return torch.round(top + fy * (bottom - top)).clamp_(0, 255).to(torch.uint8)


def blend_mixup(a: Tensor, b: Tensor, r: Tensor) -> Tensor:
    """v7.0's mixup of uint8 images (N, H, W, 3): ``(a * r + b * (1 - r)).astype(uint8)``, float32 arithmetic with
    ``r`` and ``1 - r`` (float64, (N,)) rounded to float32 as NumPy does for a Python float, then truncated."""
    r32 = r.float()[:, None, None, None]
    s32 = (1.0 - r).float()[:, None, None, None]
    return (a.float() * r32 + b.float() * s32).to(torch.uint8)


def _rgb_to_hsv(img: Tensor) -> Tensor:
    """OpenCV's 8-bit RGB -> HSV (H in 0-179), integer arithmetic with its division tables: (N, H, W, 3) int64."""
    sdiv, hdiv = _hsv_div_tables(img.device)
    p = img.long()
    r, g, b = p[..., 0], p[..., 1], p[..., 2]
    v = torch.maximum(torch.maximum(r, g), b)
    diff = v - torch.minimum(torch.minimum(r, g), b)
    half = 1 << (_HSV_SHIFT - 1)
    s = (diff * sdiv[v] + half) >> _HSV_SHIFT
    h = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * hdiv[diff] + half) >> _HSV_SHIFT
    h = torch.where(h < 0, h + _HUE_RANGE, h)
    return torch.stack((h, s, v), -1)


def _fnma(a: Tensor, b: Tensor) -> Tensor:
    """``1 - a * b`` rounded once, as a fused multiply-add: the float32 product is exact in float64."""
    return (1.0 - a.double() * b.double()).float()


def _hsv_to_rgb(hsv: Tensor) -> Tensor:
    """OpenCV's 8-bit HSV -> RGB, its vector path (float32, fused multiply-adds, truncation): (N, H, W, 3) uint8."""
    f = hsv.float()
    s = f[..., 1] * torch.tensor(1.0 / 255.0, dtype=torch.float32)
    v = f[..., 2] * torch.tensor(1.0 / 255.0, dtype=torch.float32)
    h = f[..., 0] * torch.tensor(6.0 / _HUE_RANGE, dtype=torch.float32)
    pre = torch.trunc(h)
    h = h - pre
    sector = pre - torch.trunc(pre * torch.tensor(1.0 / 6.0, dtype=torch.float32)) * 6
    t0, t1, t2, t3 = v, v * (1.0 - s), v * _fnma(s, h), v * _fnma(s, 1.0 - h)
    b = torch.where(sector < 2, t1, torch.where(sector == 2, t3, torch.where(sector <= 4, t0, t2)))
    g = torch.where(sector < 1, t3, torch.where(sector <= 2, t0, torch.where(sector == 3, t2, t1)))
    r = torch.where(
        sector < 1, t0, torch.where(sector == 1, t2, torch.where(sector <= 3, t1, torch.where(sector == 4, t3, t0)))
    )
    return torch.stack((r, g, b), -1).mul_(255.0).trunc_().clamp_(0, 255).to(torch.uint8)


def hsv_tables(gains: Tensor) -> Tensor:
    """v7.0's lookup tables of the HSV jitter for (N, 3) float64 gains: (N, 3, 256) uint8, ``floor(x * r)`` with the
    hue modulo 180 and S and V clipped to 255 (float64 as NumPy computes them in ``augment_hsv``; the hue through
    ``fmod``, which is NumPy's ``%`` on positive numbers)."""
    x = torch.arange(256, dtype=torch.float64, device=gains.device)
    scaled = x * gains[:, :, None]
    hue = torch.fmod(scaled[:, :1], float(_HUE_RANGE))
    return torch.cat((hue, scaled[:, 1:].clamp(0, 255)), 1).to(torch.uint8)


def hsv_lut(img: Tensor, luts: Tensor, max_pixels: int = DEFAULT_MAX_PIXELS) -> Tensor:
    """v7.0's HSV jitter of (N, H, W, 3) uint8 RGB images through per-image (N, 3, 256) uint8 lookup tables of H, S
    and V (the hue table's values below 180), as ``cv2.cvtColor`` -> ``cv2.LUT`` -> ``cv2.cvtColor``."""
    n, height, width, _ = img.shape
    out = torch.empty_like(img)
    per = max(1, max_pixels // max(1, height * width))
    for s in range(0, n, per):
        e = min(s + per, n)
        hsv = _rgb_to_hsv(img[s:e])
        base = (torch.arange(e - s, device=img.device) * 768)[:, None, None, None] + torch.arange(
            0, 768, 256, device=img.device
        )
        out[s:e] = _hsv_to_rgb(luts[s:e].reshape(-1)[base + hsv].long())
    return out


def to_grey(img: Tensor) -> Tensor:
    """albumentations' ToGray (``cv2.cvtColor(RGB2GRAY)``, repeated to 3 channels) of (N, H, W, 3) uint8: OpenCV's
    8-bit weights, 15-bit fixed point, equal on every colour."""
    p = img.long()
    grey = (p[..., 0] * _GREY_R + p[..., 1] * _GREY_G + p[..., 2] * _GREY_B + (1 << (_GREY_SHIFT - 1))) >> _GREY_SHIFT
    return grey.to(torch.uint8)[..., None].expand_as(img).contiguous()


def box_blur(img: Tensor, k: int) -> Tensor:
    """albumentations' Blur (``cv2.blur`` with a k x k box) of (N, H, W, 3) uint8: the window's sum / k^2 rounded
    half to even, the border reflected without its edge pixel (OpenCV's BORDER_REFLECT_101)."""
    x = torch.nn.functional.pad(img.permute(0, 3, 1, 2).float(), (k // 2,) * 4, mode="reflect")
    sums = torch.nn.functional.avg_pool2d(x, k, stride=1, divisor_override=1)  # exact: integers below 2^24
    return torch.round(sums.double() / (k * k)).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def median_blur(img: Tensor, k: int) -> Tensor:
    """albumentations' MedianBlur (``cv2.medianBlur``, k x k) of (N, H, W, 3) uint8: each channel's window median, the
    border replicated as OpenCV does."""
    x = torch.nn.functional.pad(img.permute(0, 3, 1, 2).float(), (k // 2,) * 4, mode="replicate").to(torch.uint8)
    windows = x.unfold(2, k, 1).unfold(3, k, 1)  # (N, 3, H, W, k, k)
    return windows.reshape(*windows.shape[:4], k * k).median(-1).values.permute(0, 2, 3, 1).contiguous()


def albumentations(img: Tensor, ops: Sequence[tuple[int, int, int]]) -> Tensor:
    """v7.0's albumentations of (N, H, W, 3) uint8 images, in its order (Blur, MedianBlur, ToGray), per image
    ``(blur kernel, median kernel, grey)`` as ``augment.Albumentations.device_ops`` draws them (0: not fired)."""
    out = []
    for k, (blur, median, grey) in enumerate(ops):
        x = img[k : k + 1]
        if blur:
            x = box_blur(x, blur)
        if median:
            x = median_blur(x, median)
        if grey:
            x = to_grey(x)
        out.append(x)
    return torch.cat(out) if out else img


_DIV_TABLES: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _hsv_div_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """OpenCV's 8-bit RGB -> HSV division tables (S, then H) on ``device``, made once."""
    if device not in _DIV_TABLES:
        i = torch.arange(256, dtype=torch.float64)
        safe = torch.where(i > 0, i, torch.ones_like(i))
        sdiv = torch.where(i > 0, torch.round((255 << _HSV_SHIFT) / safe), 0).long()
        hdiv = torch.where(i > 0, torch.round((_HUE_RANGE << _HSV_SHIFT) / (6 * safe)), 0).long()
        _DIV_TABLES[device] = (sdiv.to(device), hdiv.to(device))
    return _DIV_TABLES[device]


def compose(
    flat: Tensor,
    slots: Tensor,
    inv: Tensor,
    split: Tensor,
    flip: Tensor,
    layers: Sequence[int],
    mix: Tensor,
    hsv: Sequence[bool],
    luts: Tensor,
    out: Tensor,
    perspective: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    backend: str = "auto",
    albu: Sequence[tuple[int, int, int]] | None = None,
) -> None:
    """Make a batch's samples into ``out`` (B, H, W, 3) uint8: each sample's layers warped (:func:`warp_layers`),
    mixup's two layers blended (:func:`blend_mixup`), the HSV tables applied (:func:`hsv_lut`) and the flips.

    Args:
        flat, slots, inv, split: as :func:`warp_layers`'s, per sample and layer: (B, 2, 4, 7), (B, 2, 3, 3), (B, 2, 2).
        flip: (B, 2) bool, up-down and left-right.
        layers: per sample 0 (leave ``out``'s pixels alone: made elsewhere), 1, or 2 (mixup); host numbers.
        mix: (B,) float64 mixup ratios. hsv: per sample whether its tables apply (host). luts: (B, 3, 256) uint8.
        perspective: some matrix is a homography.
        backend: one of :data:`BACKENDS`.
        albu: per sample the albumentations ops (:func:`albumentations`), applied after mixup, before HSV.
    """
    device = out.device
    touched = [b for b in range(len(layers)) if layers[b] and albu is not None and any(albu[b])]
    if touched:  # the few samples albumentations touches: warped here, then blurred / greyed, then jittered
        untouched_hsv = [h and b not in touched for b, h in enumerate(hsv)]
        compose(flat, slots, inv, split, flip, layers, mix, untouched_hsv, luts, out, perspective, max_pixels, backend)
        at = torch.tensor(touched, device=device)
        imgs = albumentations(out[at], [albu[b] for b in touched])
        jitter = [k for k, b in enumerate(touched) if hsv[b]]
        if jitter:
            jk = torch.tensor(jitter, device=device)
            imgs[jk] = hsv_lut(imgs[jk], luts[at[jk]], max_pixels)
        out[at] = imgs
        return
    if _triton(backend, device):
        from yolo5l_kernels import _triton_input

        as_tensor = {"dtype": torch.int64, "device": device}
        _triton_input.compose(
            flat, slots, inv, split, flip, torch.tensor(list(layers), **as_tensor), mix,
            torch.tensor(list(hsv), dtype=torch.bool, device=device), luts, _hsv_div_tables(device), out, perspective,
        )  # fmt: skip
        return
    made = [b for b in range(len(layers)) if layers[b] > 0]
    if not made:
        return
    mixed = [b for b in made if layers[b] == 2]
    sel_b = torch.tensor(made + mixed, dtype=torch.int64, device=device)
    sel_k = torch.tensor([0] * len(made) + [1] * len(mixed), dtype=torch.int64, device=device)
    imgs = warp_layers(
        flat, slots[sel_b, sel_k], inv[sel_b, sel_k], split[sel_b, sel_k], flip[sel_b], tuple(out.shape[1:3]),
        perspective, max_pixels,
    )  # fmt: skip
    if mixed:
        pos = torch.tensor([made.index(b) for b in mixed], device=device)
        imgs[pos] = blend_mixup(imgs[pos], imgs[len(made) :], mix[torch.tensor(mixed, device=device)])
        imgs = imgs[: len(made)]
    jitter = [k for k, b in enumerate(made) if hsv[b]]
    if jitter:
        jk = torch.tensor(jitter, device=device)
        imgs[jk] = hsv_lut(imgs[jk], luts[torch.tensor([made[k] for k in jitter], device=device)], max_pixels)
    out[torch.tensor(made, device=device)] = imgs
