"""The YOLOv5 v7.0 detectors and their Detect head, as plain ``nn.Module``s.

The released P5 sizes (n/s/m/l/x) are built from this module's table; the P6 sizes (``cfg="p6"``) and any other
v7.0 model yaml (``cfg="path/to/model.yaml"``) by :mod:`yolo5l.models.parse`. Layer ``i`` lives at
``self.model[i]``, so state-dict keys equal ultralytics' (``model.0.conv.weight`` ... ``model.24.anchors`` for P5,
349 tensors for every P5 size). ``forward`` returns the raw heads (3 for P5, 4 for P6) in every mode; ``decode``
turns them into boxes in pixels.

Reference: ultralytics/yolov5 v7.0 ``models/yolov5s.yaml`` and ``models/yolo.py`` (``parse_model``, ``Detect``,
``DetectionModel``); ``train.py`` for ``--freeze``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from yolo5l.models.common import C3, SPPF, Concat, Conv
from yolo5l.models.head import ANCHORS_P3_P5, STRIDES, Detect, anchors_to_tensor, make_upsample
from yolo5l.models.p5 import LAYERS, SAVE, SCALES, make_divisible, scaled_repeats

__all__ = ["ANCHORS_P3_P5", "SCALES", "STRIDES", "Detect", "YOLOv5", "anchors_to_tensor", "freeze_layers"]


class YOLOv5(nn.Module):
    """YOLOv5 v7.0 detector: the released P5 table, the P6 table or a v7.0 model yaml, with depth/width scaling.

    Args:
        num_classes: Number of classes C; None keeps the architecture's (80, or a yaml's ``nc``).
        depth: depth_multiple (repeats ``max(round(n * depth), 1)``); None keeps the architecture's (0.33 for the
            built-in tables, a yaml's ``depth_multiple``).
        width: width_multiple (channels ``ceil(c * width / 8) * 8``); None keeps the architecture's (0.50, or a
            yaml's ``width_multiple``).
        anchors: Pixel anchors, one level per Detect input of (w, h) pairs: for P5 3 lists of 6 numbers or
            (3, 3, 2). None keeps the architecture's (COCO's P5 or P6 anchors, or a yaml's ``anchors``).
        fused_upsample: Use ``yolo5l_kernels.upsample.UpsampleNearest2x`` (falls back to ``nn.Upsample`` with a
            warning when that module is missing). Both compute the same nearest 2x upsample.
        fused_bn_act: Every Conv block computes BatchNorm + SiLU in training with ``yolo5l_kernels.bn_silu``: one
            CPU kernel each way for channels_last bf16/fp32 activations (compiled on first use; PyTorch ops
            elsewhere, and where no C compiler is found). Same results up to float rounding; eval is unaffected.
        cfg: The architecture: None or ``"p5"`` (the yolov5n-x table), ``"p6"`` (the yolov5n6-x6 table: 4 outputs,
            strides 8-64), the path of a v7.0 model yaml, or such a yaml as a mapping (:mod:`yolo5l.models.parse`).

    Example:
        >>> model = YOLOv5.from_name("yolov5s", num_classes=80)
        >>> heads = model(torch.zeros(1, 3, 64, 64))  # [(1, 3, 8, 8, 85), (1, 3, 4, 4, 85), (1, 3, 2, 2, 85)]
        >>> boxes = model.decode(heads)  # (1, 252, 85)
    """

    def __init__(
        self,
        num_classes: int | None = None,
        depth: float | None = None,
        width: float | None = None,
        anchors: Any = None,
        fused_upsample: bool = False,
        fused_bn_act: bool = False,
        cfg: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if cfg == "p5":
            cfg = None
        spec = None
        if cfg is not None:
            from yolo5l.models.parse import builtin_name, load_spec, placeholder_anchors

            source = os.fspath(cfg) if isinstance(cfg, (str, os.PathLike)) else "model cfg"
            spec = load_spec(cfg)
            depth = spec["depth_multiple"] if depth is None else depth
            width = spec["width_multiple"] if width is None else width
            num_classes = spec["nc"] if num_classes is None else num_classes
            anchors = spec["anchors"] if anchors is None else anchors
            table = builtin_name(spec)
            if table == "p5":  # a yaml of the released P5 layers: the table below builds it
                spec = None
                anchors = placeholder_anchors(anchors, len(STRIDES)) if isinstance(anchors, int) else anchors
            cfg = "p6" if table == "p6" else cfg
        num_classes = 80 if num_classes is None else num_classes
        depth = 0.33 if depth is None else depth
        width = 0.50 if width is None else width
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        if depth <= 0 or width <= 0:
            raise ValueError(f"depth and width multiples must be positive, got depth={depth}, width={width}")
        self.num_classes = int(num_classes)
        self.depth = float(depth)
        self.width = float(width)
        self.fused_upsample = bool(fused_upsample)
        self.fused_bn_act = bool(fused_bn_act)
        #: The architecture as :meth:`__init__` takes it back: None (P5), ``"p6"``, or a model-yaml mapping.
        self.cfg: str | dict[str, Any] | None = None
        if spec is None:
            self._build_p5(ANCHORS_P3_P5 if anchors is None else anchors)
            strides: Sequence[float] = STRIDES
        else:
            from yolo5l.models.parse import build_layers

            self.cfg = "p6" if cfg == "p6" else spec
            built = build_layers(spec, self.num_classes, self.depth, self.width, anchors, self.fused_upsample, source)
            self.model = nn.ModuleList(built.layers)
            self._from = built.froms
            self._save = built.save
            strides = built.strides
        for mod in self.modules():
            if isinstance(mod, Conv):
                mod.fused_bn_act = self.fused_bn_act
        # The P5 table's strides are fixed (P3/8, P4/16, P5/32), so they are set; any other table's are measured on
        # the meta device (yolo5l.models.parse). YOLOv5 measures them with a forward pass of a zero image in train
        # mode, which as a side effect leaves every BatchNorm at running_var 0.9 and num_batches_tracked 1; with
        # momentum 0.03 that start washes out within the first ~100 iterations, long before the running statistics
        # are first used (validation), so it is not reproduced here.
        self.register_buffer("stride", torch.tensor(list(strides), dtype=torch.float32), persistent=False)  # (nl,)
        self._stride_max = max(int(max(strides)), 1)  # input sizes are multiples of it

    def _build_p5(self, anchors: Any) -> None:
        anchor_px = anchors_to_tensor(anchors)  # (3, na, 2) pixels
        layers: list[nn.Module] = []
        froms: list[int | tuple[int, ...]] = []
        ch: list[int] = [3]  # output channels per layer; ch[-1] is the current input
        for i, (f, n, block, args) in enumerate(LAYERS):
            c_in = ch[-1] if f == -1 else None
            if block == "Conv":
                c2 = make_divisible(args[0] * self.width)
                m: nn.Module = Conv(c_in, c2, *args[1:])
            elif block == "C3":
                c2 = make_divisible(args[0] * self.width)
                m = C3(c_in, c2, scaled_repeats(n, self.depth), *args[1:])
            elif block == "SPPF":
                c2 = make_divisible(args[0] * self.width)
                m = SPPF(c_in, c2, *args[1:])
            elif block == "Upsample":
                c2, m = ch[-1], make_upsample(self.fused_upsample)
            elif block == "Concat":
                c2, m = sum(ch[-1] if j == -1 else ch[j + 1] for j in f), Concat(*args)
            else:  # Detect
                m = Detect(self.num_classes, anchor_px, [ch[j + 1] for j in f], STRIDES)
                c2 = 0
            layers.append(m)
            froms.append(f)
            ch.append(c2)
            assert len(layers) == i + 1
        self.model = nn.ModuleList(layers)
        self._from = froms
        self._save = frozenset(j for f in froms if f != -1 for j in f if j != -1)
        assert tuple(sorted(self._save)) == SAVE

    @classmethod
    def from_name(cls, name: str, num_classes: int = 80, **kwargs: Any) -> YOLOv5:
        """Build a released size by name.

        Args:
            name: One of ``yolov5n``, ``yolov5s``, ``yolov5m``, ``yolov5l``, ``yolov5x`` or their P6 versions
                ``yolov5n6`` ... ``yolov5x6``.
            num_classes: Number of classes.
            **kwargs: Passed to the constructor (``anchors``, ``fused_upsample``, ``fused_bn_act``).

        Returns:
            The model.

        Raises:
            ValueError: For an unknown name.
        """
        from yolo5l.models.parse import SCALES_P6

        key = name.lower().removesuffix(".yaml").removesuffix(".pt")
        if key in SCALES_P6:
            depth, width = SCALES_P6[key]
            return cls(num_classes=num_classes, depth=depth, width=width, cfg="p6", **kwargs)
        if key not in SCALES:
            raise ValueError(f"unknown model name {name!r}; choose one of {sorted(SCALES) + sorted(SCALES_P6)}")
        depth, width = SCALES[key]
        return cls(num_classes=num_classes, depth=depth, width=width, **kwargs)

    def architecture(self) -> tuple[str, float, float]:
        """What two models must share for their weights to fit each other: layer table, depth and width."""
        table = self.cfg or "p5"
        if isinstance(table, dict):
            table = json.dumps({k: v for k, v in table.items() if k in ("backbone", "head", "ch", "activation")})
        return table, self.depth, self.width

    def describe(self) -> str:
        """The architecture in a few words: a released name (``yolov5m6``) or the multiples and level count."""
        from yolo5l.models.parse import SCALES_P6

        scales = SCALES if self.cfg is None else SCALES_P6 if self.cfg == "p6" else {}
        name = next((k for k, v in scales.items() if v == (self.depth, self.width)), None)
        if name is not None:
            return name
        kind = "P5" if self.cfg is None else "P6" if self.cfg == "p6" else f"model-yaml ({len(self.model)} layers)"
        return f"a {kind} model with depth {self.depth:g}, width {self.width:g}"

    @property
    def detect(self) -> Detect:
        """The Detect head (the last layer: ``self.model[24]`` for P5, ``self.model[33]`` for P6)."""
        return self.model[-1]

    @property
    def anchors(self) -> Tensor:
        """(nl, na, 2) anchors in grid units of each level (the ``model.24.anchors`` buffer for P5)."""
        return self.detect.anchors

    def anchor_pixels(self) -> Tensor:
        """(nl, na, 2) anchors in pixels (``anchors * stride``)."""
        return self.detect.anchors * self.detect.stride.view(-1, 1, 1)

    def forward(self, images: Tensor) -> list[Tensor]:
        """Run the network.

        Args:
            images: (B, 3, H, W) float, H and W multiples of the largest stride (32 for P5, 64 for P6).

        Returns:
            ``nl`` raw heads (B, na, H/s, W/s, 5 + C), one per stride s (8, 16, 32 for P5), in train and eval mode.
        """
        h, w = images.shape[-2:]
        s = self._stride_max
        if images.dim() != 4 or h % s or w % s:
            raise ValueError(f"YOLOv5 expects (B, 3, H, W) with H and W multiples of {s}, got {tuple(images.shape)}")
        x: Any = images
        saved: dict[int, Tensor] = {}
        for i, (f, m) in enumerate(zip(self._from, self.model, strict=True)):
            if f != -1:
                x = saved[f] if isinstance(f, int) else [x if j == -1 else saved[j] for j in f]
            x = m(x)
            if i in self._save:
                saved[i] = x
        return x

    def decode(self, heads: Sequence[Tensor]) -> Tensor:
        """Decode raw heads to (B, N, 5 + C): cx, cy, w, h in pixels, objectness and class sigmoids.

        See :meth:`Detect.decode`.
        """
        return self.detect.decode(heads)

    def fuse(self) -> YOLOv5:
        """Fold every BatchNorm into its conv (for inference; training afterwards is not supported).

        Returns:
            self.
        """
        for m in self.modules():
            if isinstance(m, Conv):
                m.fuse()
        return self

    def plain_upsample(self) -> YOLOv5:
        """Swap the fused upsample layers (``fused_upsample``) for ``nn.Upsample``, which computes the same (export).

        Returns:
            self.
        """
        for i, m in enumerate(self.model):
            if type(m).__name__ == "UpsampleNearest2x":
                self.model[i] = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.fused_upsample = False
        return self


def freeze_layers(model: nn.Module, freeze: int | Iterable[int] | None) -> list[str]:
    """Stop gradients of layers ``model.{i}.`` (YOLOv5's ``--freeze``): an int N = layers 0..N-1 (10 = the
    backbone), or a list of indices. BatchNorm running statistics still update, as in YOLOv5.

    Returns:
        The names of the parameters frozen.
    """
    if freeze is None:
        return []
    layers = range(int(freeze)) if isinstance(freeze, int) else [int(i) for i in freeze]
    prefixes = tuple(f"model.{i}." for i in layers)
    frozen = []
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen
