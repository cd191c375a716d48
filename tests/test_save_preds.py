"""COCO results JSON of `python -m yolo5l.val save_json=true`: scored by pycocotools (faster-coco-eval when
pycocotools is absent), it gives yolo5l's COCO-protocol mAP (`module/metric=coco`), with the dataset's own image and
category ids."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

from yolo5l.config import compose_config
from yolo5l.data.coco2yolo import COCO_NAMES, convert_coco_json
from yolo5l.eval.coco_map import COCOMap
from yolo5l.eval.save_preds import CocoIds, PredictionSaver, coco_entries, txt_lines, with_label_candidates

CATEGORIES = [{"id": 3, "name": "car"}, {"id": 7, "name": "dog"}, {"id": 11, "name": "kite"}]


def independent_score(anno: Path, results: Path, image_ids: list[int]) -> tuple[float, float]:
    """mAP@0.5:0.95 and mAP@0.5 of a results file, by pycocotools (the reference), else faster-coco-eval."""
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        from faster_coco_eval import COCO
        from faster_coco_eval import COCOeval_faster as COCOeval
    gt = COCO(str(anno))
    ev = COCOeval(gt, gt.loadRes(str(results)), "bbox")
    ev.params.imgIds = image_ids
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[0]), float(ev.stats[1])


@pytest.fixture(scope="module")
def coco_style(tmp_path_factory) -> dict:
    """Six images with boxes, their COCO instances JSON (category ids 3, 7, 11; image ids unrelated to the names)
    and the YOLO dataset converted from it, with the JSON where v7.0 looks for it."""
    tmp = tmp_path_factory.mktemp("cocostyle")
    rng = np.random.default_rng(0)
    images_dir = tmp / "raw"
    images_dir.mkdir()
    images, annotations = [], []
    for i in range(6):
        h, w = int(rng.integers(90, 160)), int(rng.integers(90, 160))
        im = np.full((h, w, 3), 200, np.uint8)
        name = f"{1000 + 17 * i:012d}.jpg" if i % 2 else f"photo_{i}.jpg"  # numeric stems that are not the ids
        for _ in range(int(rng.integers(1, 4))):
            bw, bh = float(rng.uniform(15, w / 2)), float(rng.uniform(15, h / 2))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            cat = CATEGORIES[int(rng.integers(0, 3))]["id"]
            cv2.rectangle(im, (int(x), int(y)), (int(x + bw), int(y + bh)), (30 * cat % 255, 60, 90), -1)
            annotations.append({"id": len(annotations) + 1, "image_id": 500 + i, "category_id": cat,
                                "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": 0})  # fmt: skip
        cv2.imwrite(str(images_dir / name), im)
        images.append({"id": 500 + i, "file_name": name, "height": h, "width": w})
    root = tmp / "ds"
    anno = root / "annotations" / "instances_val2017.json"
    anno.parent.mkdir(parents=True)
    anno.write_text(json.dumps({"images": images, "annotations": annotations, "categories": CATEGORIES}))
    result = convert_coco_json(anno, images_dir, root, split="val2017")
    data = yaml.safe_load(result.yaml_path.read_text())
    result.yaml_path.write_text(yaml.safe_dump({**data, "train": data["val"]}))
    return {"root": root, "anno": anno, "yaml": result.yaml_path, "images": images, "tmp": tmp}


def _gt(root: Path, image: dict) -> torch.Tensor:
    """(m, 5) [x1, y1, x2, y2, class] in pixels from the converted YOLO label, as validation builds it."""
    rows = np.loadtxt(root / "labels" / "val2017" / f"{Path(image['file_name']).stem}.txt", ndmin=2)
    w, h = image["width"], image["height"]
    cx, cy, bw, bh = rows[:, 1] * w, rows[:, 2] * h, rows[:, 3] * w, rows[:, 4] * h
    return torch.tensor(
        np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2, rows[:, 0]], 1), dtype=torch.float32
    )


def test_json_scored_by_pycocotools_equals_coco_map(coco_style):
    """Noisy detections (shifted boxes, wrong classes, false positives, spread scores): the JSON written from them,
    scored against the original annotations, gives COCOMap's mAP of the same detections."""
    rng = np.random.default_rng(1)
    ids = CocoIds.from_annotations(coco_style["anno"], 3)
    assert ids.category_ids == [3, 7, 11]
    saver = PredictionSaver(coco_style["tmp"] / "api", save_txt=False, save_conf=False, ids=ids)
    metric = COCOMap(max_det=100)
    for image in coco_style["images"]:
        gt = _gt(coco_style["root"], image)
        boxes = gt[:, :4] + torch.tensor(rng.normal(0, 3, (len(gt), 4)), dtype=torch.float32)
        cls = torch.where(torch.tensor(rng.random(len(gt)) < 0.2), (gt[:, 4] + 1) % 3, gt[:, 4])
        fp = torch.tensor(rng.uniform(0, 60, (2, 2)), dtype=torch.float32)
        boxes = torch.cat((boxes, torch.cat((fp, fp + 25), 1)))
        dets = torch.cat((boxes, torch.tensor(rng.uniform(0.05, 1, (len(boxes), 1)), dtype=torch.float32),
                          torch.cat((cls, torch.tensor([0.0, 2.0])))[:, None]), 1)  # fmt: skip
        metric.update([dets], [gt])
        saver.add([dets], [str(coco_style["root"] / image["file_name"])], [((image["height"], image["width"]), None)])
    want = metric.compute()
    path = saver.write_json("results.json")
    entries = json.loads(path.read_text())
    assert {e["image_id"] for e in entries} == {im["id"] for im in coco_style["images"]}
    assert {e["category_id"] for e in entries} <= {3, 7, 11}
    got_map, got_50 = independent_score(coco_style["anno"], path, [im["id"] for im in coco_style["images"]])
    assert 0.2 < got_map < 0.9  # a score that depends on every detection
    assert got_map == pytest.approx(float(want["map"]), abs=2e-3)
    assert got_50 == pytest.approx(float(want["map_50"]), abs=2e-3)


def test_val_save_json_with_the_dataset_ids_scores_as_yolo5l(coco_style, capsys):
    """End to end: `val module/metric=coco save_json=true save_hybrid=true` on the converted dataset, annotations
    found where v7.0 looks (<root>/annotations/instances_val2017.json)."""
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5
    from yolo5l.validation import validate_weights

    weights = coco_style["tmp"] / "w3.pt"
    save_weights(YOLOv5(num_classes=3, depth=0.33, width=0.125), weights, ["car", "dog", "kite"], imgsz=128)
    run = coco_style["tmp"] / "val_json"
    cfg = compose_config(
        [f"weights={weights}", f"data.file={coco_style['yaml']}", "module/metric=coco", "save_json=true",
         "save_hybrid=true", "data.num_workers=0", "trainer.accelerator=cpu", "trainer.precision=32", "plots=false",
         "data.val_batch_size=3"],
        "val", run,
    )  # fmt: skip
    metrics = validate_weights(cfg)
    path = run / "w3_predictions.json"
    entries = json.loads(path.read_text())
    assert {e["image_id"] for e in entries} == {im["id"] for im in coco_style["images"]}
    got_map, got_50 = independent_score(coco_style["anno"], path, [im["id"] for im in coco_style["images"]])
    assert got_map > 0.8  # the labels are among the predictions (hybrid); wrong ids would score ~0
    assert metrics["coco/map"] == pytest.approx(got_map, abs=1e-6)
    assert metrics["val/map"] == pytest.approx(got_map, abs=2e-3)
    assert metrics["val/map_50"] == pytest.approx(got_50, abs=2e-3)
    assert "COCO results scored against instances_val2017.json" in capsys.readouterr().out
    assert json.loads((run / "metrics.json").read_text())["coco/map"] == pytest.approx(got_map)


def test_ids_without_annotations_follow_v7():
    ids = CocoIds.for_names(COCO_NAMES)
    assert (ids.category_ids[0], ids.category_ids[11], ids.category_ids[79]) == (1, 13, 90)
    assert ids.image_id("/x/000000000139.jpg") == 139
    assert ids.image_id("/x/bus.jpg") == "bus"
    assert CocoIds.for_names(["a", "b"]).category_ids == [0, 1]
    det = torch.tensor([[10.0, 20.0, 40.0, 60.0, 0.876543, 11.0]])
    assert coco_entries(det, 139, ids.category_ids) == [
        {"image_id": 139, "category_id": 13, "bbox": [10.0, 20.0, 30.0, 40.0], "score": 0.87654}
    ]
    assert txt_lines(det, (100, 200), save_conf=True) == ["11 0.125 0.4 0.15 0.4 0.876543"]
    assert txt_lines(det, (100, 200), save_conf=False) == ["11 0.125 0.4 0.15 0.4"]


def test_label_candidates_join_each_image():
    decoded = torch.zeros(2, 3, 7)  # 2 classes
    targets = torch.tensor([[1, 1, 0.5, 0.5, 0.2, 0.4], [0, 0, 0.25, 0.5, 0.5, 0.5], [1, 0, 0.1, 0.1, 0.1, 0.1]])
    out = with_label_candidates(decoded, targets, (100, 200))
    assert out.shape == (2, 5, 7)
    torch.testing.assert_close(out[0, 3], torch.tensor([50.0, 50, 100, 50, 1, 1, 0]))
    assert out[0, 4].abs().sum() == 0  # image 0 has one label: a zero row pads it
    torch.testing.assert_close(out[1, 3], torch.tensor([100.0, 50, 40, 40, 1, 0, 1]))
    torch.testing.assert_close(out[1, 4], torch.tensor([20.0, 10, 20, 10, 1, 1, 0]))
