"""Build a detector from a YOLOv5 v7.0 model yaml (``models/*.yaml``, ``models/hub/*.yaml``), and the P6 table.

A model yaml holds ``nc``, ``depth_multiple``, ``width_multiple``, ``anchors`` (pixel (w, h) pairs per level, or a
number of anchors per level that AutoAnchor fits) and two lists of ``[from, number, module, args]`` rows,
``backbone`` then ``head``; optional ``ch`` (input channels) and ``activation`` (e.g. ``nn.LeakyReLU(0.1)``, the
activation of every :class:`~yolo5l.models.common.Conv`). Layer ``i`` is row ``i`` of ``backbone + head``, so the
state-dict keys are ultralytics' (``model.{i}.…``) and a checkpoint of the same yaml loads key for key.

The rules are v7.0's ``models/yolo.py::parse_model``: ``number`` is scaled to ``max(round(n * depth), 1)`` when
above 1 (inside the block for the CSP family, as copies in an ``nn.Sequential`` otherwise); the output channels of
convolution-like blocks to ``ceil(c * width / 8) * 8``; ``Concat`` sums its inputs' channels; ``Contract``/``Expand``
multiply/divide them by gain²; the string arguments ``nc`` and ``anchors`` stand for the yaml's values. The strides
of the Detect inputs are measured, as v7.0 does, by running a 256-pixel input through the layers, here on the
``meta`` device (shapes only: no compute and no change to any BatchNorm statistic).

Reference: ultralytics/yolov5 v7.0 ``models/yolo.py::parse_model`` and ``DetectionModel.__init__``,
``utils/torch_utils.py::initialize_weights``, ``models/hub/yolov5s6.yaml`` (the P6 table).
"""

from __future__ import annotations

import ast
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import yolo5l.models.blocks as blocks
from yolo5l.models.common import BN_EPS, BN_MOMENTUM, C3, SPPF, Bottleneck, Concat, Conv
from yolo5l.models.head import Detect, anchors_to_tensor, make_upsample
from yolo5l.models.p5 import make_divisible, p5_rows, scaled_repeats

__all__ = [
    "ANCHORS_P3_P6",
    "BUILTIN",
    "SCALES_P6",
    "BuiltLayers",
    "build_layers",
    "builtin_name",
    "load_spec",
    "make_divisible",
    "normalize_spec",
    "placeholder_anchors",
    "scaled_repeats",
]

# Default anchors of the P6 family (models/hub/yolov5{n,s,m,l,x}6.yaml): P3/8, P4/16, P5/32, P6/64.
ANCHORS_P3_P6: tuple[tuple[int, ...], ...] = (
    (19, 27, 44, 40, 38, 94),
    (96, 68, 86, 152, 180, 137),
    (140, 301, 303, 264, 238, 542),
    (436, 615, 739, 380, 925, 792),
)
SCALES_P6: dict[str, tuple[float, float]] = {
    "yolov5n6": (0.33, 0.25),
    "yolov5s6": (0.33, 0.50),
    "yolov5m6": (0.67, 0.75),
    "yolov5l6": (1.0, 1.0),
    "yolov5x6": (1.33, 1.25),
}
_UP = ["nn.Upsample", [None, 2, "nearest"]]
# The P6 detector before scaling: a 4th downsample (768 -> 1024 channels) before SPPF, and a 4-level PAN head.
_P6_BACKBONE = [
    [-1, 1, "Conv", [64, 6, 2, 2]], [-1, 1, "Conv", [128, 3, 2]], [-1, 3, "C3", [128]],
    [-1, 1, "Conv", [256, 3, 2]], [-1, 6, "C3", [256]], [-1, 1, "Conv", [512, 3, 2]], [-1, 9, "C3", [512]],
    [-1, 1, "Conv", [768, 3, 2]], [-1, 3, "C3", [768]], [-1, 1, "Conv", [1024, 3, 2]], [-1, 3, "C3", [1024]],
    [-1, 1, "SPPF", [1024, 5]],
]  # fmt: skip
_P6_HEAD = [
    [-1, 1, "Conv", [768, 1, 1]], [-1, 1, *_UP], [[-1, 8], 1, "Concat", [1]], [-1, 3, "C3", [768, False]],
    [-1, 1, "Conv", [512, 1, 1]], [-1, 1, *_UP], [[-1, 6], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [256, 1, 1]], [-1, 1, *_UP], [[-1, 4], 1, "Concat", [1]], [-1, 3, "C3", [256, False]],
    [-1, 1, "Conv", [256, 3, 2]], [[-1, 20], 1, "Concat", [1]], [-1, 3, "C3", [512, False]],
    [-1, 1, "Conv", [512, 3, 2]], [[-1, 16], 1, "Concat", [1]], [-1, 3, "C3", [768, False]],
    [-1, 1, "Conv", [768, 3, 2]], [[-1, 12], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]],
    [[23, 26, 29, 32], 1, "Detect", ["nc", "anchors"]],
]  # fmt: skip
#: Built-in architectures by name (``YOLOv5(cfg="p6")``), in the yaml format; ``p5`` is yolo.py's own table.
BUILTIN: dict[str, dict[str, Any]] = {
    "p6": {
        "nc": 80, "depth_multiple": 0.33, "width_multiple": 0.50, "anchors": [list(a) for a in ANCHORS_P3_P6],
        "backbone": _P6_BACKBONE, "head": _P6_HEAD,
    },
}  # fmt: skip

_MODULES: dict[str, type[nn.Module]] = {
    "Conv": Conv, "C3": C3, "SPPF": SPPF, "Bottleneck": Bottleneck, "Concat": Concat,
    **{name: getattr(blocks, name) for name in blocks.__all__ if name not in ("TransformerLayer", "TransformerBlock")},
    "nn.Upsample": nn.Upsample, "nn.MaxPool2d": nn.MaxPool2d, "nn.ZeroPad2d": nn.ZeroPad2d,
    "nn.BatchNorm2d": nn.BatchNorm2d, "nn.ConvTranspose2d": nn.ConvTranspose2d, "nn.Identity": nn.Identity,
}  # fmt: skip
# Blocks whose first argument is the output channel count (scaled by width) and that take c1 first.
_CHANNEL_BLOCKS = {
    Conv, C3, SPPF, Bottleneck, blocks.GhostConv, blocks.GhostBottleneck, blocks.SPP, blocks.DWConv,
    blocks.MixConv2d, blocks.Focus, blocks.CrossConv, blocks.BottleneckCSP, blocks.C3TR, blocks.C3SPP,
    blocks.C3Ghost, nn.ConvTranspose2d, blocks.DWConvTranspose2d, blocks.C3x,
}  # fmt: skip
# Of those, the ones that repeat their bottleneck `number` times inside one block.
_REPEAT_INSIDE = {blocks.BottleneckCSP, C3, blocks.C3TR, blocks.C3Ghost, blocks.C3x}
_ACTIVATIONS = ("SiLU", "ReLU", "ReLU6", "LeakyReLU", "Hardswish", "Mish", "GELU", "ELU", "Sigmoid", "Tanh", "Identity")
_STRIDE_PROBE = 256  # v7.0 measures the strides on a 256x256 input ("2x min stride")


def _plain(obj: Any) -> Any:
    """Lists, dicts, strings and numbers only (OmegaConf containers and tuples become lists and dicts)."""
    if isinstance(obj, Mapping) or hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) or (hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes, Tensor))):
        return [_plain(v) for v in obj]
    return obj


def normalize_spec(raw: Mapping[str, Any], source: str = "model yaml") -> dict[str, Any]:
    """Check a model-yaml mapping and return a plain-data copy of the keys the builder reads.

    Args:
        raw: The yaml's mapping (or a ``DetectionModel.yaml`` from a checkpoint).
        source: Where it came from, for messages.

    Returns:
        ``{nc, depth_multiple, width_multiple, anchors, backbone, head}`` plus ``ch``/``activation`` when given.

    Raises:
        ValueError: One line naming ``source``, the key or layer, and what is wrong.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: a model yaml is a mapping with backbone and head lists, got {type(raw).__name__}")
    spec = _plain(raw)
    missing = [k for k in ("nc", "depth_multiple", "width_multiple", "anchors", "backbone", "head") if k not in spec]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)} (a YOLOv5 v7.0 model yaml has all of them)")
    for key in ("depth_multiple", "width_multiple"):
        if isinstance(spec[key], bool) or not isinstance(spec[key], (int, float)) or spec[key] <= 0:
            raise ValueError(f"{source}: {key}={spec[key]!r} must be a positive number")
    anchors = spec["anchors"]
    if not (isinstance(anchors, int) and anchors > 0) and not (isinstance(anchors, list) and anchors):
        raise ValueError(f"{source}: anchors must be a list of (w, h) pixel lists per level, or a count per level")
    rows = [*spec["backbone"], *spec["head"]] if isinstance(spec["backbone"], list) else None
    if not rows or not isinstance(spec["head"], list):
        raise ValueError(f"{source}: backbone and head must be lists of [from, number, module, args] rows")
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == 4
        f, n, module, args = row if ok else (None, None, None, None)
        ok = ok and (isinstance(f, int) or (isinstance(f, list) and f and all(isinstance(j, int) for j in f)))
        if not (ok and isinstance(n, int) and n >= 1 and isinstance(module, str) and isinstance(args, list)):
            raise ValueError(f"{source}: layer {i} {row!r} is not a [from, number >= 1, module, [args]] row")
        if module not in _MODULES and module != "Detect":
            raise ValueError(
                f"{source}: layer {i} uses {module!r}, which yolo5l does not build; "
                f"it builds {', '.join([*sorted(_MODULES), 'Detect'])}"
            )
        if (module == "Detect") != (i == len(rows) - 1):
            raise ValueError(f"{source}: layer {i} is {module}; a Detect head must be the last layer, and only there")
    literals = {"None": None, "True": True, "False": False}  # v7.0 evaluates string arguments; the literals among them
    for row in rows:
        row[3] = [literals.get(a, a) if isinstance(a, str) else a for a in row[3]]
    out = {k: spec[k] for k in ("nc", "depth_multiple", "width_multiple", "anchors", "backbone", "head")}
    out.update({k: spec[k] for k in ("ch", "activation") if spec.get(k) is not None})
    if "activation" in out:
        _activation(out["activation"], source)  # checked now, built per Conv later
    return out


def load_spec(cfg: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The normalised spec of a built-in name (``p6``), a model-yaml path, or a mapping (see :func:`normalize_spec`).

    Raises:
        ValueError: Unknown name, unreadable file or invalid content (one line naming the file).
    """
    if isinstance(cfg, Mapping):
        return normalize_spec(cfg)
    text = os.fspath(cfg)
    if text in BUILTIN:
        return normalize_spec(BUILTIN[text], text)
    path = Path(text)
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"model cfg {text!r}: give p5, p6 or the path of a YOLOv5 v7.0 model .yaml")
    if not path.is_file():
        raise ValueError(f"{text}: no such model yaml; give the path of a YOLOv5 v7.0 model .yaml (e.g. yolov5s6.yaml)")
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except yaml.YAMLError as e:
        raise ValueError(f"{text}: not valid YAML ({str(e).splitlines()[0]})") from None
    return normalize_spec(raw if raw is not None else {}, text)


def builtin_name(spec: Mapping[str, Any]) -> str | None:
    """``"p5"`` or ``"p6"`` when the spec's layers are a built-in table (any nc, multiples or anchors), else None."""
    if spec.get("ch", 3) != 3 or spec.get("activation") is not None:
        return None
    rows = json.dumps([*spec["backbone"], *spec["head"]])
    if rows == json.dumps(p5_rows()):
        return "p5"
    return "p6" if rows == json.dumps(_P6_BACKBONE + _P6_HEAD) else None


def _activation(text: Any, source: str) -> type[nn.Module] | tuple[type[nn.Module], list, dict]:
    """Parse ``nn.Name(literal args)`` from the yaml's ``activation`` (no code is evaluated)."""
    try:
        node = ast.parse(str(text), mode="eval").body
        ok = (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ACTIVATIONS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "nn"
        )  # fmt: skip
        if ok:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            return getattr(nn, node.func.attr), args, kwargs
    except (SyntaxError, ValueError):
        pass
    raise ValueError(f"{source}: activation={text!r}; give one of {', '.join(f'nn.{a}()' for a in _ACTIVATIONS)}")


@dataclass
class BuiltLayers:
    """What :func:`build_layers` returns.

    Attributes:
        layers: The modules, layer ``i`` at index ``i``; the last one is the :class:`~yolo5l.models.head.Detect`.
        froms: Per layer: ``-1`` (the previous output), an earlier layer's index, or a tuple of them.
        save: Indices of the layers whose outputs later layers read.
        strides: Stride of each Detect input, in pixels.
        num_classes: Classes of the Detect head.
        depth: The depth multiple used.
        width: The width multiple used.
        ch: Input channels.
    """

    layers: list[nn.Module]
    froms: list[int | tuple[int, ...]]
    save: frozenset[int]
    strides: list[float]
    num_classes: int
    depth: float
    width: float
    ch: int


def _index(j: int, i: int, source: str) -> int:
    """An absolute layer index for ``from`` entry ``j`` of layer ``i`` (-1 kept: the previous output)."""
    if j == -1:
        return -1  # the input at layer 0
    k = j + i if j < 0 else j
    if not 0 <= k < i:
        raise ValueError(f"{source}: layer {i} reads from {j}, which is not an earlier layer")
    return k


def placeholder_anchors(na: int, nl: int) -> Tensor:
    """v7.0's anchors for a yaml that gives only a count (``anchors: 3``): (0, 1), (2, 3), ... on every level, as
    (nl, na, 2) pixels; AutoAnchor fits real ones before training."""
    return torch.arange(na * 2, dtype=torch.float32, device="cpu").view(1, na, 2).repeat(nl, 1, 1)


def _anchor_levels(anchors: Any, nl: int, source: str) -> Tensor:
    """(nl, na, 2) pixel anchors from lists, a tensor, or a count (:func:`placeholder_anchors`)."""
    if isinstance(anchors, Tensor):
        px = anchors.detach().float().cpu().reshape(anchors.shape[0], -1, 2)
    elif isinstance(anchors, int):
        px = placeholder_anchors(anchors, nl)
    else:
        px = anchors_to_tensor(anchors, nl)
    if px.shape[0] != nl:
        raise ValueError(f"{source}: {px.shape[0]} anchor levels for a Detect head with {nl} inputs")
    return px


def build_layers(
    spec: Mapping[str, Any],
    num_classes: int | None = None,
    depth: float | None = None,
    width: float | None = None,
    anchors: Any = None,
    fused_upsample: bool = False,
    source: str = "model yaml",
) -> BuiltLayers:
    """Build the layers a normalised spec describes (see the module docstring for the rules).

    Args:
        spec: From :func:`normalize_spec` / :func:`load_spec`.
        num_classes: Classes; None keeps the spec's ``nc``.
        depth: Depth multiple; None keeps the spec's.
        width: Width multiple; None keeps the spec's.
        anchors: Pixel anchors per level (lists, or an (nl, na, 2) tensor); None keeps the spec's.
        fused_upsample: Build ``nn.Upsample(None, 2, 'nearest')`` rows as ``yolo5l_kernels.upsample``'s module.
        source: Where the spec came from, for messages.

    Returns:
        The layers, their inputs and the measured strides.

    Raises:
        ValueError: A row that cannot be built (one line naming ``source`` and the layer).
    """
    nc = int(spec["nc"] if num_classes is None else num_classes)
    gd = float(spec["depth_multiple"] if depth is None else depth)
    gw = float(spec["width_multiple"] if width is None else width)
    anchors = spec["anchors"] if anchors is None else anchors
    ch_in = int(spec.get("ch", 3))
    if isinstance(anchors, int):
        na = anchors
    elif isinstance(anchors, Tensor):
        na = int(anchors.reshape(anchors.shape[0], -1).shape[1]) // 2
    else:
        first = list(anchors[0]) if anchors and isinstance(anchors[0], (list, tuple)) else []
        na = len(first) if first and isinstance(first[0], (list, tuple)) else len(first) // 2 or None
    act = _activation(spec["activation"], source) if "activation" in spec else None
    rows = [*spec["backbone"], *spec["head"]]
    layers: list[nn.Module] = []
    froms: list[int | tuple[int, ...]] = []
    ch: list[int] = []  # output channels per layer

    def c_of(j: int, i: int) -> int:
        return (ch[-1] if i else ch_in) if j == -1 else ch[j]

    for i, (f_raw, n, name, args_raw) in enumerate(rows):
        f = _index(f_raw, i, source) if isinstance(f_raw, int) else tuple(_index(j, i, source) for j in f_raw)
        where = f"{source}: layer {i} ({name} {args_raw})"
        names = {"nc": nc, "anchors": anchors}  # the yaml's own values by name, as v7.0's eval finds them
        args = [names.get(a, a) if isinstance(a, str) else a for a in args_raw]
        n = scaled_repeats(n, gd)
        if name == "Detect":
            if not isinstance(f, tuple):
                f = (f,)
            level_anchors = args[1] if len(args) > 1 else anchors
            px = _anchor_levels(level_anchors, len(f), source)
            na = px.shape[1]
            layers.append(_DetectPending(int(args[0]) if args else nc, px, [c_of(j, i) for j in f]))
            froms.append(f)
            ch.append(0)
            continue
        block = _MODULES[name]
        if isinstance(f, tuple) and block is not Concat:
            raise ValueError(f"{where}: only Concat and Detect read from several layers")
        try:
            if block in _CHANNEL_BLOCKS:
                c1, c2 = c_of(f, i), args[0]
                if na is None or c2 != na * (nc + 5):  # a conv sized as the Detect output keeps its channels
                    c2 = make_divisible(c2 * gw)
                args = [c1, c2, *args[1:]]
                if block in _REPEAT_INSIDE:
                    args.insert(2, n)
                    n = 1
            elif block is nn.BatchNorm2d:
                args, c2 = [c_of(f, i)], c_of(f, i)
            elif block is Concat:
                c2 = sum(c_of(j, i) for j in (f if isinstance(f, tuple) else (f,)))
            elif block is blocks.Contract:
                c2 = c_of(f, i) * int(args[0] if args else 2) ** 2
            elif block is blocks.Expand:
                c2 = c_of(f, i) // int(args[0] if args else 2) ** 2
            else:
                c2 = c_of(f, i)
            if block is nn.Upsample and args in ([None, 2, "nearest"], [None, 2.0, "nearest"]) and n == 1:
                module: nn.Module = make_upsample(fused_upsample)
            else:
                module = nn.Sequential(*(block(*args) for _ in range(n))) if n > 1 else block(*args)
        except (TypeError, ValueError, IndexError, RuntimeError) as e:
            raise ValueError(f"{where}: cannot be built ({type(e).__name__}: {e})") from None
        layers.append(module)
        froms.append(f)
        ch.append(int(c2))

    save = frozenset(j for f in froms for j in ((f,) if isinstance(f, int) else f) if j != -1)
    _init_like_v7(layers, act)
    pending = layers[-1]
    assert isinstance(pending, _DetectPending)
    detect_from = froms[-1]
    assert isinstance(detect_from, tuple)
    strides = _measure_strides(layers[:-1], froms[:-1], save, ch_in, detect_from, source)
    layers[-1] = Detect(pending.nc, pending.anchors, pending.ch, strides)
    return BuiltLayers(layers, froms, save, strides, pending.nc, gd, gw, ch_in)


class _DetectPending(nn.Module):
    """The Detect row until the strides of its inputs are measured."""

    def __init__(self, nc: int, anchors: Tensor, ch: list[int]) -> None:
        super().__init__()
        self.nc, self.anchors, self.ch = nc, anchors, ch


def _init_like_v7(layers: Sequence[nn.Module], act: Any) -> None:
    """v7.0's ``initialize_weights`` (BatchNorm eps 1e-3, momentum 0.03) and the yaml's ``activation`` in every Conv
    that has the default SiLU."""
    for module in itertools.chain.from_iterable(m.modules() for m in layers):
        if isinstance(module, nn.BatchNorm2d):
            module.eps, module.momentum = BN_EPS, BN_MOMENTUM
        elif isinstance(module, Conv) and act is not None and isinstance(module.act, nn.SiLU):
            cls, args, kwargs = act
            module.act = cls(*args, **kwargs)


class _Trunk(nn.Module):
    def __init__(self, layers: Sequence[nn.Module], froms: Sequence[Any], save: frozenset[int], out: tuple[int, ...]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.froms, self.save, self.out = list(froms), save, out

    def forward(self, x: Tensor) -> list[Tensor]:
        saved: dict[int, Tensor] = {}
        for i, (f, m) in enumerate(zip(self.froms, self.layers, strict=True)):
            if f != -1:
                x = saved[f] if isinstance(f, int) else [x if j == -1 else saved[j] for j in f]
            x = m(x)
            if i in self.save or i in self.out:
                saved[i] = x
        return [x if j == -1 else saved[j] for j in self.out]


def _measure_strides(
    layers: Sequence[nn.Module], froms: Sequence[Any], save: frozenset[int], ch: int, out: tuple[int, ...], source: str
) -> list[float]:
    """Strides of the Detect inputs: a (1, ch, 256, 256) input run on the meta device (shapes only)."""
    trunk = _Trunk(layers, froms, save, out)
    meta = {
        k: torch.empty_like(v, device="meta")
        for k, v in itertools.chain(trunk.named_parameters(), trunk.named_buffers())
    }
    was_training = trunk.training
    trunk.eval()
    try:
        with torch.no_grad():
            x = torch.zeros(1, ch, _STRIDE_PROBE, _STRIDE_PROBE, device="meta")
            feats = torch.func.functional_call(trunk, meta, (x,), strict=False)
    except (RuntimeError, ValueError, IndexError) as e:
        raise ValueError(
            f"{source}: the layers do not fit together ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None
    finally:
        trunk.train(was_training)
    return [_STRIDE_PROBE / float(t.shape[-2]) for t in feats]
