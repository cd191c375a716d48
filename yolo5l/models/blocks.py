"""The other building blocks a YOLOv5 v7.0 model yaml may name (ghost, transformer, CSP and v5-era variants).

The released detectors (``yolov5{n,s,m,l,x}`` and their P6 versions) need only :mod:`yolo5l.models.common`; these
blocks let :mod:`yolo5l.models.parse` build the other architectures v7.0's ``models/*.yaml`` and ``models/hub/*.yaml``
describe. Attribute names equal ultralytics' so that the state-dict keys of a model built from them match an
ultralytics checkpoint of the same yaml.

Reference: ultralytics/yolov5 v7.0 ``models/common.py`` (``Focus``, ``SPP``, ``BottleneckCSP``, ``CrossConv``,
``C3x``, ``C3TR``, ``C3SPP``, ``C3Ghost``, ``GhostConv``, ``GhostBottleneck``, ``DWConv``, ``DWConvTranspose2d``,
``Contract``, ``Expand``, ``TransformerLayer``, ``TransformerBlock``) and ``models/experimental.py::MixConv2d``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from yolo5l.models.common import BN_EPS, BN_MOMENTUM, C3, Bottleneck, Conv

__all__ = [
    "C3SPP",
    "C3TR",
    "SPP",
    "BottleneckCSP",
    "C3Ghost",
    "C3x",
    "Contract",
    "CrossConv",
    "DWConv",
    "DWConvTranspose2d",
    "Expand",
    "Focus",
    "GhostBottleneck",
    "GhostConv",
    "MixConv2d",
    "TransformerBlock",
    "TransformerLayer",
]


class DWConv(Conv):
    """Depth-wise :class:`Conv`: groups = gcd(c1, c2).

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel size.
        s: Stride.
        d: Dilation.
        act: As :class:`Conv`.
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, d: int = 1, act: bool | nn.Module = True) -> None:
        super().__init__(c1, c2, k, s, g=math.gcd(c1, c2), d=d, act=act)


class DWConvTranspose2d(nn.ConvTranspose2d):
    """Depth-wise transposed convolution (groups = gcd(c1, c2), with bias).

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel size.
        s: Stride.
        p1: Padding.
        p2: Output padding.
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p1: int = 0, p2: int = 0) -> None:
        super().__init__(c1, c2, k, s, p1, p2, groups=math.gcd(c1, c2))


class Focus(nn.Module):
    """Space-to-depth stem of YOLOv5 up to v5.0: the four pixel phases stacked on channels, then a :class:`Conv`.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel size.
        s: Stride.
        p: Padding.
        g: Groups.
        act: As :class:`Conv`.
    """

    def __init__(
        self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None, g: int = 1, act: bool | nn.Module = True
    ) -> None:
        super().__init__()
        self.conv = Conv(c1 * 4, c2, k, s, p, g, act=act)

    def forward(self, x: Tensor) -> Tensor:
        # (B, C, H, W) -> (B, 4C, H/2, W/2); phase order (even, even), (odd row, even col), (even, odd), (odd, odd).
        phases = (x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2])
        return self.conv(torch.cat(phases, 1))


class SPP(nn.Module):
    """Spatial pyramid pooling: parallel max-pools of sizes ``k`` concatenated with their input.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Pool kernel sizes.
    """

    def __init__(self, c1: int, c2: int, k: Sequence[int] = (5, 9, 13)) -> None:
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * (len(k) + 1), c2, 1, 1)
        self.m = nn.ModuleList(nn.MaxPool2d(kernel_size=x, stride=1, padding=x // 2) for x in k)

    def forward(self, x: Tensor) -> Tensor:
        x = self.cv1(x)
        return self.cv2(torch.cat([x, *(m(x) for m in self.m)], 1))


class BottleneckCSP(nn.Module):
    """The CSP bottleneck of YOLOv5 up to v5.0 (4 convolutions, a BatchNorm + SiLU on the concatenation).

    Args:
        c1: Input channels.
        c2: Output channels.
        n: Number of bottlenecks.
        shortcut: Residual adds inside the bottlenecks.
        g: Groups.
        e: Hidden channel ratio.
    """

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = nn.Conv2d(c1, c_, 1, 1, bias=False)
        self.cv3 = nn.Conv2d(c_, c_, 1, 1, bias=False)
        self.cv4 = Conv(2 * c_, c2, 1, 1)
        self.bn = nn.BatchNorm2d(2 * c_, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.act = nn.SiLU()
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.cat((self.cv3(self.m(self.cv1(x))), self.cv2(x)), 1)
        return self.cv4(self.act(self.bn(y)))


class CrossConv(nn.Module):
    """A (1, k) then a (k, 1) :class:`Conv`, with a residual add when ``shortcut`` and ``c1 == c2``.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel length.
        s: Stride.
        g: Groups of the second conv.
        e: Hidden channel ratio.
        shortcut: Allow the residual add.
    """

    def __init__(
        self, c1: int, c2: int, k: int = 3, s: int = 1, g: int = 1, e: float = 1.0, shortcut: bool = False
    ) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, (1, k), (1, s))
        self.cv2 = Conv(c_, c2, (k, 1), (s, 1), g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class _C3Variant(C3):
    """A :class:`C3` whose inner block ``m`` is built by :meth:`inner` instead of plain bottlenecks."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        nn.Module.__init__(self)
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = self.inner(c_, n, shortcut, g)

    def inner(self, c: int, n: int, shortcut: bool, g: int) -> nn.Module:
        raise NotImplementedError


class C3x(_C3Variant):
    """:class:`C3` with :class:`CrossConv` blocks (k = 3) instead of bottlenecks."""

    def inner(self, c: int, n: int, shortcut: bool, g: int) -> nn.Module:
        return nn.Sequential(*(CrossConv(c, c, 3, 1, g, 1.0, shortcut) for _ in range(n)))


class C3Ghost(_C3Variant):
    """:class:`C3` with :class:`GhostBottleneck` blocks."""

    def inner(self, c: int, n: int, shortcut: bool, g: int) -> nn.Module:
        return nn.Sequential(*(GhostBottleneck(c, c) for _ in range(n)))


class C3TR(_C3Variant):
    """:class:`C3` with a :class:`TransformerBlock` (4 heads, ``n`` layers) instead of bottlenecks."""

    def inner(self, c: int, n: int, shortcut: bool, g: int) -> nn.Module:
        return TransformerBlock(c, c, 4, n)


class C3SPP(_C3Variant):
    """:class:`C3` with an :class:`SPP` of kernels ``k`` as its inner block.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Pool kernel sizes.
        n: Unused by the block (the yaml's repeat count makes copies of the whole block instead).
        shortcut: Unused.
        g: Unused.
        e: Hidden channel ratio.
    """

    def __init__(
        self,
        c1: int,
        c2: int,
        k: Sequence[int] = (5, 9, 13),
        n: int = 1,
        shortcut: bool = True,
        g: int = 1,
        e: float = 0.5,
    ) -> None:
        self._k = tuple(k)
        super().__init__(c1, c2, n, shortcut, g, e)

    def inner(self, c: int, n: int, shortcut: bool, g: int) -> nn.Module:
        return SPP(c, c, self._k)


class GhostConv(nn.Module):
    """Ghost convolution (GhostNet): a :class:`Conv` to half the channels, plus a cheap 5x5 depth-wise conv of it.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel size of the primary conv.
        s: Stride.
        g: Groups of the primary conv.
        act: As :class:`Conv`.
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1, act: bool | nn.Module = True) -> None:
        super().__init__()
        c_ = c2 // 2
        self.cv1 = Conv(c1, c_, k, s, None, g, act=act)
        self.cv2 = Conv(c_, c_, 5, 1, None, c_, act=act)

    def forward(self, x: Tensor) -> Tensor:
        y = self.cv1(x)
        return torch.cat((y, self.cv2(y)), 1)


class GhostBottleneck(nn.Module):
    """Ghost bottleneck: two :class:`GhostConv` (a depth-wise conv between them at stride 2) plus a shortcut.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Depth-wise kernel size.
        s: Stride (1 or 2).
    """

    def __init__(self, c1: int, c2: int, k: int = 3, s: int = 1) -> None:
        super().__init__()
        c_ = c2 // 2
        self.conv = nn.Sequential(
            GhostConv(c1, c_, 1, 1),
            DWConv(c_, c_, k, s, act=False) if s == 2 else nn.Identity(),
            GhostConv(c_, c2, 1, 1, act=False),
        )
        self.shortcut = (
            nn.Sequential(DWConv(c1, c1, k, s, act=False), Conv(c1, c2, 1, 1, act=False)) if s == 2 else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x) + self.shortcut(x)


class TransformerLayer(nn.Module):
    """Transformer encoder layer without LayerNorm: q/k/v projections, multi-head attention, a linear pair.

    Args:
        c: Embedding size.
        num_heads: Attention heads.
    """

    def __init__(self, c: int, num_heads: int) -> None:
        super().__init__()
        self.q = nn.Linear(c, c, bias=False)
        self.k = nn.Linear(c, c, bias=False)
        self.v = nn.Linear(c, c, bias=False)
        self.ma = nn.MultiheadAttention(embed_dim=c, num_heads=num_heads)
        self.fc1 = nn.Linear(c, c, bias=False)
        self.fc2 = nn.Linear(c, c, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: (L, B, c), sequence first (nn.MultiheadAttention's default layout).
        x = self.ma(self.q(x), self.k(x), self.v(x))[0] + x
        return self.fc2(self.fc1(x)) + x


class TransformerBlock(nn.Module):
    """Vision-transformer block over the pixels of a feature map, with a learned linear position embedding.

    Args:
        c1: Input channels (a :class:`Conv` maps them to ``c2`` when they differ).
        c2: Embedding size and output channels.
        num_heads: Attention heads.
        num_layers: :class:`TransformerLayer` count.
    """

    def __init__(self, c1: int, c2: int, num_heads: int, num_layers: int) -> None:
        super().__init__()
        self.conv = Conv(c1, c2) if c1 != c2 else None
        self.linear = nn.Linear(c2, c2)
        self.tr = nn.Sequential(*(TransformerLayer(c2, num_heads) for _ in range(num_layers)))
        self.c2 = c2

    def forward(self, x: Tensor) -> Tensor:
        if self.conv is not None:
            x = self.conv(x)
        b, _, h, w = x.shape
        p = x.flatten(2).permute(2, 0, 1)  # (H*W, B, c2)
        return self.tr(p + self.linear(p)).permute(1, 2, 0).reshape(b, self.c2, h, w)


class MixConv2d(nn.Module):
    """Mixed depth-wise convolution (MixNet): the output channels split over kernels ``k``, then BatchNorm + SiLU.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel sizes.
        s: Stride.
        equal_ch: Split the channels equally (True) or so that every kernel has about as many weights (False).
    """

    def __init__(self, c1: int, c2: int, k: Sequence[int] = (1, 3), s: int = 1, equal_ch: bool = True) -> None:
        super().__init__()
        n = len(k)
        if equal_ch:  # channel j goes to kernel floor(j * (n - 1e-6) / (c2 - 1)), as torch.linspace spaces them
            group = torch.linspace(0, n - 1e-6, c2, device="cpu").floor()
            split = [int((group == i).sum()) for i in range(n)]
        else:  # solve for channel counts c_i with c_i * k_i^2 equal across kernels and sum c_i = c2
            a = np.eye(n + 1, n, k=-1)
            a -= np.roll(a, 1, axis=1)
            a *= np.array(k) ** 2
            a[0] = 1
            split = [int(c) for c in np.linalg.lstsq(a, [c2] + [0] * n, rcond=None)[0].round()]
        self.m = nn.ModuleList(
            nn.Conv2d(c1, c_, kk, s, kk // 2, groups=math.gcd(c1, c_), bias=False)
            for kk, c_ in zip(k, split, strict=True)
        )
        self.bn = nn.BatchNorm2d(c2, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(torch.cat([m(x) for m in self.m], 1)))


class Contract(nn.Module):
    """Space-to-depth by ``gain``: (B, C, H, W) -> (B, C * gain², H / gain, W / gain).

    Args:
        gain: Block size.
    """

    def __init__(self, gain: int = 2) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        s = self.gain
        x = x.view(b, c, h // s, s, w // s, s).permute(0, 3, 5, 1, 2, 4).contiguous()  # (B, s, s, C, H/s, W/s)
        return x.view(b, c * s * s, h // s, w // s)


class Expand(nn.Module):
    """Depth-to-space by ``gain``: (B, C, H, W) -> (B, C / gain², H * gain, W * gain).

    Args:
        gain: Block size.
    """

    def __init__(self, gain: int = 2) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        s = self.gain
        x = x.view(b, s, s, c // s**2, h, w).permute(0, 3, 4, 1, 5, 2).contiguous()  # (B, C/s², H, s, W, s)
        return x.view(b, c // s**2, h * s, w * s)
