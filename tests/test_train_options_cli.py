"""v7.0 train.py's options from the command line: `python -m yolo5l.train data.single_cls=true ...`, and
`python -m yolo5l.val data.single_cls=true` (v7.0 val.py `--single-cls`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yolo5l.base.errors import UserError
from yolo5l.config import check_train_config, compose_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
SYNTHETIC = ["data.synthetic.num_train=16", "data.synthetic.num_val=8", "data.synthetic.seed=0"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    from yolo5l.data.synthetic import ensure_synthetic

    root = tmp_path_factory.mktemp("synthetic")
    ensure_synthetic(root=root, num_train=16, num_val=8, seed=0)  # as SYNTHETIC says
    return root


def test_val_single_cls_takes_a_model_of_any_class_count(tmp_path, synthetic, one_thread):
    """v7.0 val.py --single-cls skips the class-count check: a 4-class model is judged as one class, "item"."""
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5
    from yolo5l.validation import validate_weights

    names = ["rectangle", "ellipse", "triangle", "cross"]
    weights = save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125), tmp_path / "w.pt", names, imgsz=64)
    common = [f"weights={weights}", f"data.synthetic.root={synthetic}", *SYNTHETIC, "data.imgsz=64"]
    common.append("trainer.accelerator=cpu")
    cfg = compose_config([*common, "data.single_cls=true", "plots=false"], "val", output_dir=tmp_path / "val")
    metrics = validate_weights(cfg)
    assert "val/map" in metrics
    table = (tmp_path / "val" / "per_class.csv").read_text()
    assert "item" in table
    assert not any(name in table for name in names)
    other = tmp_path / "one.yaml"
    other.write_text(f"path: {synthetic}\ntrain: images/train\nval: images/val\nnames: [thing]\n")
    cfg = compose_config([*common[:1], f"data.file={other}", "data.imgsz=64"], "val", tmp_path / "v2")
    with pytest.raises(UserError, match="predicts 4 classes"):  # without it, a one-class dataset is refused
        validate_weights(cfg)


def test_exported_file_validation_single_cls(synthetic):
    """An exported model is judged the same way: NMS across classes, every detection class 0."""
    from yolo5l.data.datamodule import YOLODataModule
    from yolo5l.val_tasks import validate_exported

    def model(images: torch.Tensor) -> torch.Tensor:  # two overlapping boxes of classes 2 and 3 in every image
        boxes = torch.tensor([[30.0, 30, 20, 20, 0.9, 0, 0, 0.9, 0.1], [31.0, 30, 20, 20, 0.8, 0, 0, 0.1, 0.9]])
        return boxes.expand(images.shape[0], 2, 9)

    class Capture:
        def __init__(self) -> None:
            self.seen: list = []

        def to(self, device):
            return self

        def update(self, dets, gt):
            self.seen.append((dets, gt))

        def compute(self):
            return {"map": torch.tensor(0.0)}

    spec = {"root": str(synthetic), "num_train": 16, "num_val": 8, "seed": 0}
    dm = YOLODataModule(synthetic=spec, imgsz=64, batch_size=4, num_workers=0, single_cls=True)
    capture = Capture()
    validate_exported(model, dm, capture, single_cls=True)
    dets = [d for batch, _ in capture.seen for d in batch]
    gts = [g for _, batch in capture.seen for g in batch]
    assert len(dets) == 8
    assert all(len(d) == 1 and d[0, 5] == 0 for d in dets)
    assert all((g[:, 4] == 0).all() for g in gts)
    assert sum(len(g) for g in gts) > 0


def test_bad_option_values_are_one_line(tmp_path):
    cfg = compose_config(["data.rect=true", "data.image_weights=true"], output_dir=tmp_path)
    with pytest.raises(UserError, match="exclude each other"):
        check_train_config(cfg)
    with pytest.raises(UserError, match=r"data\.quad='yes' must be true or false"):
        check_train_config(compose_config(["data.quad=yes"], output_dir=tmp_path))  # compose_config says it first


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "yolo5l.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900)


@pytest.mark.slow
def test_every_option_trains_resumes_exactly_and_validates(tmp_path, synthetic):
    """single_cls, image_weights, multi_scale, quad, save_period and hyp=<file> in one run; resumed from its
    epoch0.ckpt it ends with the uninterrupted run's weights; its weights.pt validates with single_cls."""
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text("mixup: 0.3\nlr0: 0.02\n")
    run = tmp_path / "run"
    args = [
        "experiment=smoke", f"data.synthetic.root={synthetic}", *SYNTHETIC, "data.imgsz=64", "data.batch_size=8",
        "trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=csv",
        "~callbacks.batch_plotter", "data.single_cls=true", "data.image_weights=true", "data.multi_scale=true",
        "data.quad=true", "callbacks.checkpoint.save_period=1", f"hyp={hyp}",
    ]  # fmt: skip
    proc = _train(*args, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = run / "checkpoints"
    assert {p.name for p in ckpts.glob("epoch*.ckpt")} == {"epoch0.ckpt", "epoch1.ckpt"}
    straight = torch.load(ckpts / "last.ckpt", weights_only=True)
    config = straight["yolo5l_config"]
    assert (config["hyp"]["mixup"], config["hyp"]["lr0"]) == (0.3, 0.02)
    assert config["hyp_file"] == str(hyp)
    assert straight["state_dict"]["model.model.24.m.0.weight"].shape[0] == 3 * 6  # one class: 3 anchors x (5 + 1)
    assert "image_weights_maps" in straight["YOLODataModule"]

    shutil.copy(ckpts / "last.ckpt", tmp_path / "straight.ckpt")
    proc = _train(f"resume={ckpts / 'epoch0.ckpt'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == straight["global_step"]
    for part in ("state_dict", "current_model_state"):
        for k, v in straight[part].items():
            assert torch.equal(resumed[part][k], v), f"{part}[{k}]"

    cmd = [sys.executable, "-m", "yolo5l.val", f"weights={ckpts / 'weights.pt'}", f"data.synthetic.root={synthetic}"]
    cmd += SYNTHETIC
    proc = subprocess.run(
        [*cmd, "data.single_cls=true", f"hydra.run.dir={tmp_path / 'val'}", "trainer.accelerator=cpu"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "item" in proc.stdout


# ultralytics/yolov5 v7.0 train.py::parse_opt: every argument, aliases included
V7_TRAIN_FLAGS = (
    "weights", "cfg", "data", "hyp", "epochs", "batch-size", "imgsz", "img", "img-size", "rect", "resume", "nosave",
    "noval", "noautoanchor", "noplots", "evolve", "bucket", "cache", "image-weights", "device", "multi-scale",
    "single-cls", "optimizer", "sync-bn", "workers", "project", "name", "exist-ok", "quad", "cos-lr",
    "label-smoothing", "patience", "freeze", "save-period", "seed", "local_rank", "entity", "upload_dataset",
    "bbox_interval", "artifact_alias",
)  # fmt: skip


def test_the_flag_table_has_every_v7_train_flag():
    table = (Path(__file__).parents[1] / "docs" / "cli.md").read_text().split("\n## ")[0]  # the train.py table
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    flags = [f.lstrip("-") for row in rows for f in row.split("|")[1].replace("`", " ").split() if f.startswith("--")]
    assert sorted(set(flags)) == sorted(V7_TRAIN_FLAGS)
    assert all(row.split("|")[2].strip() for row in rows)  # each has a yolo5l form, or says why none
