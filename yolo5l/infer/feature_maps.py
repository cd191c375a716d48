"""`python -m yolo5l.predict visualize=true`: each stage's feature maps, per image, as v7.0's `--visualize` saves them.

For every layer of the network whose output is a (B, C, H, W) map larger than 1 x 1 (the Detect head excluded),
`<run>/visualize/<image stem>/stage{i}_{Layer}_features.png` shows its first 32 channels in rows of 8 (each scaled
to its own range, viridis colours, as v7.0's matplotlib figure shows them, but tiled with numpy rather than drawn as
a figure per stage), and `.npy` holds all its channels. The outputs are caught with forward hooks while the model
runs, so `YOLOv5.forward` is untouched; with `augment=true` the full-size pass is the one drawn.

Reference: ultralytics/yolov5 v7.0 `utils/plots.py::feature_visualization`, `models/yolo.py::BaseModel._forward_once`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

__all__ = ["FeatureMaps"]

_MAX_MAPS = 32
_COLUMNS = 8


class FeatureMaps:
    """Catch the stage outputs of a model's layers (`model.model`, a `nn.Sequential`-like list) while it runs.

    Use as a context manager around the forward pass, then `write` each image's maps.

    Args:
        model: A `YOLOv5` (its `model` attribute lists the stages in order).
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = list(getattr(model, "model", []))
        self.outputs: dict[int, Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> FeatureMaps:
        self.outputs.clear()
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if i not in self.outputs and isinstance(output, Tensor) and output.dim() == 4:
                self.outputs[i] = output.detach()  # the first call: the full-size pass under augment

        return keep

    def write(self, folder: Path, image_index: int = 0) -> list[Path]:
        """Write image `image_index`'s maps of every caught stage into `folder`; returns the PNG files."""
        from yolo5l.infer.annotate import save_rgb

        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for i, out in sorted(self.outputs.items()):
            x = out[image_index].float().cpu().numpy()  # (C, H, W)
            if x.shape[1] <= 1 or x.shape[2] <= 1:
                continue
            path = folder / f"stage{i}_{type(self.layers[i]).__name__}_features.png"
            written.append(save_rgb(_montage(x[:_MAX_MAPS]), path))
            np.save(path.with_suffix(".npy"), x)
        return written


def _montage(maps: np.ndarray, min_side: int = 64, gap: int = 2) -> np.ndarray:
    """(n, H, W) maps -> one RGB image: each map scaled to its own range and coloured (viridis, as matplotlib's
    `imshow` shows it), enlarged to at least `min_side` pixels (nearest), in rows of 8."""
    from matplotlib import colormaps

    n, h, w = maps.shape
    k = max(1, math.ceil(min_side / min(h, w)))
    lo, hi = maps.min((1, 2), keepdims=True), maps.max((1, 2), keepdims=True)
    scaled = ((maps - lo) / np.maximum(hi - lo, 1e-12) * 255).astype(np.uint8)
    lut = (colormaps["viridis"](np.arange(256))[:, :3] * 255).astype(np.uint8)
    tiles = lut[scaled.repeat(k, 1).repeat(k, 2)]  # (n, kH, kW, 3)
    rows, th, tw = math.ceil(n / _COLUMNS), h * k, w * k
    canvas = np.full((rows * (th + gap) - gap, min(n, _COLUMNS) * (tw + gap) - gap, 3), 255, np.uint8)
    for j, tile in enumerate(tiles):
        r, c = divmod(j, _COLUMNS)
        canvas[r * (th + gap) : r * (th + gap) + th, c * (tw + gap) : c * (tw + gap) + tw] = tile
    return canvas
