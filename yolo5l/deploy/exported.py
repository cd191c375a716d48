"""Run exported detectors (`python -m yolo5l.export`): ONNX through onnxruntime, TorchScript through `torch.jit`.

    >>> model, names, imgsz, stride = load_exported("weights.onnx")
    >>> boxes = model(images)  # (B, 3, H, W) RGB in [0, 1] -> (B, N, 5 + nc), as YOLOv5.decode(YOLOv5(images))

The callable returns what `YOLOv5.decode` returns (cx, cy, w, h in input pixels, objectness, class scores), in
float32 on the input's device, so `yolo5l.infer.boxes.non_max_suppression` reads it as it reads the PyTorch model's
output; this is how `python -m yolo5l.val` and `python -m yolo5l.predict` take `weights=<file>.onnx|.torchscript`.
Files that ultralytics/yolov5 v7.0 `export.py` writes load too: same input and output layout, class names from the ONNX
metadata or TorchScript `config.txt` (written there as a Python dict, here as a JSON list).

A file exported without dynamic axes takes one batch size and one image size: a batch of another size runs in
chunks of the file's, and smaller images are padded on the right and bottom (which leaves box coordinates as they
are); larger ones are refused. Like a pickle, an exported file is a program: load only files you trust.
"""

from __future__ import annotations

import ast
import json
import os
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from yolo5l.base.errors import UserError
from yolo5l.base.image_size import MAX_STRIDE
from yolo5l.deploy.formats import find_format
from yolo5l.deploy.formats import require_extra as _require_extra
from yolo5l.deploy.onnx_nms import OUTPUT_NAMES, as_decoded

__all__ = [
    "EXPORT_FORMATS",
    "EXTRA_HINT",
    "ExportedModel",
    "export_format",
    "is_exported",
    "load_exported",
    "not_weights",
    "require_extra",
]

#: File suffix -> format for the single-file formats (folders: `yolo5l.deploy.formats.find_format`).
EXPORT_FORMATS = {".onnx": "onnx", ".torchscript": "torchscript", ".tflite": "tflite", ".engine": "engine"}
EXTRA_HINT = 'pip install -e ".[export]"'
_PAD = 114 / 255  # the letterbox grey (yolo5l.data.augment.letterbox), on the model's [0, 1] scale
_DEFAULT_IMGSZ, _DEFAULT_STRIDE = 640, MAX_STRIDE  # a file without metadata: a P5 model at 640


def export_format(path: str | os.PathLike[str]) -> str | None:
    """The format of an exported file or folder (`onnx`, `torchscript`, `openvino`, `tflite`, `ncnn`, `coreml`,
    `engine`), None for anything else (weights, checkpoints)."""
    return find_format(path)


def is_exported(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names an exported file or folder (by its suffix or layout) rather than weights."""
    return export_format(path) is not None


def not_weights(path: str | os.PathLike[str], use: str) -> str | None:
    """Why an exported file or folder cannot stand where PyTorch weights are needed (`use`: `trained from`,
    `converted`), naming the files to give instead; None for anything else (left to the weights loaders)."""
    fmt = export_format(path)
    if fmt is None:
        return None
    return (
        f"an exported model (format={fmt}), which cannot be {use}: give the .pt it was exported from (best.pt, "
        "weights.pt or last.ckpt)"
    )


def require_extra(what: str, *modules: str, extra: str = "export") -> list[Any]:
    """Import `modules`, or refuse in one line naming the extra (`yolo5l.deploy.formats.require_extra`)."""
    return _require_extra(what, *modules, extra=extra)


def _names(value: Any, nc: int | None = None) -> list[str]:
    """Class names from metadata: a JSON list (yolo5l), or a `str(dict)` / dict (ultralytics)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = ast.literal_eval(value)  # ultralytics writes str({0: 'person', ...}); literals only, no code
    if isinstance(value, Mapping):
        value = [value[k] for k in sorted(value, key=int)]
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [str(n) for n in value]
    return [str(i) for i in range(nc or 0)]


def _torchscript_config(path: Path) -> dict[str, Any]:
    """The JSON `config.txt` that `torch.jit.save(_extra_files=...)` put in the archive (`<name>/extra/config.txt`),
    read before loading so that the file is loaded onto the right device; {} when there is none."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if n.endswith("extra/config.txt")), None)
            return json.loads(zf.read(name) or "{}") if name else {}
    except (zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable TorchScript file ({e})") from None


def _int_or_first(value: Any, default: int) -> int:
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, Sequence):
        value = value[0] if value else default
    return default if value is None else int(value)


class ExportedModel:
    """An exported detector as a callable: `model(images) -> (B, N, 5 + nc)` decoded boxes, float32.

    Args:
        path: A `.onnx` or `.torchscript` file.
        device: Where it runs: onnxruntime's CUDA provider when the device is CUDA and onnxruntime has one (else its
            CPU provider); TorchScript loads onto the device.

    Attributes:
        path: The file.
        format: `onnx` or `torchscript`.
        names: Class names.
        imgsz: The image size the file was exported at.
        stride: The largest stride (32).
        data: The dataset yaml the weights were trained on (yolo5l's `data` entry), None when the file does not say.
        batch: The one batch size the file takes, None for any.
        size: The one (height, width) it takes, None for any (multiples of the stride).
        half: Whether it takes fp16 input.

    Raises:
        UserError: Not an exported file, or the `export` extra (onnxruntime) is missing for an ONNX file.
    """

    def __init__(self, path: str | os.PathLike[str], device: str | torch.device = "cpu") -> None:
        self.path = Path(path)
        self.device = torch.device(device)
        fmt = export_format(self.path)
        if fmt is None:
            raise UserError(
                f"{self.path}: not an exported file (expected .onnx, .torchscript, .tflite, .engine, or an "
                "*_openvino_model / *_ncnn_model folder)"
            )
        if not self.path.exists():
            raise UserError(f"{self.path}: file not found")
        self.format = fmt
        self.batch: int | None = None
        self.size: tuple[int, int] | None = None
        self.half = False
        self.end_to_end = False  # ONNX with NMS inside (yolo5l.deploy.onnx_nms)
        if fmt == "onnx":
            self._run = self._load_onnx()
        elif fmt == "torchscript":
            self._run = self._load_torchscript()
        else:
            self._run = self._load_deploy(fmt)

    def _load_deploy(self, fmt: str) -> Callable[[Tensor], Tensor]:
        if fmt == "coreml":
            raise UserError(
                f"{self.path}: yolo5l's val and predict do not run Core ML models (on any system): load it in a "
                "Core ML app on macOS or iOS, or export format=onnx to validate it here"
            )
        if fmt == "openvino":
            from yolo5l.deploy.openvino import load_openvino as load
        elif fmt == "tflite":
            from yolo5l.deploy.tflite import load_tflite as load
        elif fmt == "ncnn":
            from yolo5l.deploy.ncnn import load_ncnn as load
        else:
            from yolo5l.deploy.tensorrt import load_engine as load
        run, meta, shape = load(self.path, self.device)
        self.batch, self.size = shape.get("batch"), shape.get("size")
        self._meta(meta, None)
        return run

    def _load_onnx(self) -> Callable[[Tensor], Tensor]:
        (ort,) = require_extra(f"{self.path.name} (ONNX)", "onnxruntime")
        providers: list[Any] = ["CPUExecutionProvider"]
        if self.device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": self.device.index or 0}))
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # the command's count (the cores free at its start)
        try:
            session = ort.InferenceSession(str(self.path), options, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types for unreadable models
            raise UserError(f"{self.path}: onnxruntime cannot load it ({str(e).splitlines()[0]})") from None
        inp, out = session.get_inputs()[0], session.get_outputs()[0]
        dims = list(inp.shape)  # ints where fixed; names (or None) where dynamic
        self.batch = dims[0] if isinstance(dims[0], int) else None
        if len(dims) == 4 and isinstance(dims[2], int) and isinstance(dims[3], int):
            self.size = (dims[2], dims[3])
        self.half = inp.type == "tensor(float16)"
        meta = session.get_modelmeta().custom_metadata_map
        outputs = [o.name for o in session.get_outputs()]
        self.end_to_end = outputs == list(OUTPUT_NAMES)
        self._meta(meta, None if self.end_to_end or not isinstance(out.shape[-1], int) else out.shape[-1])
        dtype = torch.float16 if self.half else torch.float32
        if self.end_to_end:
            nc = len(self.names)

            def run_end_to_end(images: Tensor) -> Tensor:
                x = images.detach().to(device="cpu", dtype=dtype).contiguous().numpy()
                boxes, scores, classes, _ = (torch.from_numpy(y) for y in session.run(outputs, {inp.name: x}))
                return as_decoded(boxes, scores, classes, nc).to(images.device)

            return run_end_to_end

        def run(images: Tensor) -> Tensor:
            x = images.detach().to(device="cpu", dtype=dtype).contiguous().numpy()  # NCHW, as the graph reads it
            y = session.run([out.name], {inp.name: x})[0]
            return torch.from_numpy(y).to(device=images.device, dtype=torch.float32)

        return run

    def _load_torchscript(self) -> Callable[[Tensor], Tensor]:
        meta = _torchscript_config(self.path)
        traced_on = meta.get("device")
        if traced_on and torch.device(traced_on).type != self.device.type:
            # The decode's grids are built with the trace's device as a constant: the file runs there.
            if torch.device(traced_on).type == "cuda" and not torch.cuda.is_available():
                raise UserError(f"{self.path.name} was exported on {traced_on}, which this machine lacks: export it "
                                "again with device=cpu, or use the ONNX format")  # fmt: skip
            from yolo5l.base.console import info

            info(f"{self.path.name} was exported on {traced_on} and runs there (export with device={self.device.type} "
                 f"to run it on {self.device.type})")  # fmt: skip
            self.device = torch.device(traced_on)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
                module = torch.jit.load(str(self.path), map_location=self.device).eval()
        except RuntimeError as e:
            raise UserError(f"{self.path}: not a readable TorchScript file ({str(e).splitlines()[0]})") from None
        self.half = bool(meta.get("half", False))
        if not meta.get("dynamic", "shape" not in meta):
            # ultralytics' TorchScript: traced at `shape`, which it may have kept as constants
            _, _, h, w = meta["shape"]
            self.batch, self.size = int(meta["shape"][0]), (int(h), int(w))
        self._meta(meta, None)
        dtype = torch.float16 if self.half else torch.float32

        def run(images: Tensor) -> Tensor:
            with torch.no_grad():
                y = module(images.to(device=self.device, dtype=dtype))
            if isinstance(y, (tuple, list)):  # ultralytics' Detect in export mode returns (boxes,)
                y = y[0]
            return y.to(device=images.device, dtype=torch.float32)

        return run

    def _meta(self, meta: Mapping[str, Any], no: int | None) -> None:
        self.names = _names(meta.get("names"), None if no is None else no - 5)
        self.stride = _int_or_first(meta.get("stride"), _DEFAULT_STRIDE)
        data = meta.get("data")  # yolo5l's: the dataset yaml the weights were trained on
        self.data = data if isinstance(data, str) and data else None
        fallback = self.size[0] if self.size else _int_or_first(meta.get("shape", [None] * 3)[2:], _DEFAULT_IMGSZ)
        imgsz = meta.get("imgsz")
        if isinstance(imgsz, str) and imgsz.startswith("["):
            imgsz = json.loads(imgsz)
        if isinstance(imgsz, Sequence) and not isinstance(imgsz, str) and imgsz:
            # A rectangular export records [height, width]: val and predict letterbox to the square that fits it,
            # padded to its shape (`_fit`).
            self.imgsz = min(int(v) for v in imgsz)
        else:
            self.imgsz = _int_or_first(imgsz, fallback)

    def _fit(self, images: Tensor) -> Tensor:
        if self.size is None:
            return images
        (h, w), (fh, fw) = images.shape[2:], self.size
        if h > fh or w > fw:
            raise UserError(
                f"{self.path.name} takes {fh}x{fw} images (exported without dynamic=true), got {h}x{w}: use an "
                f"image size of at most {min(fh, fw)}, or export with dynamic=true"
            )
        # Right and bottom only: the boxes keep their coordinates.
        return F.pad(images, (0, fw - w, 0, fh - h), value=_PAD) if (h, w) != (fh, fw) else images

    def __call__(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) float RGB in [0, 1] -> (B, N, 5 + nc): cx, cy, w, h in pixels, objectness, class scores."""
        images = self._fit(images)
        n, b = images.shape[0], self.batch
        if b is None or b == n:
            return self._run(images)
        outs = []
        for start in range(0, n, b):
            chunk = images[start : start + b]
            k = chunk.shape[0]
            if k < b:  # a fixed-batch file: fill the last chunk, keep the real images' rows
                chunk = torch.cat((chunk, chunk.new_zeros((b - k, *chunk.shape[1:]))))
            outs.append(self._run(chunk)[:k])
        return torch.cat(outs)

    def __repr__(self) -> str:
        shape = f"batch {self.batch or 'any'}, size {'x'.join(map(str, self.size)) if self.size else 'any'}"
        return f"ExportedModel({str(self.path)!r}, {self.format}, {len(self.names)} classes, {shape})"


def load_exported(
    path: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> tuple[ExportedModel, list[str], int, int]:
    """Load an exported detector.

    Args:
        path: A `.onnx` or `.torchscript` file written by `python -m yolo5l.export` (or ultralytics' export.py).
        device: Where it runs (see :class:`ExportedModel`).

    Returns:
        `(model, names, imgsz, stride)`: `model(images)` gives the decoded (B, N, 5 + nc) tensor.

    Raises:
        UserError: Not an exported file, unreadable, or the `export` extra missing.
    """
    model = ExportedModel(path, device)
    return model, model.names, model.imgsz, model.stride
