"""`python -m yolo5l.predict` on images, a video and a corrupt file, with readable boxes at the weights' image size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from yolo5l.infer.annotate import draw_detections, line_width

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def test_labels_stay_inside_the_image_and_lines_grow_with_it():
    small, large = np.zeros((100, 120, 3), np.uint8), np.zeros((2000, 3000, 3), np.uint8)
    assert line_width(small.shape) == 2
    assert line_width(large.shape) == round(2500 * 0.003)
    # A box in the top-right corner: no room above it, and a label starting at its left edge would run off the right.
    dets = np.array([[100.0, 0.0, 119.0, 30.0, 0.91, 0]])
    drawn = draw_detections(small.copy(), dets, ["cat"])
    lw = line_width(small.shape)
    (tw, th), base = cv2.getTextSize("cat 0.91", cv2.FONT_HERSHEY_SIMPLEX, lw / 3, max(lw - 1, 1))
    assert tw > 120 - 100  # the label is wider than the room right of the box's left edge
    label = drawn[lw : lw + th + base, 120 - tw : 120]  # slid left to end at the right edge, inside the box
    assert (label.max(axis=2) > 0).all()  # filled background (and white text) everywhere: nothing clipped off


@pytest.fixture(scope="module")
def weights_at_128(tmp_path_factory):
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    tmp = tmp_path_factory.mktemp("predict")
    path = tmp / "w.pt"
    save_weights(YOLOv5.from_name("yolov5n", num_classes=2), path, ["a", "b"], imgsz=128)
    return path


def test_images_a_video_and_a_corrupt_file(tmp_path, weights_at_128):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    cv2.imwrite(str(src / "a.jpg"), rng.integers(0, 255, (96, 160, 3), dtype=np.uint8))
    (src / "broken.jpg").write_bytes(b"")  # a 0-byte image
    video = cv2.VideoWriter(str(src / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (160, 96))
    for _ in range(3):
        video.write(rng.integers(0, 255, (96, 160, 3), dtype=np.uint8))
    video.release()
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.predict", f"weights={weights_at_128}", f"source={src}", "conf_thres=0.0001",
         "device=cpu", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at 128 px" in r.stdout  # the weights' training size, not 640
    assert "1 source(s) skipped" in r.stdout
    assert "broken.jpg" in r.stdout + r.stderr
    assert (out / "a.jpg").is_file()
    cap = cv2.VideoCapture(str(out / "clip.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
    assert (int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))) == (160, 96)
    cap.release()
    preds = json.loads((out / "predictions.json").read_text())
    assert {p.get("frame") for p in preds if p["image"].endswith("clip.mp4")} <= {0, 1, 2}
    assert any(p["image"].endswith("clip.mp4") for p in preds)
    assert (out / "labels" / "clip_2.txt").is_file()


def test_val_runs_at_the_weights_training_size(tmp_path):
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    weights = tmp_path / "w.pt"
    save_weights(YOLOv5.from_name("yolov5n", num_classes=4), weights, imgsz=96)  # the synthetic set has 4 classes
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.val", f"weights={weights}", f"data.synthetic.root={tmp_path / 'syn'}",
         "data.synthetic.num_train=4", "data.synthetic.num_val=4", "data.val_batch_size=4", "data.num_workers=0",
         "trainer.accelerator=cpu", "plots=false", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data.imgsz: 96 (the weights' training size)" in r.stdout


def test_a_txt_list_of_two_images_in_one_batch(tmp_path, weights_at_128):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(1)
    for name in ("first.jpg", "second.png"):
        cv2.imwrite(str(src / name), rng.integers(0, 255, (96, 160, 3), dtype=np.uint8))
    listing = src / "images.txt"
    listing.write_text("first.jpg\nsecond.png\n")  # relative to the list's folder
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.predict", f"weights={weights_at_128}", f"source={listing}", "batch_size=8",
         "conf_thres=0.0001", "device=cpu", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at shape (2, 3, 128, 128)" in r.stdout  # the batch that ran, not batch_size=8
    assert sorted(p.name for p in out.iterdir() if p.suffix in {".jpg", ".png", ".mp4"}) == ["first.jpg", "second.png"]
    assert cv2.imread(str(out / "second.png")).shape == (96, 160, 3)
    preds = json.loads((out / "predictions.json").read_text())
    assert {p["image"] for p in preds} == {str(src / "first.jpg"), str(src / "second.png")}
    assert not any("frame" in p for p in preds)
