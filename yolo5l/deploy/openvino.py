"""OpenVINO IR: write (fp32, fp16 weights, int8 by NNCF post-training quantization) and run.

The model is exported to ONNX first (what ultralytics/yolov5 v7.0 `export.py::export_openvino` converts) and
converted with `openvino.convert_model`; the folder holds `<stem>.xml`, `<stem>.bin` and `<stem>.yaml`, the metadata
v7.0's `DetectMultiBackend` reads (stride, names). int8: NNCF's `quantize` calibrated on `calib_data=` images,
with the decode (the sigmoid, multiplications, additions, powers and concatenations after the last convolutions) kept in
floating point, since 8 bits over the image's width would move the boxes by pixels.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from yolo5l.base.console import library_output
from yolo5l.base.errors import UserError
from yolo5l.deploy._io import atomic_folder, write_yaml
from yolo5l.deploy.formats import require_extra

__all__ = ["export_openvino", "load_openvino"]

# The decode's element-wise operations: NNCF would put int8 fake-quantizers on their inputs.
_FLOAT_TYPES = ["Sigmoid", "Multiply", "Add", "Subtract", "Power", "Concat"]


def export_openvino(
    onnx_bytes: bytes,
    folder: Path,
    meta: dict[str, Any],
    half: bool = False,
    calibration: list[np.ndarray] | None = None,
) -> Path:
    """Convert an ONNX model to an OpenVINO IR folder.

    Args:
        onnx_bytes: The ONNX model (yolo5l's export: `images` -> `output0`).
        folder: The folder to write (`<stem>_openvino_model`).
        meta: The metadata (names, stride, imgsz, ...), written as `<stem>.yaml`.
        half: Store the weights as fp16.
        calibration: int8: the calibration inputs, (1, 3, H, W) float32 arrays; None for floating point.

    Returns:
        The folder.
    """
    (ov,) = require_extra("format=openvino", "openvino", extra="openvino")
    stem = folder.name.removesuffix("_openvino_model") or "model"
    # library_output: NNCF's progress bars off a terminal, torch's note on CUDA_HOME when NNCF imports its extension
    # builder, OpenVINO's own lines in yolo5l's form.
    with atomic_folder(folder) as tmp, library_output():
        source = tmp / "source.onnx"  # convert_model reads a file; removed before the folder is renamed
        source.write_bytes(onnx_bytes)
        model = ov.convert_model(str(source))
        source.unlink()
        if calibration is not None:
            (nncf,) = require_extra("format=openvino int8=true", "nncf", extra="openvino")
            nncf.set_log_level(logging.ERROR)  # its INFO lines list every operation it leaves in float
            model = nncf.quantize(
                model, nncf.Dataset(calibration), preset=nncf.QuantizationPreset.MIXED,
                subset_size=len(calibration), ignored_scope=nncf.IgnoredScope(types=_FLOAT_TYPES, validate=False),
            )  # fmt: skip
        for key, value in meta.items():  # also inside the IR (rt_info), for readers that have only the .xml
            model.set_rt_info(value if isinstance(value, str) else json.dumps(value), ["model_info", key])
        ov.save_model(model, str(tmp / f"{stem}.xml"), compress_to_fp16=half)
        write_yaml(tmp / f"{stem}.yaml", meta)
    return folder


def _xml(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.xml"))
    if not found:
        raise UserError(f"{path}: no OpenVINO .xml in this folder (export with format=openvino)")
    return found[0]


def load_openvino(path: Path, device: torch.device) -> tuple[Callable[[Tensor], Tensor], dict[str, Any], dict]:
    """Compile an OpenVINO IR for the CPU.

    Args:
        path: The folder (or its `.xml`).
        device: Where the outputs go (OpenVINO runs on the CPU here).

    Returns:
        `(run, metadata, shape)`: `run(images)` -> (B, N, 5 + nc) float32; the metadata from `<stem>.yaml`;
        `shape` with the input's fixed `batch` and `size` (None where dynamic).
    """
    import yaml

    (ov,) = require_extra(f"{path.name} (OpenVINO)", "openvino", extra="openvino")
    xml = _xml(path)
    core = ov.Core()
    try:
        model = core.read_model(str(xml))
        # f32: the CPU plugin would otherwise compute in bf16 on CPUs that have it (boxes off by pixels).
        # threads: the command's count (the cores free at its start), as torch's
        config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
        compiled = core.compile_model(model, "CPU", config)
    except RuntimeError as e:
        raise UserError(f"{xml}: OpenVINO cannot load it ({str(e).strip().splitlines()[0]})") from None
    meta_file = xml.with_suffix(".yaml")
    meta = yaml.safe_load(meta_file.read_text()) if meta_file.is_file() else {}
    pshape = model.inputs[0].get_partial_shape()
    dims = [d.get_length() if d.is_static else None for d in pshape]
    shape = {"batch": dims[0], "size": (dims[2], dims[3]) if dims[2] and dims[3] else None}
    request = compiled.create_infer_request()

    def run(images: Tensor) -> Tensor:
        x = images.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        y = request.infer({0: x})[compiled.outputs[0]]
        return torch.from_numpy(np.array(y)).to(device=images.device, dtype=torch.float32)

    return run, meta, shape
