"""Calibration images for int8 quantization (NNCF, TFLite, TensorRT): `calib_data=` images, letterboxed.

`calib_data=` is a dataset yaml (its train images, as ultralytics/yolov5 v7.0 `export.py::export_tflite` calibrates on
`check_dataset(data)['train']`) or a folder of images. Up to `count` images (v7.0's `ncalib`, 100), spread evenly
over the list, each letterboxed to the export size as validation letterboxes them and scaled to [0, 1].
"""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np

from yolo5l.base.errors import UserError

__all__ = ["calibration_files", "calibration_images"]


def calibration_files(data: str | os.PathLike[str] | None, count: int = 100) -> list[Path]:
    """Up to `count` image files of `data` (a dataset yaml's train split, or an image folder), spread evenly.

    Raises:
        UserError: No `data`, a path that does not exist, or no images in it.
    """
    from yolo5l.data.layout import is_image_file

    if not data:
        raise UserError("int8=true needs calibration images: pass calib_data=<a dataset yaml or a folder of images>")
    path = Path(data)
    if not path.exists():
        raise UserError(f"calib_data={data}: no such file or folder (int8 calibration images)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and is_image_file(p))
    else:
        from yolo5l.data.dataset_yaml import load_dataset_file

        files = list(load_dataset_file(path).files("train"))
    if not files:
        raise UserError(f"calib_data={data}: no images found for int8 calibration")
    if len(files) > count:
        files = [files[i] for i in np.linspace(0, len(files) - 1, count).round().astype(int)]
    return files


def calibration_images(files: list[Path], imgsz: int | tuple[int, int]) -> list[np.ndarray]:
    """Each file as a (1, 3, H, W) float32 RGB array in [0, 1], letterboxed to `imgsz` (a square size, or (H, W)),
    the model's input.

    Raises:
        UserError: An image that cannot be read.
    """
    from yolo5l.data.letterbox import letterbox

    out = []
    for f in files:
        img = cv2.imread(str(f))
        if img is None:
            raise UserError(f"{f}: cannot be read as an image (int8 calibration)")
        boxed = letterbox(cv2.cvtColor(img, cv2.COLOR_BGR2RGB), imgsz, scaleup=False)[0]
        out.append(np.ascontiguousarray(boxed.transpose(2, 0, 1)[None], dtype=np.float32) / 255)
    return out
