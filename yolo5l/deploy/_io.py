"""Atomic writes of exported folders (files: `yolo5l.base.files.atomic_write`), and the metadata forms ultralytics'
loaders read.

ultralytics/yolov5 v7.0 `models/common.py::DetectMultiBackend` reads `stride` and `names` from: ONNX
`metadata_props` (`names` evaluated as a Python literal), TorchScript's `config.txt` (JSON), a `<stem>.yaml` beside an
OpenVINO model's `.xml` (`_load_metadata`), and a zip archive appended to a `.tflite` file whose first member holds
`str(dict)` (what `export.py::add_tflite_metadata` writes through tflite_support). These helpers write those forms.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from yolo5l.base.files import atomic_write

__all__ = [
    "append_metadata",
    "atomic_folder",
    "read_appended_metadata",
    "ultralytics_metadata",
    "write_yaml",
]

TFLITE_META_NAME = "meta.txt"  # the member name tflite_support gives the associated file in v7.0's export


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path` to fill; on success it replaces `path` (an older one is removed), on
    an error it is removed and `path` is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ultralytics_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """yolo5l's metadata with `names` as v7.0 writes them, `{0: 'person', ...}` (a dict reads as a list would in
    yolo5l and as v7.0's own in its val.py and detect.py)."""
    out = dict(meta)
    out["names"] = dict(enumerate(meta["names"]))
    return out


def write_yaml(path: Path, meta: Mapping[str, Any]) -> None:
    """The metadata as YAML (names as a dict), the form of v7.0's OpenVINO `<stem>.yaml`."""
    text = yaml.safe_dump(ultralytics_metadata(meta), sort_keys=False, allow_unicode=True)
    atomic_write(path, text.encode())


def append_metadata(data: bytes, meta: Mapping[str, Any]) -> bytes:
    """`data` (a .tflite flatbuffer) with a zip archive appended whose one member holds `str(metadata)`.

    The flatbuffer is read from its start and ignores trailing bytes; zip readers find the archive from the end.
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(TFLITE_META_NAME, str(ultralytics_metadata(meta)))
    return data + buffer.getvalue()


def read_appended_metadata(path: Path) -> dict[str, Any]:
    """The metadata that :func:`append_metadata` (or ultralytics' export) put at the end of a file; {} if none."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            return dict(ast.literal_eval(zf.read(names[0]).decode())) if names else {}
    except (zipfile.BadZipFile, ValueError, SyntaxError):
        return {}
