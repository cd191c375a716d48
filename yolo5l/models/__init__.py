"""YOLOv5 v7.0 model family: building blocks (``common``) and the detector (``yolo``)."""

from __future__ import annotations

from yolo5l.models.yolo import ANCHORS_P3_P5, SCALES, Detect, YOLOv5

__all__ = ["ANCHORS_P3_P5", "SCALES", "Detect", "YOLOv5"]
