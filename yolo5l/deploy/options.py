"""Which export options go with which format (`conf/export.yaml`), checked before anything loads."""

from __future__ import annotations

from omegaconf import DictConfig

from yolo5l.base.errors import UserError

__all__ = ["check_format_options"]

INT8_FORMATS = ("openvino", "tflite", "engine", "coreml")
NMS_FORMATS = ("onnx", "coreml")


def check_format_options(cfg: DictConfig, fmt: str) -> None:
    """Refuse options that the format does not take, and out-of-range NMS settings, in one line each.

    Raises:
        UserError: The option, the format, and what to do.
    """
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
