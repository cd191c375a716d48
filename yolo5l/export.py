"""Export weights for deployment: `python -m yolo5l.export weights=<weights.pt|yolov5s.pt> [format=onnx|torchscript]`.

`format=[onnx,openvino]` writes several formats in one call (ultralytics/yolov5 v7.0 `export.py --include onnx
openvino`), each named as its own export names it; `imgsz=[480,640]` gives a (height, width) input (ONNX,
TorchScript, OpenVINO, TensorRT).

The file holds the Conv+BN-fused model and its decode: input `images` (B, 3, H, W) RGB in [0, 1], output `output0`
(B, N, 5 + nc) with cx, cy, w, h in input pixels, objectness and class scores, the layout of ultralytics/yolov5
v7.0 `export.py` (`export_onnx`, `export_torchscript`: Detect in export mode), so code written for those files reads
these. Class names, stride and image size are in the file: ONNX `metadata_props` (`names` as a JSON list, `stride`,
`imgsz`, ...), TorchScript `config.txt` (JSON); with `data`, the dataset yaml the weights record, which val defaults
to. The file is written beside the weights (`<stem>.onnx`,
`<stem>.torchscript`) unless `output=` says where, then run on the example input (onnxruntime, `torch.jit.load`)
and compared with PyTorch in one printed line. `yolo5l.deploy.exported.load_exported` runs it again;
`python -m yolo5l.val` and `python -m yolo5l.predict` take it as `weights=`.

ONNX needs the `export` extra (`pip install -e ".[export]"`: onnx, onnxruntime).
"""

from __future__ import annotations

import copy
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

from yolo5l._cli import guarded, run_entry_point, running
from yolo5l.base.console import info, print_outputs
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.hardware import with_command_threads
from yolo5l.config import check_export_config
from yolo5l.deploy.formats import FORMATS, output_paths, parse_formats, require_extra
from yolo5l.deploy.options import export_imgsz
from yolo5l.exporter import DEFAULT_IMGSZ, ExportOptions, check_half, check_mobile_optimizer, export_model

__all__ = ["export_formats", "export_weights"]


def _calibration(cfg: DictConfig, imgsz: int | tuple[int, int]) -> list[np.ndarray] | None:
    if not cfg.int8:
        return None
    from yolo5l.deploy.calibration import calibration_files, calibration_images

    return calibration_images(calibration_files(cfg.calib_data, int(cfg.calib_images)), imgsz)


def _check_can_write(fmt: str, cfg: DictConfig, device: torch.device) -> None:
    """What `fmt` needs on this machine (CUDA, its extra), checked before the weights load."""
    if fmt in ("onnx", "torchscript"):
        check_half(bool(cfg.half), device)
    spec = FORMATS[fmt]
    if fmt == "engine":  # before the extra: without a GPU there is nothing to install it for
        from yolo5l.deploy.tensorrt import check_cuda

        check_cuda(device)
    require_extra(f"format={fmt}", *spec.export_modules, extra=spec.extra)
    if fmt == "torchscript" and cfg.optimize:
        check_mobile_optimizer()


def export_weights(cfg: DictConfig) -> Path:
    """Export as `cfg` (conf/export.yaml) says; returns the file written (the first format's where `format=` lists
    several: :func:`export_formats` returns each)."""
    return next(iter(export_formats(cfg).values()))


@with_command_threads(lambda cfg: str(cfg.device))  # on the CPU: as many threads as cores are free at the start
def export_formats(cfg: DictConfig) -> dict[str, Path]:
    """Export in each format of `cfg.format` (one name or a list, as ultralytics/yolov5 v7.0 `export.py::run`
    takes `include`), one after the other from the same weights, each checked against PyTorch in one printed line.
    Every format's config and needs are checked before the first is written.

    Returns:
        `{format: file or folder written}`, in the order asked.
    """
    from yolo5l.base.hardware import inference_device
    from yolo5l.base.image_size import fit_to_stride
    from yolo5l.io.download import weights_url
    from yolo5l.models.model_source import model_stride
    from yolo5l.models.weights import load_weights, resolve_weights

    check_export_config(cfg)
    formats = parse_formats(cfg.format)
    device = inference_device(str(cfg.device))
    for fmt in formats:
        _check_can_write(fmt, cfg, device)
    weights = resolve_weights(str(cfg.weights))  # a URL or a release name (yolov5s.pt) is downloaded once
    # Beside the weights; a downloaded file's export goes to the current folder, not into the download cache.
    folder = weights.parent if weights_url(str(cfg.weights)) is None else Path.cwd()
    outputs = output_paths(cfg.output or None, folder, weights.stem, formats, bool(cfg.half), bool(cfg.int8))
    for output in outputs.values():
        if output.absolute() == weights.absolute():
            raise UserError(f"output={output} would overwrite the weights: pass another output=")
    try:
        model, load_info = load_weights(weights)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    # The training size where the weights file records one; else YOLOv5's 640.
    size = export_imgsz(cfg.imgsz) or (int(getattr(load_info, "imgsz", None) or DEFAULT_IMGSZ),) * 2
    stride = model_stride(model)  # as v7.0's export.py: a size off the stride is rounded up, with a warning
    size = tuple(fit_to_stride(side, stride, "imgsz") for side in size)
    imgsz = size[0] if size[0] == size[1] else size
    opt = ExportOptions(
        imgsz=imgsz, batch=int(cfg.batch), dynamic=bool(cfg.dynamic), half=bool(cfg.half), int8=bool(cfg.int8),
        calibration=_calibration(cfg, imgsz), opset=int(cfg.opset), simplify=bool(cfg.simplify), nms=bool(cfg.nms),
        conf_thres=float(cfg.conf_thres), iou_thres=float(cfg.iou_thres), max_det=int(cfg.max_det),
        topk_per_class=cfg.get("topk_per_class"), agnostic_nms=bool(cfg.get("agnostic_nms", False)),
        optimize=bool(cfg.optimize), workspace=float(cfg.workspace),
    )  # fmt: skip
    written, sizes = {}, {}
    with running():  # tracing makes cyclic garbage
        for fmt in formats:
            # export_model fuses and casts the model in place: each format starts from the loaded weights.
            source = copy.deepcopy(model) if len(formats) > 1 else model
            path, diff = export_model(
                source, outputs[fmt], fmt, list(load_info.names), device, opt, data=load_info.data
            )
            _report(fmt, diff, f"({opt.batch if fmt != 'ncnn' else 1}, 3, {size[0]}, {size[1]})", cfg)
            files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
            written[fmt], sizes[fmt] = path, sum(f.stat().st_size for f in files)
    print_outputs("Outputs:", {fmt: f"{shown_path(p)} ({sizes[fmt] / 1e6:.1f} MB)" for fmt, p in written.items()})
    return written


def _report(fmt: str, diff: float | None, shape: str, cfg: DictConfig) -> None:
    """The format's line: its runtime's largest difference from PyTorch, or why there is none."""
    if diff is None:
        info(f"{fmt} file written; it does not run on this machine, so it was not compared with PyTorch")
    else:
        precision = "int8" if cfg.int8 else "fp16" if cfg.half else "fp32"
        info(f"{_RUNTIMES[fmt]} vs PyTorch on the example input {shape} {precision}: max abs difference {diff:.3g}")


_RUNTIMES = {
    "onnx": "onnxruntime", "torchscript": "torch.jit", "openvino": "OpenVINO", "tflite": "LiteRT", "ncnn": "ncnn",
    "engine": "TensorRT", "coreml": "Core ML",
}  # fmt: skip


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="export")
@guarded
def _hydra_main(cfg: DictConfig) -> None:
    export_formats(cfg)


def main() -> None:
    """Console entry point (`python -m yolo5l.export`, `yolo5l-export`)."""
    run_entry_point(_hydra_main, "export")


if __name__ == "__main__":
    main()
