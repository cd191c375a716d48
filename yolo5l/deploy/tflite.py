"""TFLite (LiteRT): write fp32, fp16 (weights) and int8 (weights and activations) files, and run them.

The layout is ultralytics/yolov5 v7.0's TFLite (`export.py::export_tflite`, `models/tf.py::TFDetect`): input
`(B, H, W, 3)` RGB in [0, 1] (NHWC), output `(B, N, 5 + nc)` with cx, cy, w, h as fractions of the input's width and
height, so v7.0's `DetectMultiBackend` scales them back to pixels. The metadata is a zip appended to the file, as
v7.0's export writes it.

Conversion: litert-torch (`litert_torch.convert`: torch.export, then the LiteRT converter; no TensorFlow). fp16 and
int8: ai-edge-quantizer on the fp32 file. int8 keeps the input, the output and the decode in float32 (only the
network's layers are quantized, calibrated on `calib_data=` images): 8 bits over the image's width would move boxes by
pixels, and a float interface reads like the fp32 file's.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from yolo5l.base.console import library_output
from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_write
from yolo5l.deploy._io import append_metadata, read_appended_metadata
from yolo5l.deploy.formats import require_extra
from yolo5l.deploy.graph import StaticDecoded
from yolo5l.models.yolo import YOLOv5

__all__ = ["convert_tflite", "export_tflite", "load_tflite", "quantize_tflite"]

_SIGNATURE = "serving_default"
# The quantized ops: the network's, named after the module path `StaticDecoded.model` (the decode's are not).
_NETWORK_OPS = r".*yolo5l\.models\.yolo\.YOLOv5_model/.*"
# The quantizer's calibration runs LiteRT's interpreter with `experimental_preserve_all_tensors`, which warns that
# the option is for debugging: the quantizer's choice, nothing the user can act on.
_IGNORED = (r"experimental_preserve_all_tensors",)


@contextlib.contextmanager
def _quiet() -> Any:
    """Around LiteRT's converter, quantizer and interpreter: their output as `library_output` shows it (JAX's and
    absl's log lines, the quantizer's bars off a terminal), and litert-torch's progress tree of its passes (on stdout,
    on a terminal too: the export prints its own line) dropped."""
    with library_output(ignore=_IGNORED), contextlib.redirect_stdout(io.StringIO()):
        yield


def _fp16_recipe() -> list[dict[str, Any]]:
    return [
        {
            "regex": ".*", "operation": "*", "algorithm_key": "float_casting",
            "op_config": {"weight_tensor_config": {"num_bits": 16, "dtype": "FLOAT"}, "compute_precision": "FLOAT",
                          "explicit_dequantize": True},
        }
    ]  # fmt: skip


def convert_tflite(model: YOLOv5, batch: int, imgsz: int) -> bytes:
    """The fp32 `.tflite` flatbuffer of `model` (prepared with `yolo5l.exporter.prepare_for_export`, fp32, CPU)."""
    (litert_torch,) = require_extra("format=tflite", "litert_torch", extra="tflite")
    graph = StaticDecoded(model, imgsz, imgsz, channels_last=True, normalized=True).eval()
    example = torch.rand(batch, imgsz, imgsz, 3, generator=torch.Generator().manual_seed(0))
    with _quiet(), torch.no_grad():
        return bytes(litert_torch.convert(graph, (example,)).model_content())


def quantize_tflite(data: bytes, half: bool = False, calibration: list[np.ndarray] | None = None) -> bytes:
    """fp16 weights (`half`) or int8 (`calibration`: (1, 3, H, W) float32 arrays in [0, 1]) from an fp32 file."""
    (aeq,) = require_extra("format=tflite", "ai_edge_quantizer", extra="tflite")
    if calibration is not None:
        from ai_edge_quantizer import qtyping, recipe_manager

        manager = recipe_manager.RecipeManager()
        manager.add_static_config(
            regex=_NETWORK_OPS, operation_name=qtyping.TFLOperationName.ALL_SUPPORTED, activation_num_bits=8,
            weight_num_bits=8, algorithm_key="min_max_uniform_quantize",
        )  # fmt: skip
        quantizer = aeq.Quantizer(bytearray(data), manager.get_quantization_recipe())
        with _quiet():
            detail = _interpreter(data).get_signature_runner(_SIGNATURE).get_input_details()
        (name,) = detail
        batch = int(detail[name]["shape"][0])
        samples = [{name: np.repeat(x.transpose(0, 2, 3, 1), batch, 0)} for x in calibration]
        with _quiet():
            return bytes(quantizer.quantize(quantizer.calibrate({_SIGNATURE: samples})).quantized_model)
    if half:
        quantizer = aeq.Quantizer(bytearray(data), _fp16_recipe())
        with _quiet():
            return bytes(quantizer.quantize().quantized_model)
    return data


def export_tflite(
    model: YOLOv5,
    path: Path,
    meta: dict[str, Any],
    batch: int,
    imgsz: int,
    half: bool = False,
    calibration: list[np.ndarray] | None = None,
) -> Path:
    """Write a `.tflite` file (:func:`convert_tflite`, then :func:`quantize_tflite` for fp16 or int8).

    Args:
        model: The detector, prepared with `yolo5l.exporter.prepare_for_export` (on the CPU, fp32).
        path: The file.
        meta: The metadata, appended to the file as v7.0 appends it.
        batch: The file's batch size.
        imgsz: Its square input size.
        half: fp16 weights.
        calibration: int8: calibration inputs, (1, 3, H, W) float32 arrays in [0, 1]; None for floating point.

    Returns:
        The file.
    """
    data = quantize_tflite(convert_tflite(model, batch, imgsz), half, calibration)
    atomic_write(path, append_metadata(data, meta))
    return path


def _interpreter(model: str | bytes) -> Any:
    (litert,) = require_extra("a .tflite file", "ai_edge_litert.interpreter", extra="tflite")
    kwargs = {"model_path": model} if isinstance(model, str) else {"model_content": model}
    return litert.Interpreter(num_threads=max(1, torch.get_num_threads()), **kwargs)


def load_tflite(path: Path, device: torch.device) -> tuple[Callable[[Tensor], Tensor], dict[str, Any], dict]:
    """Load a `.tflite` file into LiteRT's interpreter (on the CPU).

    Returns:
        `(run, metadata, shape)`: `run(images)` takes (B, 3, H, W) RGB in [0, 1] and gives (B, N, 5 + nc) in pixels;
        the appended metadata; `shape` with the file's `batch` and `size`.

    Raises:
        UserError: The `tflite` extra missing, or a file LiteRT cannot read.
    """
    try:
        with library_output():  # LiteRT's `INFO: Created TensorFlow Lite XNNPACK delegate for CPU.`
            interpreter = _interpreter(os.fspath(path))
            interpreter.allocate_tensors()
    except (ValueError, RuntimeError) as e:
        raise UserError(f"{path}: LiteRT cannot load it ({str(e).strip().splitlines()[0]})") from None
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    b, h, w, _ = (int(d) for d in inp["shape"])

    def quantized(detail: dict) -> tuple[float, int] | None:
        scale, zero = detail["quantization"]
        return (scale, zero) if detail["dtype"] in (np.int8, np.uint8) and scale else None

    q_in, q_out = quantized(inp), quantized(out)

    def run(images: Tensor) -> Tensor:
        x = images.detach().to(device="cpu", dtype=torch.float32).permute(0, 2, 3, 1).contiguous().numpy()
        if q_in:  # ultralytics' int8 files take quantized pixels
            info = np.iinfo(inp["dtype"])
            x = np.clip(np.round(x / q_in[0] + q_in[1]), info.min, info.max).astype(inp["dtype"])
        interpreter.set_tensor(inp["index"], x)
        interpreter.invoke()
        y = interpreter.get_tensor(out["index"])
        y = (y.astype(np.float32) - q_out[1]) * q_out[0] if q_out else y.astype(np.float32, copy=True)
        y[..., :4] *= np.array([w, h, w, h], dtype=np.float32)  # fractions -> pixels
        return torch.from_numpy(y).to(images.device)

    return run, read_appended_metadata(path), {"batch": b, "size": (h, w)}
