"""The export of one model to one format: `export_model` (the fused model and its decode, `DecodedYOLOv5`, written
in ultralytics/yolov5 v7.0 `export.py`'s layout, run again in its runtime and compared with PyTorch) and
`ExportOptions`. `python -m yolo5l.export` (`yolo5l.export`) and the formats benchmark (`yolo5l.benchmark`) call it.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_write
from yolo5l.deploy.exported import load_exported
from yolo5l.deploy.formats import FORMATS, NOT_WRITTEN, require_extra
from yolo5l.deploy.options import check_image_shape, export_imgsz
from yolo5l.models.common import Conv
from yolo5l.models.yolo import YOLOv5
from yolo5l.training.divergence import first_non_finite

__all__ = [
    "INPUT_NAME",
    "OUTPUT_NAME",
    "DecodedYOLOv5",
    "ExportOptions",
    "export_model",
    "prepare_for_export",
    "xnnpack_enabled",
]

DEFAULT_IMGSZ = 640
INPUT_NAME, OUTPUT_NAME = "images", "output0"  # ultralytics v7.0 export_onnx's names


class DecodedYOLOv5(nn.Module):
    """`YOLOv5` and its decode as one module, what an exported file computes: images -> (B, N, 5 + nc) in pixels.

    Args:
        model: The detector, prepared with :func:`prepare_for_export`.
    """

    def __init__(self, model: YOLOv5) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model.decode(self.model(images))


def prepare_for_export(model: YOLOv5) -> YOLOv5:
    """Fuse Conv+BN, switch to eval mode, and take the training-only kernels out of the graph (in place).

    `fused_bn_act` (the `torch.ops.yolo5l.bn_silu_*` custom operators) runs only for a BatchNorm in training, and
    `fused_upsample` (`yolo5l_kernels.upsample`, Triton on CUDA) is an autograd function: neither has an ONNX form
    nor belongs in a TorchScript file, so both are switched off and the upsamples become `nn.Upsample`, which
    computes the same nearest 2x.

    Returns:
        `model`.
    """
    model.eval().requires_grad_(False).fuse()
    model.fused_bn_act = model.fused_upsample = False
    for m in model.modules():
        if isinstance(m, Conv):
            m.fused_bn_act = False
    model.plain_upsample()
    # A grid cached by an earlier forward would enter the trace as a constant of that size (and break dynamic axes);
    # built during the trace, it is recorded as arange ops on the input's size.
    model.detect._grids.clear()
    return model


def check_half(half: bool, device: torch.device) -> None:
    # ultralytics v7.0 export.py refuses --half off the GPU too: fp16 convolutions are for CUDA devices.
    if half and device.type != "cuda":
        raise UserError(f"half=true needs a CUDA device (device=cuda), not {device}: drop half=true to export fp32")


def _metadata(
    names: list[str], stride: int, imgsz: int | list[int], batch: int, dynamic: bool, half: bool, device: torch.device
) -> dict[str, Any]:
    return {
        "names": names,
        "stride": stride,
        "imgsz": imgsz,  # the square size, or [height, width]
        "batch": batch,
        "dynamic": dynamic,
        "half": half,
        "device": device.type,  # where it was traced: TorchScript keeps the device of the decode's grids
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
        "layout": "images (B, 3, H, W) RGB 0-1 -> (B, N, 5 + nc): cx, cy, w, h (pixels), objectness, class scores",
        "producer": "yolo5l",
    }


def _export_onnx(net: nn.Module, example: Tensor, opset: int, dynamic: bool, simplify: bool, meta: dict) -> bytes:
    (onnx,) = require_extra("format=onnx", "onnx")
    # ultralytics v7.0 export_onnx: dynamic axes are batch, height and width of `images`, batch and anchors of
    # `output0`; constant folding on.
    axes = {INPUT_NAME: {0: "batch", 2: "height", 3: "width"}, OUTPUT_NAME: {0: "batch", 1: "anchors"}}
    outputs = [OUTPUT_NAME]
    if meta.get("nms"):  # yolo5l.deploy.onnx_nms.EndToEnd: boxes, scores, classes, count
        from yolo5l.deploy.onnx_nms import OUTPUT_NAMES

        outputs = list(OUTPUT_NAMES)
        axes = {INPUT_NAME: axes[INPUT_NAME], **{name: {0: "batch"} for name in outputs}}
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The TorchScript-based exporter (dynamo=False): it needs no onnxscript and traces the decode's sizes;
        # its warnings are about the trace (the stride check in YOLOv5.forward) and its own deprecation.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # Its caution that negative indices would index wrongly: the in-graph NMS indexes with NonMaxSuppression's
        # selections, which are never negative.
        warnings.filterwarnings("ignore", "Exporting aten::index operator", UserWarning)
        torch.onnx.export(
            net, (example,), buffer, opset_version=opset, dynamo=False, do_constant_folding=True,
            input_names=[INPUT_NAME], output_names=outputs, dynamic_axes=axes if dynamic else None,
        )  # fmt: skip
    proto = onnx.load_from_string(buffer.getvalue())
    if simplify:
        try:
            import onnxsim
        except ImportError:
            raise UserError("simplify=true needs onnx-simplifier: pip install onnxsim") from None
        proto, ok = onnxsim.simplify(proto)
        if not ok:
            raise UserError("onnx-simplifier could not check its result: export with simplify=false")
    for key, value in meta.items():
        prop = proto.metadata_props.add()
        prop.key, prop.value = key, value if isinstance(value, str) else json.dumps(value)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def xnnpack_enabled() -> bool:
    """Whether this PyTorch has XNNPACK, which `optimize_for_mobile` (optimize=true) needs."""
    import torch.backends.xnnpack

    return bool(torch.backends.xnnpack.enabled)


def check_mobile_optimizer() -> None:
    if not xnnpack_enabled():
        raise UserError(
            "optimize=true needs a PyTorch built with XNNPACK (torch.backends.xnnpack.enabled is False in this one): "
            "export without optimize=true, or with a PyTorch wheel that has XNNPACK"
        )


def _export_torchscript(net: nn.Module, example: Tensor, meta: dict, optimize: bool = False) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        # check_trace=False: it would trace a second time to compare; the file is compared with PyTorch after it is
        # written instead.
        traced = torch.jit.trace(net, example, strict=False, check_trace=False)
        buffer = io.BytesIO()
        # ultralytics v7.0 export_torchscript: the metadata as JSON in the archive's extra file config.txt.
        extra = {"config.txt": json.dumps({**meta, "shape": list(example.shape), "optimize": optimize})}
        if optimize:  # v7.0 export_torchscript(optimize=True): mobile passes, saved for the lite interpreter
            from torch.utils.mobile_optimizer import optimize_for_mobile

            check_mobile_optimizer()
            optimize_for_mobile(traced)._save_for_lite_interpreter(buffer, _extra_files=extra)
        else:
            torch.jit.save(traced, buffer, _extra_files=extra)
    return buffer.getvalue()


@dataclass
class ExportOptions:
    """What `export_model` writes beyond the format (conf/export.yaml's keys of the same names).

    Attributes:
        imgsz: Size of the example input (fixed-size formats: the file's size): a square's side, or (height,
            width) for ONNX, TorchScript, OpenVINO and TensorRT.
        batch: Batch of the example input (the file's batch unless dynamic).
        dynamic: ONNX / OpenVINO / TensorRT: dynamic batch, height and width (TorchScript takes any size anyway).
        half: fp16: ONNX, TorchScript and TensorRT compute in fp16 (CUDA); OpenVINO, TFLite, ncnn and CoreML store
            fp16 weights (any device).
        int8: int8 post-training quantization (OpenVINO, TFLite, TensorRT, CoreML weights), calibrated on
            `calibration`.
        calibration: int8 calibration inputs, (1, 3, imgsz, imgsz) float32 arrays in [0, 1].
        opset: ONNX opset.
        simplify: ONNX: run onnx-simplifier.
        nms: ONNX: NMS inside the graph (boxes, scores, classes, count); CoreML: an NMS pipeline.
        conf_thres: The in-graph NMS's score threshold.
        iou_thres: Its IoU threshold.
        max_det: Its detections per image.
        topk_per_class: ONNX's in-graph NMS: boxes kept per class (None: max_det).
        agnostic_nms: The in-graph NMS (ONNX, CoreML) ignores classes: boxes of any classes suppress each other.
        optimize: TorchScript: mobile-optimised (`torch.utils.mobile_optimizer`), saved for the lite interpreter.
        workspace: TensorRT: builder workspace in GiB.
    """

    imgsz: int | tuple[int, int] = DEFAULT_IMGSZ
    batch: int = 1
    dynamic: bool = False
    half: bool = False
    int8: bool = False
    calibration: list[np.ndarray] | None = None
    opset: int = 17
    simplify: bool = False
    nms: bool = False
    conf_thres: float = 0.25
    iou_thres: float = 0.45
    max_det: int = 300
    topk_per_class: int | None = None
    agnostic_nms: bool = False
    optimize: bool = False
    workspace: float = 4.0


@torch.no_grad()
def export_model(
    model: YOLOv5,
    path: str | os.PathLike[str],
    fmt: str = "onnx",
    names: list[str] | None = None,
    device: str | torch.device = "cpu",
    options: ExportOptions | None = None,
    *,
    data: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> tuple[Path, float | None]:
    """Export `model` (fused and prepared here, in place) and check the file against PyTorch.

    Args:
        model: The detector.
        path: The file (or folder: OpenVINO, ncnn) to write.
        fmt: One of `yolo5l.deploy.formats.FORMATS`.
        names: Class names (default `"0"`, `"1"`, ...).
        device: Where the model is traced (and where the file is checked).
        options: What to write (:class:`ExportOptions`); `overrides` replace its fields
            (`export_model(m, "m.onnx", imgsz=320, dynamic=True)`).
        data: The dataset yaml the weights were trained on (`LoadInfo.data`), written as the metadata's `data` entry
            (none without it) so that val of the file defaults to it as it does for the .pt.

    Returns:
        `(path, largest absolute difference between the file's output and PyTorch's on the example input)`; the
        difference is None for a format that does not run on this machine (CoreML off macOS).

    Raises:
        UserError: A format yolo5l does not write (`yolo5l.deploy.formats.NOT_WRITTEN`), fp16 off CUDA for ONNX /
            TorchScript, a rectangular size for a square-only format, a missing extra, or a converter's failure.
        ValueError: An unknown format.
    """
    if fmt in NOT_WRITTEN:
        raise UserError(f"format={fmt}: {NOT_WRITTEN[fmt]}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    opt = replace(options or ExportOptions(), **overrides)
    height, width = export_imgsz(opt.imgsz) or (DEFAULT_IMGSZ, DEFAULT_IMGSZ)
    check_image_shape(fmt, (height, width))
    opt = replace(opt, imgsz=height if height == width else (height, width))  # the square formats get an int
    device = torch.device(device)
    if fmt in ("onnx", "torchscript"):
        check_half(opt.half, device)
    spec = FORMATS[fmt]
    require_extra(f"format={fmt}", *spec.export_modules, extra=spec.extra)  # before the work, not after it
    names = [str(i) for i in range(model.num_classes)] if names is None else [str(n) for n in names]
    net = DecodedYOLOv5(prepare_for_export(model)).to(device)
    cuda_half = opt.half and fmt in ("onnx", "torchscript")
    dtype = torch.float16 if cuda_half else torch.float32
    net = net.to(dtype)
    bad = first_non_finite(net.state_dict().items())
    if bad is not None:  # an exported file never holds NaN or inf (weights beyond fp16's range turn inf in half)
        why = "in fp16: export in fp32 (drop half=true)" if cuda_half else "(a diverged run?)"
        raise UserError(f"not exporting {os.fspath(path)}: {bad} holds NaN or inf {why}")
    # Not ultralytics' zeros: random pixels make the check below compare every output, not mostly constant ones.
    shape = (opt.batch if fmt != "ncnn" else 1, 3, height, width)
    example = torch.rand(*shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    if opt.nms and fmt == "onnx":
        from yolo5l.deploy.onnx_nms import EndToEnd, as_decoded

        net = EndToEnd(net, opt.conf_thres, opt.iou_thres, opt.max_det, opt.topk_per_class, opt.agnostic_nms)
        boxes, scores, classes, _ = net(example)
        expected = as_decoded(boxes, scores, classes, len(names))
    else:
        expected = net(example).float()
    imgsz = opt.imgsz if isinstance(opt.imgsz, int) else [height, width]
    meta = _metadata(names, int(model.stride.max()), imgsz, shape[0], _dynamic(fmt, opt), opt.half, device)
    meta.update(task="detect", format=fmt, int8=opt.int8, nms=opt.nms and fmt in ("onnx", "coreml"))
    if meta["nms"]:
        meta["agnostic_nms"] = opt.agnostic_nms
        if fmt == "onnx":
            meta["topk_per_class"] = opt.topk_per_class or opt.max_det
    if data:  # not a v7.0 key: its DetectMultiBackend reads stride and names and ignores the rest
        meta["data"] = os.fspath(data)
    path = Path(path)
    _write_format(fmt, net, model, example, path, meta, opt)
    model.detect._grids.clear()  # the eager run above cached grids; leave the model as prepare_for_export did
    if not spec.runs_on_cpu and device.type == "cpu":
        return path, None
    exported, *_ = load_exported(path, device)
    got = exported(example).to(expected.device)
    if opt.nms and fmt == "onnx":  # detections of equal score may come in another order
        got, expected = _canonical(got), _canonical(expected)
    diff = float((got - expected).abs().max()) if got.numel() else 0.0
    return path, diff


def _canonical(rows: Tensor) -> Tensor:
    """Each image's rows sorted by their rounded values (score first): an order-free form of NMS output."""
    out = []
    for image in rows.cpu().numpy():
        key = np.round(image[:, [4, *range(5, image.shape[1]), 0, 1, 2, 3]], 3)
        out.append(torch.from_numpy(image[np.lexsort(key.T[::-1])]))
    return torch.stack(out).to(rows.device)


def _dynamic(fmt: str, opt: ExportOptions) -> bool:
    return fmt == "torchscript" or (opt.dynamic and fmt in ("onnx", "openvino", "engine"))


def _write_format(
    fmt: str, net: nn.Module, model: YOLOv5, example: Tensor, path: Path, meta: dict, opt: ExportOptions
) -> None:
    """Write `path` in `fmt` (see :func:`export_model`)."""
    int8 = opt.calibration if opt.int8 else None
    if fmt == "torchscript":
        atomic_write(path, _export_torchscript(net, example, meta, opt.optimize))
    elif fmt == "onnx":
        atomic_write(path, _export_onnx(net, example, opt.opset, opt.dynamic, opt.simplify, meta))
    elif fmt == "openvino":
        from yolo5l.deploy.openvino import export_openvino

        onnx_bytes = _export_onnx(net, example, opt.opset, opt.dynamic, False, meta)
        export_openvino(onnx_bytes, path, meta, half=opt.half, calibration=int8)
    elif fmt == "tflite":
        from yolo5l.deploy.tflite import export_tflite

        export_tflite(model.float().cpu(), path, meta, opt.batch, opt.imgsz, half=opt.half, calibration=int8)
    elif fmt == "ncnn":
        from yolo5l.deploy.ncnn import export_ncnn

        export_ncnn(net.float().cpu(), path, meta, opt.imgsz, half=opt.half)
    elif fmt == "coreml":
        from yolo5l.deploy.coreml import export_coreml
        from yolo5l.deploy.graph import StaticDecoded

        static = StaticDecoded(model.float().cpu(), opt.imgsz, opt.imgsz)
        export_coreml(static, path, meta, example.float().cpu(), opt)
    else:
        from yolo5l.deploy.tensorrt import export_engine

        onnx_bytes = _export_onnx(net, example, opt.opset, opt.dynamic, False, meta)
        export_engine(onnx_bytes, path, meta, example, opt, calibration=int8)
