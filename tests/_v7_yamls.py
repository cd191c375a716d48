"""Architectures of the model yamls ultralytics/yolov5 v7.0 ships (``models/*.yaml``, ``models/hub/*.yaml``), as
data, with the parameter counts v7.0's own ``DetectionModel`` gives them (facts, computed once with the PyPI package
``yolov5==7.0.14``; they match the README's params column where it lists the model).

``spec(name)`` returns the yaml as the mapping ``yaml.safe_load`` gives (strings ``nc``/``anchors``/``None`` as v7.0
writes them), so a test can dump it to a file or pass it on.
"""

from __future__ import annotations

import copy
from typing import Any

ANCHORS_P5 = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
ANCHORS_P6 = [[19, 27, 44, 40, 38, 94], [96, 68, 86, 152, 180, 137], [140, 301, 303, 264, 238, 542],
              [436, 615, 739, 380, 925, 792]]  # fmt: skip
UP = [-1, 1, "nn.Upsample", ["None", 2, "nearest"]]
DETECT = ["nc", "anchors"]


def _stem(*stages: int) -> list[list[Any]]:
    """Conv 6x6/2, then per stage a 3x3/2 Conv and a C3 (3, 6, 9, 3, 3, ... repeats)."""
    rows: list[list[Any]] = [[-1, 1, "Conv", [64, 6, 2, 2]]]
    for c, n in zip(stages, (3, 6, 9, 3, 3, 3), strict=False):
        rows += [[-1, 1, "Conv", [c, 3, 2]], [-1, n, "C3", [c]]]
    return rows


P5_BACKBONE = [*_stem(128, 256, 512, 1024), [-1, 1, "SPPF", [1024, 5]]]
P5_HEAD = [
    [-1, 1, "Conv", [512, 1, 1]], UP, [[-1, 6], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [256, 1, 1]], UP, [[-1, 4], 1, "Concat", [1]], [-1, 3, "C3", [256, False]],
    [-1, 1, "Conv", [256, 3, 2]], [[-1, 14], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [512, 3, 2]], [[-1, 10], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]],
    [[17, 20, 23], 1, "Detect", DETECT],
]  # fmt: skip
P6_BACKBONE = [*_stem(128, 256, 512, 768, 1024), [-1, 1, "SPPF", [1024, 5]]]
P6_HEAD = [
    [-1, 1, "Conv", [768, 1, 1]], UP, [[-1, 8], 1, "Concat", [1]], [-1, 3, "C3", [768, False]],
    [-1, 1, "Conv", [512, 1, 1]], UP, [[-1, 6], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [256, 1, 1]], UP, [[-1, 4], 1, "Concat", [1]], [-1, 3, "C3", [256, False]],
    [-1, 1, "Conv", [256, 3, 2]], [[-1, 20], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [512, 3, 2]], [[-1, 16], 1, "Concat", [1]], [-1, 3, "C3", [768, False]],
    [-1, 1, "Conv", [768, 3, 2]], [[-1, 12], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]],
    [[23, 26, 29, 32], 1, "Detect", DETECT],
]  # fmt: skip
P2_HEAD = [
    *P5_HEAD[:8],
    [-1, 1, "Conv", [128, 1, 1]], UP, [[-1, 2], 1, "Concat", [1]], [-1, 1, "C3", [128, False]],
    [-1, 1, "Conv", [128, 3, 2]], [[-1, 18], 1, "Concat", [1]], [-1, 3, "C3", [256, False]],
    [-1, 1, "Conv", [256, 3, 2]], [[-1, 14], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [512, 3, 2]], [[-1, 10], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]],
    [[21, 24, 27, 30], 1, "Detect", DETECT],
]  # fmt: skip
P7_BACKBONE = [*_stem(128, 256, 512, 768, 1024, 1280), [-1, 1, "SPPF", [1280, 5]]]
P7_HEAD = [
    [-1, 1, "Conv", [1024, 1, 1]], UP, [[-1, 10], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]],
    [-1, 1, "Conv", [768, 1, 1]], UP, [[-1, 8], 1, "Concat", [1]], [-1, 3, "C3", [768, False]],
    [-1, 1, "Conv", [512, 1, 1]], UP, [[-1, 6], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [256, 1, 1]], UP, [[-1, 4], 1, "Concat", [1]], [-1, 3, "C3", [256, False]],
    [-1, 1, "Conv", [256, 3, 2]], [[-1, 26], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [512, 3, 2]], [[-1, 22], 1, "Concat", [1]], [-1, 3, "C3", [768, False]],
    [-1, 1, "Conv", [768, 3, 2]], [[-1, 18], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]],
    [-1, 1, "Conv", [1024, 3, 2]], [[-1, 14], 1, "Concat", [1]], [-1, 3, "C3", [1280, False]],
    [[29, 32, 35, 38, 41], 1, "Detect", DETECT],
]  # fmt: skip
P34_HEAD = [*P5_HEAD[:11], [[17, 20], 1, "Detect", DETECT]]
BIFPN_HEAD = [*P5_HEAD[:9], [[-1, 14, 6], 1, "Concat", [1]], *P5_HEAD[10:]]
YOLOV3_SPP_BACKBONE = [
    [-1, 1, "Conv", [32, 3, 1]], [-1, 1, "Conv", [64, 3, 2]], [-1, 1, "Bottleneck", [64]],
    [-1, 1, "Conv", [128, 3, 2]], [-1, 2, "Bottleneck", [128]], [-1, 1, "Conv", [256, 3, 2]],
    [-1, 8, "Bottleneck", [256]], [-1, 1, "Conv", [512, 3, 2]], [-1, 8, "Bottleneck", [512]],
    [-1, 1, "Conv", [1024, 3, 2]], [-1, 4, "Bottleneck", [1024]],
]  # fmt: skip
YOLOV3_SPP_HEAD = [
    [-1, 1, "Bottleneck", [1024, False]], [-1, 1, "SPP", [512, [5, 9, 13]]], [-1, 1, "Conv", [1024, 3, 1]],
    [-1, 1, "Conv", [512, 1, 1]], [-1, 1, "Conv", [1024, 3, 1]],
    [-2, 1, "Conv", [256, 1, 1]], UP, [[-1, 8], 1, "Concat", [1]], [-1, 1, "Bottleneck", [512, False]],
    [-1, 1, "Bottleneck", [512, False]], [-1, 1, "Conv", [256, 1, 1]], [-1, 1, "Conv", [512, 3, 1]],
    [-2, 1, "Conv", [128, 1, 1]], UP, [[-1, 6], 1, "Concat", [1]], [-1, 1, "Bottleneck", [256, False]],
    [-1, 2, "Bottleneck", [256, False]],
    [[27, 22, 15], 1, "Detect", DETECT],
]  # fmt: skip
YOLOV3_TINY_BACKBONE = [
    [-1, 1, "Conv", [16, 3, 1]], [-1, 1, "nn.MaxPool2d", [2, 2, 0]], [-1, 1, "Conv", [32, 3, 1]],
    [-1, 1, "nn.MaxPool2d", [2, 2, 0]], [-1, 1, "Conv", [64, 3, 1]], [-1, 1, "nn.MaxPool2d", [2, 2, 0]],
    [-1, 1, "Conv", [128, 3, 1]], [-1, 1, "nn.MaxPool2d", [2, 2, 0]], [-1, 1, "Conv", [256, 3, 1]],
    [-1, 1, "nn.MaxPool2d", [2, 2, 0]], [-1, 1, "Conv", [512, 3, 1]], [-1, 1, "nn.ZeroPad2d", [[0, 1, 0, 1]]],
    [-1, 1, "nn.MaxPool2d", [2, 1, 0]],
]  # fmt: skip
YOLOV3_TINY_HEAD = [
    [-1, 1, "Conv", [1024, 3, 1]], [-1, 1, "Conv", [256, 1, 1]], [-1, 1, "Conv", [512, 3, 1]],
    [-2, 1, "Conv", [128, 1, 1]], UP, [[-1, 8], 1, "Concat", [1]], [-1, 1, "Conv", [256, 3, 1]],
    [[19, 15], 1, "Detect", DETECT],
]  # fmt: skip
# Not a v7.0 file: every other block parse_model knows, in one model (counts also from v7.0's DetectionModel).
KITCHEN_BACKBONE = [
    [-1, 1, "Focus", [64, 3]], [-1, 1, "Conv", [128, 3, 2]], [-1, 3, "BottleneckCSP", [128]],
    [-1, 1, "DWConv", [256, 3, 2]], [-1, 6, "C3x", [256]], [-1, 1, "MixConv2d", [256, [1, 3, 5]]],
    [-1, 1, "Contract", [2]], [-1, 6, "Conv", [1024, 1, 1]], [-1, 1, "GhostBottleneck", [512, 3, 2]],
    [-1, 1, "C3SPP", [512, [5, 9, 13]]], [-1, 1, "SPP", [512, [5, 9, 13]]],
]  # fmt: skip
KITCHEN_HEAD = [
    [-1, 1, "Conv", [256, 1, 1]], [-1, 1, "nn.ConvTranspose2d", [256, 2, 2]], [[-1, 7], 1, "Concat", [1]],
    [-1, 3, "C3", [256, False]], [-1, 1, "Expand", [2]], [[-1, 5], 1, "Concat", [1]], [-1, 1, "nn.BatchNorm2d", []],
    [-1, 1, "CrossConv", [128, 3, 1]], [-1, 1, "MixConv2d", [128, [3, 5], 1, False]],
    [14, 1, "DWConvTranspose2d", [256, 2, 2]], [[-1, 18], 1, "Concat", [1]], [-1, 1, "C3Ghost", [128]],
    [[22, 14, 10], 1, "Detect", DETECT],
]  # fmt: skip


def _ghost(rows: list[list[Any]], keep_first: bool = False) -> list[list[Any]]:
    swap = {"Conv": "GhostConv", "C3": "C3Ghost"}
    return [r if i == 0 and keep_first else [r[0], r[1], swap.get(r[2], r[2]), r[3]] for i, r in enumerate(rows)]


_MULTIPLES = {"n": (0.33, 0.25), "s": (0.33, 0.50), "m": (0.67, 0.75), "l": (1.0, 1.0), "x": (1.33, 1.25)}
_SPECS: dict[str, tuple[tuple[float, float], Any, list, list, dict]] = {
    **{f"yolov5{k}": (v, ANCHORS_P5, P5_BACKBONE, P5_HEAD, {}) for k, v in _MULTIPLES.items()},
    **{f"yolov5{k}6": (v, ANCHORS_P6, P6_BACKBONE, P6_HEAD, {}) for k, v in _MULTIPLES.items()},
    "yolov5-p2": ((1.0, 1.0), 3, P5_BACKBONE, P2_HEAD, {}),
    "yolov5-p6": ((1.0, 1.0), 3, P6_BACKBONE, P6_HEAD, {}),
    "yolov5-p7": ((1.0, 1.0), 3, P7_BACKBONE, P7_HEAD, {}),
    "yolov5-p34": ((0.33, 0.50), 3, P5_BACKBONE, P34_HEAD, {}),
    "yolov5-bifpn": ((1.0, 1.0), ANCHORS_P5, P5_BACKBONE, BIFPN_HEAD, {}),
    "yolov5s-ghost": ((0.33, 0.50), ANCHORS_P5, _ghost(P5_BACKBONE, keep_first=True), _ghost(P5_HEAD), {}),
    "yolov5s-transformer": (
        (0.33, 0.50), ANCHORS_P5, [*P5_BACKBONE[:8], [-1, 3, "C3TR", [1024]], P5_BACKBONE[9]], P5_HEAD, {},
    ),
    "yolov5s-LeakyReLU": ((0.33, 0.50), ANCHORS_P5, P5_BACKBONE, P5_HEAD, {"activation": "nn.LeakyReLU(0.1)"}),
    "yolov3-spp": ((1.0, 1.0), ANCHORS_P5, YOLOV3_SPP_BACKBONE, YOLOV3_SPP_HEAD, {}),
    "yolov3-tiny": (
        (1.0, 1.0), [[10, 14, 23, 27, 37, 58], [81, 82, 135, 169, 344, 319]], YOLOV3_TINY_BACKBONE,
        YOLOV3_TINY_HEAD, {},
    ),
    "kitchen": ((0.33, 0.25), ANCHORS_P5, KITCHEN_BACKBONE, KITCHEN_HEAD, {"nc": 3}),
}  # fmt: skip

#: name -> (parameters, state-dict tensors, strides) of v7.0's DetectionModel(<name>.yaml) with the yaml's nc.
V7_COUNTS: dict[str, tuple[int, int, list[float]]] = {
    "yolov5n": (1872157, 349, [8, 16, 32]),
    "yolov5s": (7235389, 349, [8, 16, 32]),
    "yolov5m": (21190557, 481, [8, 16, 32]),
    "yolov5l": (46563709, 613, [8, 16, 32]),
    "yolov5x": (86749405, 745, [8, 16, 32]),
    "yolov5n6": (3246940, 459, [8, 16, 32, 64]),
    "yolov5s6": (12626620, 459, [8, 16, 32, 64]),
    "yolov5m6": (35731932, 627, [8, 16, 32, 64]),
    "yolov5l6": (76770172, 795, [8, 16, 32, 64]),
    "yolov5x6": (140794780, 963, [8, 16, 32, 64]),
    "yolov5-p2": (47493372, 711, [4, 8, 16, 32]),
    "yolov5-p6": (76770172, 795, [8, 16, 32, 64]),
    "yolov5-p7": (144281723, 977, [8, 16, 32, 64, 128]),
    "yolov5-p34": (5331518, 311, [8, 16]),
    "yolov5-bifpn": (46825853, 613, [8, 16, 32]),
    "yolov5s-ghost": (3897605, 529, [8, 16, 32]),
    "yolov5s-transformer": (7235645, 348, [8, 16, 32]),
    "yolov5s-LeakyReLU": (7235389, 349, [8, 16, 32]),
    "yolov3-spp": (62998749, 445, [8, 16, 32]),
    "yolov3-tiny": (8852366, 71, [16, 32]),
    "kitchen": (431716, 308, [8, 16, 32]),
}


def spec(name: str) -> dict[str, Any]:
    """The model yaml ``name`` as a fresh mapping (nc 80 unless the entry says otherwise)."""
    (depth, width), anchors, backbone, head, extra = _SPECS[name]
    out = {"nc": 80, "depth_multiple": depth, "width_multiple": width, "anchors": anchors, **extra}
    out.update(backbone=backbone, head=head)
    return copy.deepcopy(out)
