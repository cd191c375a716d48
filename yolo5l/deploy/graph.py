"""The detector and its decode for one fixed input size, with constant grids: the graph of the static formats.

`YOLOv5.decode` builds its grids from the heads' sizes (arange ops, so an ONNX or TorchScript file takes any size);
converters that want static shapes and no general power operator (LiteRT, Core ML) get this form instead: grids and
anchors as constants, and the square written as `x * x`. Same arithmetic otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from yolo5l.models.yolo import YOLOv5

__all__ = ["StaticDecoded"]


class StaticDecoded(nn.Module):
    """`YOLOv5` and its decode for a fixed input size.

    Args:
        model: The detector, prepared with `yolo5l.exporter.prepare_for_export`.
        height: Input height.
        width: Input width.
        channels_last: Take (B, H, W, 3) input (TFLite's layout) instead of (B, 3, H, W).
        normalized: Give cx, cy, w, h as fractions of the input's width and height (ultralytics' TFLite and CoreML
            layout) instead of pixels.
    """

    def __init__(
        self, model: YOLOv5, height: int, width: int, channels_last: bool = False, normalized: bool = False
    ) -> None:
        super().__init__()
        self.model, self.channels_last = model, channels_last
        detect = model.detect
        scale = torch.tensor([width, height], dtype=torch.float32) if normalized else torch.ones(2)
        for i, s in enumerate(float(v) for v in detect.stride):
            ny, nx = height // int(s), width // int(s)
            yv, xv = torch.meshgrid(torch.arange(ny), torch.arange(nx), indexing="ij")
            grid = (torch.stack((xv, yv), -1).float() - 0.5).view(1, 1, ny, nx, 2)
            self.register_buffer(f"grid{i}", grid * s / scale, persistent=False)  # (1, 1, ny, nx, 2)
            self.register_buffer(f"gain{i}", 2 * s / scale, persistent=False)
            anchors = (detect.anchors[i] * s / scale).view(1, -1, 1, 1, 2)
            self.register_buffer(f"anchor{i}", anchors, persistent=False)  # (1, na, 1, 1, 2)

    def forward(self, images: Tensor) -> Tensor:
        heads = self.model(images.permute(0, 3, 1, 2) if self.channels_last else images)
        out = []
        for i, h in enumerate(heads):
            b, na, ny, nx, no = h.shape
            xy, wh, conf = h.sigmoid().split((2, 2, no - 4), -1)
            xy = xy * getattr(self, f"gain{i}") + getattr(self, f"grid{i}")  # (2σ - 0.5 + grid) * stride
            wh = wh * 2
            wh = wh * wh * getattr(self, f"anchor{i}")  # (2σ)² * anchor
            out.append(torch.cat((xy, wh, conf), -1).reshape(b, na * ny * nx, no))
        return torch.cat(out, 1)
