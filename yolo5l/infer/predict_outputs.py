"""What `python -m yolo5l.predict` writes for each image or frame, in the run folder.

- `predictions.json`: every detection (source, frame for videos and streams, class id and name, score, xyxy box in
  original pixels);
- `labels/<stem>.txt` (`labels/<stem>_<frame>.txt` for videos and streams) with `save_txt`: `class cx cy w h`,
  normalised, and the score with `save_conf`; an image without detections gets an empty file;
- each image drawn (`<name>`), each video and stream drawn frame by frame (`<stem>.mp4`), unless `save_images=false`
  (v7.0's `--nosave`); `line_thickness`, `hide_labels` and `hide_conf` as v7.0's;
- `crops/<class name>/<stem>.jpg` with `save_crop`: each detection cut from the undrawn image (1.02 x the box plus
  10 pixels), numbered `<stem>2.jpg`, `<stem>3.jpg`, ... when a name repeats, as v7.0's `increment_path`.

Reference: ultralytics/yolov5 v7.0 `detect.py::run` (the outputs and their names), `utils/plots.py::save_one_box`.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from yolo5l.base.files import atomic_write
from yolo5l.infer.annotate import crop_box, draw_detections, encode_jpeg
from yolo5l.infer.sources import Frame

__all__ = ["PredictOutputs"]


def _stem(source: str) -> str:
    """A file-name stem for a source: the file's stem, `webcam0` for a webcam, a URL path's last segment's stem."""
    if source.isnumeric():
        return f"webcam{source}"
    if "://" in source:
        parts = urllib.parse.urlsplit(source)
        name = Path(parts.path).stem or parts.hostname or ""
    else:
        name = Path(source).stem
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name) or "stream"


class PredictOutputs:
    """Write the outputs of each frame as its detections arrive; `close` finishes the videos and the JSON.

    Args:
        out: The run folder.
        names: Class names.
        save_images: Draw images and videos.
        save_txt: Write YOLO txt labels.
        save_conf: Add the score to each txt row.
        save_crop: Cut each detection out.
        line_thickness: Box line width in pixels (None: grows with the image).
        hide_labels: Draw boxes without labels.
        hide_conf: Draw labels without scores.
    """

    def __init__(
        self,
        out: Path,
        names: Sequence[str],
        *,
        save_images: bool = True,
        save_txt: bool = True,
        save_conf: bool = True,
        save_crop: bool = False,
        line_thickness: int | None = None,
        hide_labels: bool = False,
        hide_conf: bool = False,
    ) -> None:
        self.out, self.names = out, list(names)
        self.save_images, self.save_txt, self.save_conf, self.save_crop = save_images, save_txt, save_conf, save_crop
        self.draw = {"line_thickness": line_thickness, "hide_labels": hide_labels, "hide_conf": hide_conf}
        self.results: list[dict[str, Any]] = []
        self.frames = 0
        self.crops = 0
        self._writers: dict[str, tuple[cv2.VideoWriter, Path]] = {}
        self._stems: dict[tuple[str, int | None], str] = {}
        self._crop_names: set[Path] = set()
        if save_txt:
            (out / "labels").mkdir(parents=True, exist_ok=True)

    def _name(self, frame: Frame) -> str:
        key = (frame.source, frame.stream)
        if key not in self._stems:  # two sources with one stem (a/x.jpg, b/x.mp4) keep apart
            stem = _stem(frame.source)
            taken = set(self._stems.values())
            self._stems[key] = stem if stem not in taken else f"{stem}_{len(taken)}"
        return self._stems[key]

    def add(self, frame: Frame, det: np.ndarray) -> None:
        """One image or frame and its (n, 6) detections [x1, y1, x2, y2, score, class] in its pixels, best first."""
        self.frames += 1
        stem = self._name(frame)
        file_stem = stem if frame.index is None else f"{stem}_{frame.index}"
        h, w = frame.image.shape[:2]
        lines = []
        for x1, y1, x2, y2, score, cls in det.tolist():
            c = int(cls)
            entry: dict[str, Any] = {
                "image": frame.source, "class": c, "name": self.names[c] if c < len(self.names) else str(c),
                "score": round(score, 5), "box_xyxy": [round(v, 2) for v in (x1, y1, x2, y2)],
            }  # fmt: skip
            self.results.append(entry if frame.index is None else {**entry, "frame": frame.index})
            row = f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} {(y2 - y1) / h:.6f}"
            lines.append(f"{row} {score:.5f}" if self.save_conf else row)
        if self.save_txt:
            atomic_write(self.out / "labels" / f"{file_stem}.txt", "".join(ln + "\n" for ln in lines))
        if not (self.save_images or self.save_crop):
            return
        bgr = cv2.cvtColor(frame.image, cv2.COLOR_RGB2BGR)
        if self.save_crop:
            for x1, y1, x2, y2, _, cls in det.tolist():
                self._save_crop(crop_box(bgr, (x1, y1, x2, y2)), int(cls), file_stem)
        if self.save_images:
            drawn = draw_detections(bgr, det, self.names, **self.draw)
            if frame.index is None:
                cv2.imwrite(str(self.out / Path(frame.source).name), drawn)
            else:
                self._video(stem, frame.fps, (w, h)).write(drawn)

    def _save_crop(self, crop: np.ndarray, cls: int, stem: str) -> None:
        if crop.size == 0:
            return
        name = self.names[cls] if cls < len(self.names) else str(cls)
        folder = self.out / "crops" / re.sub(r"[/\\]", "_", name)
        path, n = folder / f"{stem}.jpg", 1
        while path in self._crop_names or path.exists():
            n += 1
            path = folder / f"{stem}{n}.jpg"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, encode_jpeg(crop, quality=95, rgb=False, full_chroma=True))
        self._crop_names.add(path)
        self.crops += 1

    def _video(self, stem: str, fps: float, size: tuple[int, int]) -> cv2.VideoWriter:
        if stem not in self._writers:
            path = self.out / f"{stem}.mp4"
            self._writers[stem] = (cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps or 30.0, size), path)
        return self._writers[stem][0]

    def close(self) -> Path:
        """Finish the videos and write `predictions.json`; returns its path."""
        for writer, _ in self._writers.values():
            writer.release()
        self._writers.clear()
        return atomic_write(self.out / "predictions.json", json.dumps(self.results, indent=1))
