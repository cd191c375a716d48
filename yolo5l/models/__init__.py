"""YOLOv5 v7.0 model family: building blocks (``common``), the detector (``yolo``), and the weights files that
build one (yolo5l's and ultralytics', ``weights``; the model a run starts from, ``model_source``)."""

from __future__ import annotations

from yolo5l.models.yolo import ANCHORS_P3_P5, SCALES, Detect, YOLOv5

__all__ = ["ANCHORS_P3_P5", "SCALES", "Detect", "YOLOv5"]
