"""YOLOv5 v7.0 building blocks as plain ``nn.Module``s.

Attribute names (``conv``, ``bn``, ``cv1``, ``cv2``, ``cv3``, ``m``) equal ultralytics' so that state-dict keys of a
model built from these blocks match the keys in an ultralytics/yolov5 checkpoint one to one.

Reference: ultralytics/yolov5 v7.0 ``models/common.py`` (behaviour as described in docs; not copied).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from yolo5l_kernels.bn_silu import bn_silu

# YOLOv5's initialize_weights: every BatchNorm2d gets these instead of PyTorch's (1e-5, 0.1).
BN_EPS = 1e-3
BN_MOMENTUM = 0.03


def autopad(k: int | Sequence[int], p: int | Sequence[int] | None = None, d: int = 1) -> int | list[int]:
    """Return the 'same' padding of a kernel (an int, or one size per dimension).

    Args:
        k: Kernel size, or sizes per dimension (``(1, 3)``).
        p: Explicit padding; returned unchanged when given.
        d: Dilation.

    Returns:
        ``p`` if given, else ``(d * (k - 1) + 1) // 2`` (``k // 2`` for d = 1), per dimension for a sequence.
    """
    if p is not None:
        return p if isinstance(p, int) else list(p)
    if isinstance(k, int):
        return (d * (k - 1) + 1) // 2
    return [(d * (x - 1) + 1) // 2 for x in k]


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU; after :meth:`fuse` the BN is folded into a biased conv.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Kernel size (or sizes per dimension).
        s: Stride (or strides per dimension).
        p: Padding (``autopad`` when None).
        g: Groups.
        d: Dilation.
        act: SiLU (True), identity (False), or the activation module to use.

    Attributes:
        fused_bn_act: In training, compute BN + SiLU with ``yolo5l_kernels.bn_silu``: the operators
            ``torch.ops.yolo5l.bn_silu_fwd`` / ``bn_silu_bwd``, one CPU kernel each way for channels_last bf16/fp32,
            which ``torch.compile`` keeps in its graph; PyTorch ops elsewhere. Set for the whole model by
            ``YOLOv5(fused_bn_act=...)``.
    """

    fused_bn_act: bool = False

    def __init__(
        self,
        c1: int,
        c2: int,
        k: int | Sequence[int] = 1,
        s: int | Sequence[int] = 1,
        p: int | Sequence[int] | None = None,
        g: int = 1,
        d: int = 1,
        act: bool | nn.Module = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p, d), groups=g, dilation=d, bias=False)
        self.bn: nn.BatchNorm2d | None = nn.BatchNorm2d(c2, eps=BN_EPS, momentum=BN_MOMENTUM)
        if isinstance(act, nn.Module):
            self.act: nn.Module = act
        else:  # SiLU in place, as YOLOv5's initialize_weights sets it
            self.act = nn.SiLU(inplace=True) if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        if self.fused_bn_act and self.bn is not None and self.bn.training and isinstance(self.act, nn.SiLU):
            return bn_silu(x, self.bn)
        if self.bn is not None:
            x = self.bn(x)
        if isinstance(self.act, nn.SiLU):
            # In place only where autograd does not record it: under autograd an in-place SiLU (YOLOv5's) makes it
            # clone the input for the backward, a hidden copy of every activation in training.
            return F.silu(x, inplace=not x.requires_grad)
        return self.act(x)

    @torch.no_grad()
    def fuse(self) -> Conv:
        """Fold the BatchNorm running statistics into the conv weight and a new bias (inference only).

        ``w' = w * g / sqrt(var + eps)``, ``b' = beta + (b - mean) * g / sqrt(var + eps)``.

        Returns:
            self.
        """
        if self.bn is None:
            return self
        conv, bn = self.conv, self.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (c2,)
        fused = nn.Conv2d(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=True,
        ).to(device=conv.weight.device, dtype=conv.weight.dtype)
        fused.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        fused.bias.copy_(bn.bias + (bias - bn.running_mean) * scale)
        fused.requires_grad_(False)
        self.conv = fused
        self.bn = None
        return self


class Bottleneck(nn.Module):
    """1x1 Conv then 3x3 Conv, with a residual add when ``shortcut`` and ``c1 == c2``.

    Args:
        c1: Input channels.
        c2: Output channels.
        shortcut: Allow the residual add.
        g: Groups of the 3x3 conv.
        e: Hidden channel ratio (``int(c2 * e)``); C3 builds its bottlenecks with 1.0.
    """

    def __init__(self, c1: int, c2: int, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_, c2, 3, 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP bottleneck with 3 convolutions: ``cv3(cat(m(cv1(x)), cv2(x)))``.

    Args:
        c1: Input channels.
        c2: Output channels.
        n: Number of bottlenecks.
        shortcut: Residual adds inside the bottlenecks (True in the backbone, False in the head).
        g: Groups.
        e: Hidden channel ratio (``c_ = int(c2 * e)``).
    """

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        # Bottleneck branch first: the channel order matters for cv3's weights.
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: one 5x5 max-pool applied three times in sequence.

    Equivalent to SPP with kernels (5, 9, 13) at lower cost.

    Args:
        c1: Input channels.
        c2: Output channels.
        k: Pooling kernel size.
    """

    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension``.

    Args:
        dimension: The dimension to concatenate along (channels).
    """

    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, x: list[Tensor]) -> Tensor:
        return torch.cat(x, self.d)
