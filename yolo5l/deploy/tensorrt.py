"""TensorRT (`format=engine`): build an engine from the ONNX export (fp32, fp16, int8 with calibration) and run it.

Built as ultralytics/yolov5 v7.0 `export.py::export_engine` builds it: the ONNX graph parsed into an explicit-batch
network, an optimisation profile from batch 1 to the export batch when `dynamic=true`, the FP16 flag with
`half=true`; int8 adds the INT8 flag and an entropy calibrator fed the letterboxed images of `calib_data=`
(:class:`CalibrationBatches`). An engine is built for the GPU it runs on: building and running need CUDA. The metadata
(names, stride, imgsz, ...) is written beside the engine as `<stem>.yaml`, since the engine file has no place for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from yolo5l.base.console import library_output
from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_write
from yolo5l.deploy._io import write_yaml
from yolo5l.deploy.formats import require_extra

__all__ = ["CalibrationBatches", "check_cuda", "export_engine", "load_engine"]


def check_cuda(device: torch.device) -> None:
    """Refuse in one line when there is no CUDA device to build or run an engine on.

    Raises:
        UserError: No CUDA, or a CPU device asked for.
    """
    if not torch.cuda.is_available():
        raise UserError(
            "format=engine needs a CUDA GPU (TensorRT builds for the GPU it runs on); this machine has none"
        )
    if device.type != "cuda":
        raise UserError(f"format=engine builds on the GPU: pass device=cuda, not device={device}")


class CalibrationBatches:
    """The int8 calibration images as batches of the engine's input shape, contiguous float32 (B, 3, H, W).

    The last batch is filled with the first images again so that every batch has the engine's batch size.

    Args:
        images: (1, 3, H, W) float32 arrays in [0, 1] (`yolo5l.deploy.calibration.calibration_images`).
        batch: The engine's batch size.
    """

    def __init__(self, images: list[np.ndarray], batch: int) -> None:
        if not images:
            raise UserError("int8=true: no calibration images")
        self.images, self.batch = images, batch

    def __len__(self) -> int:
        return -(-len(self.images) // self.batch)

    def __iter__(self) -> Iterator[np.ndarray]:
        n = len(self.images)
        for start in range(0, n, self.batch):
            idx = [(start + k) % n for k in range(self.batch)]
            yield np.ascontiguousarray(np.concatenate([self.images[i] for i in idx]), dtype=np.float32)


def _calibrator(trt: Any, batches: CalibrationBatches, cache: Path) -> Any:
    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            super().__init__()
            self.it, self.device_batch = iter(batches), None

        def get_batch_size(self) -> int:
            return batches.batch

        def get_batch(self, names: list[str]) -> list[int] | None:
            x = next(self.it, None)
            if x is None:
                return None
            self.device_batch = torch.from_numpy(x).cuda()
            return [int(self.device_batch.data_ptr())]

        def read_calibration_cache(self) -> bytes | None:
            return cache.read_bytes() if cache.is_file() else None

        def write_calibration_cache(self, data: bytes) -> None:
            cache.write_bytes(bytes(data))

    return EntropyCalibrator()


def export_engine(
    onnx_bytes: bytes,
    path: Path,
    meta: dict[str, Any],
    example: Tensor,
    opt: Any,
    calibration: list[np.ndarray] | None = None,
) -> Path:
    """Build a TensorRT engine from yolo5l's ONNX export and write it, with `<stem>.yaml` beside it.

    Args:
        onnx_bytes: The ONNX model.
        path: The `.engine` file.
        meta: The metadata.
        example: The example input (its shape is the engine's, or the profile's largest when dynamic).
        opt: `yolo5l.exporter.ExportOptions` (half, dynamic, workspace).
        calibration: int8 calibration inputs; None for floating point.

    Returns:
        `path`.
    """
    (trt,) = require_extra("format=engine", "tensorrt", extra="tensorrt")
    check_cuda(example.device)
    # TensorRT's log (warnings and errors) as yolo5l's `warning: ...` lines, printed before an error that follows.
    with library_output():
        engine = _build(trt, onnx_bytes, path, example, opt, calibration)
    if engine is None:
        raise UserError("format=engine: TensorRT could not build the engine (its log above says why)")
    atomic_write(path, bytes(engine))
    write_yaml(path.with_suffix(".yaml"), meta)
    return path


def _build(trt: Any, onnx_bytes: bytes, path: Path, example: Tensor, opt: Any, calibration: list | None) -> Any:
    """The serialized engine of :func:`export_engine` (None where TensorRT could not build it)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch (the only mode of TensorRT 10)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"format=engine: TensorRT cannot parse the ONNX graph ({errors})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opt.workspace * (1 << 30)))
    shape = tuple(example.shape)
    if opt.dynamic:
        profile = builder.create_optimization_profile()
        inp = network.get_input(0)
        profile.set_shape(inp.name, (1, *shape[1:]), (max(1, shape[0] // 2), *shape[1:]), shape)
        config.add_optimization_profile(profile)
    if opt.half:
        config.set_flag(trt.BuilderFlag.FP16)
    cache = path.with_suffix(".cache")
    if calibration is not None:
        config.set_flag(trt.BuilderFlag.INT8)
        config.int8_calibrator = _calibrator(trt, CalibrationBatches(calibration, shape[0]), cache)
        if opt.dynamic:
            config.set_calibration_profile(profile)
    engine = builder.build_serialized_network(network, config)
    cache.unlink(missing_ok=True)
    return engine


def load_engine(path: Path, device: torch.device) -> tuple[Callable[[Tensor], Tensor], dict[str, Any], dict]:
    """Deserialize an engine on the GPU.

    Returns:
        `(run, metadata, shape)`: `run(images)` -> (B, N, 5 + nc) float32; `<stem>.yaml`'s content; the engine's
        fixed `batch` (None when dynamic) and `size`.
    """
    import yaml

    (trt,) = require_extra(f"{path.name} (TensorRT)", "tensorrt", extra="tensorrt")
    check_cuda(device if device.type == "cuda" else torch.device("cuda"))
    cuda = device if device.type == "cuda" else torch.device("cuda", 0)
    with library_output():  # TensorRT's log, as in export_engine
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise UserError(f"{path}: TensorRT cannot load it (built by another TensorRT version or for another GPU?)")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inp = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
    out = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)
    dims = tuple(engine.get_tensor_shape(inp))
    half = engine.get_tensor_dtype(inp) == trt.DataType.HALF
    meta_file = path.with_suffix(".yaml")
    meta = yaml.safe_load(meta_file.read_text()) if meta_file.is_file() else {}
    stream = torch.cuda.Stream(cuda)

    def run(images: Tensor) -> Tensor:
        x = images.to(cuda, torch.float16 if half else torch.float32).contiguous()
        context.set_input_shape(inp, tuple(x.shape))
        y = torch.empty(tuple(context.get_tensor_shape(out)), device=cuda, dtype=x.dtype)
        context.set_tensor_address(inp, x.data_ptr())
        context.set_tensor_address(out, y.data_ptr())
        with torch.cuda.stream(stream):
            context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        return y.float().to(images.device)

    fixed = -1 not in dims
    shape = {"batch": dims[0] if fixed else None, "size": (dims[2], dims[3]) if fixed else None}
    return run, meta, shape
