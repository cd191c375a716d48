from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from yolo5l.data.coco2yolo import COCO80_TO_91, COCO91_TO_80, COCO_NAMES, convert_coco_json, main, write_yaml
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.label_scan import scan_labels


def test_coco_mapping_tables():
    assert len(COCO_NAMES) == 80
    assert len(COCO80_TO_91) == 80
    assert len(set(COCO80_TO_91)) == 80
    assert COCO91_TO_80[1] == 0
    assert COCO_NAMES[0] == "person"
    assert COCO91_TO_80[13] == 11
    assert COCO_NAMES[11] == "stop sign"
    assert COCO91_TO_80[90] == 79
    assert COCO_NAMES[79] == "toothbrush"
    assert 12 not in COCO91_TO_80
    assert 83 not in COCO91_TO_80


def _write_coco(tmp_path: Path) -> tuple[Path, Path]:
    img_dir = tmp_path / "raw" / "val2017"
    img_dir.mkdir(parents=True)
    sizes = {1: (100, 200), 2: (50, 80), 3: (60, 60)}  # id -> (h, w)
    for i, (h, w) in sizes.items():
        cv2.imwrite(str(img_dir / f"{i:012d}.jpg"), np.full((h, w, 3), 128, np.uint8))
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": h, "width": w} for i, (h, w) in sizes.items()]
    images.append({"id": 4, "file_name": "000000000004.jpg", "height": 10, "width": 10})  # not on disk
    categories = [{"id": cid, "name": COCO_NAMES[i]} for i, cid in enumerate(COCO80_TO_91)]
    annotations = [
        # image 1: a person box, a toothbrush (id 90 -> class 79), a crowd box, a box running off the right edge
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [20, 10, 40, 30], "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 90, "bbox": [100, 50, 20, 10], "iscrowd": 0},
        {"id": 3, "image_id": 1, "category_id": 1, "bbox": [0, 0, 200, 100], "iscrowd": 1},
        {"id": 4, "image_id": 1, "category_id": 3, "bbox": [180, 80, 40, 40], "iscrowd": 0},
        # image 2: a box entirely outside the image (degenerate after clipping) and an unused category id
        {"id": 5, "image_id": 2, "category_id": 1, "bbox": [90, 10, 5, 5], "iscrowd": 0},
        {"id": 6, "image_id": 2, "category_id": 12, "bbox": [1, 1, 5, 5], "iscrowd": 0},
        # image 3: no annotations
    ]
    js = tmp_path / "raw" / "instances_val2017.json"
    js.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return js, img_dir


def test_convert_tiny_coco(tmp_path):
    js, img_dir = _write_coco(tmp_path)
    out = tmp_path / "coco"
    r = convert_coco_json(js, img_dir, out)
    assert r.split == "val2017"
    assert (r.images, r.boxes, r.backgrounds) == (3, 3, 2)
    assert (r.crowd, r.degenerate, r.unknown_category, r.missing_images) == (1, 1, 1, 1)

    rows = np.loadtxt(out / "labels" / "val2017" / "000000000001.txt", ndmin=2)
    expected = np.array(
        [
            [0, 40 / 200, 25 / 100, 40 / 200, 30 / 100],
            [79, 110 / 200, 55 / 100, 20 / 200, 10 / 100],
            [2, 190 / 200, 90 / 100, 20 / 200, 20 / 100],  # clipped to x 180..200, y 80..100
        ]
    )
    np.testing.assert_allclose(rows, expected, atol=1e-6)
    assert (out / "labels" / "val2017" / "000000000003.txt").read_text() == ""  # background: empty file
    assert (out / "labels" / "val2017" / "000000000002.txt").read_text() == ""
    assert not (out / "labels" / "val2017" / "000000000004.txt").exists()
    assert (out / "val2017.txt").read_text().splitlines() == [f"./images/val2017/{i:012d}.jpg" for i in (1, 2, 3)]

    data = yaml.safe_load((out / "data.yaml").read_text())
    assert data["val"] == "val2017.txt"
    assert "train" not in data
    assert len(data["names"]) == 80
    # converting a "train" split into the same folder merges into the yaml; the dataset then loads and scans
    r2 = convert_coco_json(js, img_dir, out, split="train2017")
    assert r2.images == 3
    spec = load_dataset_file(out / "data.yaml")
    assert spec.num_classes == 80
    assert spec.names[79] == "toothbrush"
    assert [p.name for p in spec.val] == [f"{i:012d}.jpg" for i in (1, 2, 3)]
    idx = scan_labels(spec.val, spec.num_classes, spec.cache_path("val"), "val")
    assert idx.report.corrupt == 0
    assert idx.report.found == 1
    assert idx.report.empty == 2
    np.testing.assert_allclose(idx.labels[0], expected, atol=1e-6)


def test_custom_categories_map_in_sorted_order(tmp_path):
    img_dir = tmp_path / "imgs"
    img_dir.mkdir()
    cv2.imwrite(str(img_dir / "a.jpg"), np.zeros((20, 40, 3), np.uint8))
    cats = [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}]
    anns = [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [0, 0, 10, 10]}]
    js = tmp_path / "instances_mine.json"
    js.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg", "height": 20, "width": 40}],
                              "annotations": anns, "categories": cats}))  # fmt: skip
    convert_coco_json(js, img_dir, tmp_path / "out")
    assert (tmp_path / "out/labels/mine/a.txt").read_text().split()[0] == "1"
    assert yaml.safe_load((tmp_path / "out/data.yaml").read_text())["names"] == {0: "cat", 1: "dog"}


def test_cli_and_script(tmp_path):
    js, img_dir = _write_coco(tmp_path)
    main(["--json", str(js), "--images", str(img_dir), "--out", str(tmp_path / "a")])
    assert (tmp_path / "a/labels/val2017/000000000001.txt").is_file()
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, str(repo / "scripts/coco2yolo.py"), "--write-yaml", "coco128", "--out", str(tmp_path / "b")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert res.stdout.strip().endswith("data.yaml")
    data = yaml.safe_load((tmp_path / "b/data.yaml").read_text())
    assert data["train"] == data["val"] == "images/train2017"
    assert len(data["names"]) == 80


def test_write_yaml_missing_data_error_names_the_fix(tmp_path):
    path = write_yaml("coco", tmp_path / "coco")
    with pytest.raises(ValueError, match=r"train2017\.txt.*coco2yolo"):
        load_dataset_file(path)
    with pytest.raises(ValueError, match=r"not found.*coco2yolo --write-yaml"):
        load_dataset_file(tmp_path / "nowhere" / "data.yaml")
