"""The export formats: their names, files, extras, and how a path's format is recognised.

A format's file is named as ultralytics names it, so that its loaders recognise it by name too (ultralytics/yolov5
v7.0 `export.py::export_formats`, `models/common.py::DetectMultiBackend._model_type`): `best.onnx`,
`best.torchscript`, `best_openvino_model/`, `best.tflite` (`best-fp16.tflite`, `best-int8.tflite`),
`best.mlpackage`, `best.engine`; ncnn as ultralytics' later releases name it, `best_ncnn_model/`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yolo5l.base.console import library_output
from yolo5l.base.errors import UserError

__all__ = [
    "FORMATS",
    "LIBRARY_NOISE",
    "NOT_WRITTEN",
    "Format",
    "find_format",
    "output_path",
    "output_paths",
    "parse_formats",
    "require_extra",
]


@dataclass(frozen=True)
class Format:
    """One export format.

    Attributes:
        name: The `format=` value.
        extra: The pyproject extra that installs its tools.
        export_modules: What writing it imports.
        run_modules: What running it imports; empty where it cannot run on this kind of machine (CoreML runs on
            macOS only, TensorRT on NVIDIA GPUs).
        runs_on_cpu: Whether it runs on a CPU-only machine.
    """

    name: str
    extra: str
    export_modules: tuple[str, ...]
    run_modules: tuple[str, ...]
    runs_on_cpu: bool = True


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("onnx", "export", ("onnx", "onnxruntime"), ("onnxruntime",)),
        Format("torchscript", "export", (), ()),
        Format("openvino", "openvino", ("onnx", "openvino"), ("openvino",)),
        Format("tflite", "tflite", ("litert_torch", "ai_edge_quantizer"), ("ai_edge_litert",)),
        Format("ncnn", "ncnn", ("pnnx", "ncnn"), ("ncnn",)),
        Format("coreml", "coreml", ("coremltools",), ("coremltools",), runs_on_cpu=False),
        Format("engine", "tensorrt", ("onnx", "tensorrt"), ("tensorrt",), runs_on_cpu=False),
    )
}


#: The other formats of ultralytics/yolov5 v7.0 `export.py::export_formats` (its `--include` values), which yolo5l does
#: not write: why, and what to use instead. `format=<one of them>` is refused with this line.
NOT_WRITTEN: dict[str, str] = {
    "saved_model": "TF SavedModel is not written (it needs TensorFlow): use format=onnx (onnx2tf converts it) or "
    "format=tflite",
    "pb": "TF GraphDef is not written (it needs TensorFlow): use format=onnx (onnx2tf converts it) or format=tflite",
    "tfjs": "TF.js is not written (it needs TensorFlow and tensorflowjs): use format=onnx, which onnxruntime-web runs "
    "in a browser",
    "edgetpu": "Edge TPU is not written (it needs Coral's edgetpu_compiler, which yolo5l does not run): use "
    "format=tflite int8=true (an int8 TF Lite file for CPUs) or format=onnx",
    "paddle": "PaddlePaddle is not written (it needs paddlepaddle and x2paddle): use format=onnx (x2paddle converts "
    "ONNX files)",
}


#: What a format's tools print that says nothing about the user's model (regular expressions, searched), dropped by
#: `yolo5l.base.console.library_output`: coremltools' notes, on import, that macOS's Core ML runtime is missing (it
#: always is off macOS, where the file is not run), that its scikit-learn converter is off, and that it was not tested
#: with this torch (the export's own check of the file is what tells).
LIBRARY_NOISE: dict[str, tuple[str, ...]] = {
    "coremltools": (
        r"Failed to load '?_ML\w*Proxy", r"scikit-learn version \S+ is not supported",
        r"has not been tested with coremltools",
    ),
}  # fmt: skip


def require_extra(what: str, *modules: str, extra: str = "export") -> list[Any]:
    """Import `modules`, or refuse in one line naming the extra that installs them. What the imports print goes
    through `yolo5l.base.console.library_output`.

    Args:
        what: What needs them, the start of the message (`format=onnx`).
        *modules: Module names.
        extra: The pyproject extra.

    Returns:
        The modules, in order.

    Raises:
        UserError: `<what> needs the <extra> extra: pip install -e ".[<extra>]"`.
    """
    try:
        # What importing them prints: torch's deprecation notices when torchao loads, coremltools' `LIBRARY_NOISE`.
        with library_output(ignore=tuple(p for m in modules for p in LIBRARY_NOISE.get(m, ()))):
            return [importlib.import_module(m) for m in modules]
    except ImportError:
        raise UserError(f'{what} needs the {extra} extra: pip install -e ".[{extra}]"') from None


def _dir_format(path: Path) -> str | None:
    name = path.name
    if name.endswith("_openvino_model") or any(path.glob("*.xml")):
        return "openvino"
    if name.endswith("_ncnn_model") or any(path.glob("*.param")):
        return "ncnn"
    return None


def find_format(path: str | os.PathLike[str]) -> str | None:
    """The format of an exported file or folder, None for anything else (weights, checkpoints).

    By suffix (`.onnx`, `.torchscript`, `.tflite`, `.mlpackage`, `.mlmodel`, `.engine`), by a folder's name
    (`*_openvino_model`, `*_ncnn_model`) or by what the folder holds (an OpenVINO `.xml`, an ncnn `.param`); an
    OpenVINO `.xml` or ncnn `.param` named directly counts too.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    by_suffix = {
        ".onnx": "onnx", ".torchscript": "torchscript", ".tflite": "tflite", ".mlpackage": "coreml",
        ".mlmodel": "coreml", ".engine": "engine", ".xml": "openvino", ".param": "ncnn",
    }  # fmt: skip
    if suffix in by_suffix:
        return by_suffix[suffix]
    if path.name.endswith(("_openvino_model", "_ncnn_model")):
        return "openvino" if path.name.endswith("_openvino_model") else "ncnn"
    return _dir_format(path) if path.is_dir() else None


def output_path(folder: Path, stem: str, fmt: str, half: bool = False, int8: bool = False) -> Path:
    """Where `format=<fmt>` writes by default: ultralytics' names (see the module docstring)."""
    precision = "int8" if int8 else "fp16" if half else ""
    if fmt == "openvino":
        return folder / f"{stem}{'_' + precision if precision else ''}_openvino_model"
    if fmt == "ncnn":
        return folder / f"{stem}{'_' + precision if precision else ''}_ncnn_model"
    if fmt == "tflite":
        return folder / f"{stem}{'-' + precision if precision else ''}.tflite"
    suffix = {"coreml": "mlpackage"}.get(fmt, fmt)
    return folder / f"{stem}.{suffix}"


def parse_formats(value: Any) -> list[str]:
    """The formats of `format=`: one name (`onnx`), a list (`[onnx,openvino]`, v7.0's `--include onnx openvino`) or
    names separated by commas (`'onnx,openvino'`); lower-cased, in order, each once.

    Raises:
        UserError: No format, or a name that is not one of `FORMATS` (a `NOT_WRITTEN` one: why, and what instead).
    """
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, Iterable):
        items = [str(v) for v in value]
    else:
        items = [] if value is None else [str(value)]
    names = [name.strip().lower() for name in items if name.strip()]
    if not names:
        raise UserError(f"format={value!r} names no format: pass format=onnx, or several as format=[onnx,openvino]")
    for name in names:
        if name in NOT_WRITTEN:
            raise UserError(f"format={name}: {NOT_WRITTEN[name]}")
        if name not in FORMATS:
            raise UserError(f"format={name!r} is not one of: {', '.join(FORMATS)}")
    return list(dict.fromkeys(names))


def output_paths(
    output: str | os.PathLike[str] | None, folder: Path, stem: str, formats: list[str], half: bool, int8: bool
) -> dict[str, Path]:
    """Where each of `formats` is written: `output` itself for one format; with several, `output` is the folder that
    takes them all; without `output`, `folder`. A file's name is the one :func:`output_path` gives it.

    Raises:
        UserError: Several formats and an `output` that names a file (an existing one, or one with a format's suffix).
    """
    if output is not None and len(formats) == 1:
        return {formats[0]: Path(output)}
    if output is not None:
        out = Path(output)
        if out.is_file() or out.suffix.lower() in (".pt", ".ckpt", ".onnx", ".torchscript", ".tflite", ".engine",
                                                   ".mlpackage", ".mlmodel"):  # fmt: skip
            raise UserError(
                f"output={output} names a file, but format= lists {len(formats)} formats: pass a folder for them all "
                "(each file named as its own export names it) or drop output= (beside the weights)"
            )
        folder = out
    return {fmt: output_path(folder, stem, fmt, half=half, int8=int8) for fmt in formats}
