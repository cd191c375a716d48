"""Which export options go with which format (`conf/export.yaml`), checked before anything loads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from yolo5l.base.errors import UserError

__all__ = ["SQUARE_FORMATS", "check_format_options", "check_formats_options", "check_image_shape", "export_imgsz"]

INT8_FORMATS = ("openvino", "tflite", "engine", "coreml")
NMS_FORMATS = ("onnx", "coreml")
#: Formats written for one square size: their graphs (`yolo5l.deploy.graph.StaticDecoded`, the ncnn trace, Core ML's
#: box scaling) take `imgsz` as one side.
SQUARE_FORMATS = ("tflite", "ncnn", "coreml")


def export_imgsz(value: Any) -> tuple[int, int] | None:
    """`imgsz=` as (height, width): one size is a square (`640`, `[640]`), two are height and width (`[480,640]`, as
    ultralytics/yolov5 v7.0 `export.py --imgsz h w`); None when unset.

    Raises:
        UserError: Anything else (sizes are checked against the stride elsewhere).
    """
    if value is None:
        return None
    several = isinstance(value, Sequence) and not isinstance(value, str)
    sizes = list(value) if several else [value]
    if not 1 <= len(sizes) <= 2 or any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
        shown = f"[{','.join(map(str, sizes))}]" if several else repr(value)
        raise UserError(f"imgsz={shown} must be one size (imgsz=640) or [height,width] (imgsz=[480,640])")
    return (sizes[0], sizes[-1])


def check_image_shape(fmt: str, size: tuple[int, int]) -> None:
    """Refuse a rectangular (height, width) for the formats written square (`SQUARE_FORMATS`).

    Raises:
        UserError: The size, the format, and the formats that take it.
    """
    if size[0] != size[1] and fmt in SQUARE_FORMATS:
        raise UserError(
            f"imgsz=[{size[0]},{size[1]}]: format={fmt} files are written square; pass one size (imgsz={max(size)}), "
            "or use format=onnx|torchscript|openvino|engine for a rectangular input"
        )


def check_formats_options(cfg: DictConfig, formats: Sequence[str]) -> None:
    """:func:`check_format_options` for each of `formats` (`format=[onnx,openvino]`): every option must go with every
    format listed; a refusal names the format that does not take it.

    Raises:
        UserError: As :func:`check_format_options`, with the hint to export that format on its own.
    """
    for fmt in formats:
        try:
            check_format_options(cfg, fmt)
        except UserError as e:
            if len(formats) == 1:
                raise
            raise UserError(f"{e} (or export format={fmt} in a call of its own)") from None


def check_format_options(cfg: DictConfig, fmt: str) -> None:
    """Refuse options that the format does not take, and out-of-range NMS settings, in one line each.

    Raises:
        UserError: The option, the format, and what to do.
    """
    if cfg.get("simplify") and fmt != "onnx":
        raise UserError(f"simplify=true applies to format=onnx, not format={fmt}: drop simplify=true")
    if cfg.get("int8") and fmt not in INT8_FORMATS:
        raise UserError(f"int8=true applies to format={'|'.join(INT8_FORMATS)}, not format={fmt}: drop int8=true")
    if cfg.get("int8") and cfg.get("half"):
        raise UserError("int8=true and half=true: pick one precision")
    if cfg.get("nms") and fmt not in NMS_FORMATS:
        raise UserError(f"nms=true applies to format=onnx or coreml, not format={fmt}: drop nms=true")
    if cfg.get("optimize") and fmt != "torchscript":
        raise UserError(f"optimize=true applies to format=torchscript, not format={fmt}: drop optimize=true")
    if cfg.get("dynamic") and fmt in ("tflite", "ncnn", "coreml"):
        raise UserError(f"dynamic=true: format={fmt} files take one input size; drop dynamic=true")
    size = export_imgsz(cfg.get("imgsz"))
    if size is not None:
        check_image_shape(fmt, size)
    _check_nms_options(cfg, fmt)
    for key in ("conf_thres", "iou_thres"):
        value = cfg.get(key, 0.5)
        if not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise UserError(f"{key}={value!r} must be a number in [0, 1]")
    max_det = cfg.get("max_det", 1)
    if not isinstance(max_det, int) or max_det < 1:
        raise UserError(f"max_det={max_det!r} must be an integer of at least 1")
    calib = cfg.get("calib_images", 1)
    if not isinstance(calib, int) or calib < 1:
        raise UserError(f"calib_images={calib!r} must be an integer of at least 1")


def _check_nms_options(cfg: DictConfig, fmt: str) -> None:
    """`agnostic_nms` (ONNX and Core ML NMS) and `topk_per_class` (ONNX's), which tune the file's NMS."""
    agnostic, topk = cfg.get("agnostic_nms", False), cfg.get("topk_per_class")
    if not isinstance(agnostic, bool):
        raise UserError(f"agnostic_nms={agnostic!r} must be true or false")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise UserError(f"topk_per_class={topk!r} must be an integer of at least 1, or null (max_det)")
    for key, on in (("agnostic_nms", agnostic), ("topk_per_class", topk is not None)):
        if on and not cfg.get("nms"):
            raise UserError(f"{key} sets the NMS inside the file: add nms=true (format=onnx), or drop {key}")
    if topk is not None and fmt != "onnx":
        raise UserError(f"topk_per_class applies to format=onnx nms=true, not format={fmt}: drop topk_per_class")
    if topk is not None and agnostic:
        raise UserError("topk_per_class caps each class, and agnostic_nms=true makes one class of all: drop one")
