"""`python -m yolo5l.val`, `python -m yolo5l.predict` and `data.batch_size=-1` (the batch size search), run as a user
runs them, on the weights of one shared smoke training run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def run(entry: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", entry, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict[str, Path]:
    """One short training run: its weights.pt and the synthetic dataset it trained on (no plots: none is read)."""
    tmp = tmp_path_factory.mktemp("entry")
    root = tmp / "synthetic"
    r = run(
        "yolo5l.train",
        "experiment=smoke",
        f"hydra.run.dir={tmp / 'train'}",
        f"data.synthetic.root={root}",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "~callbacks.batch_plotter",
        "logger=none",
        "plots=false",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # Lightning's records reach the console once (through Hydra's root handler), not also through its own handler.
    assert (r.stdout + r.stderr).count("`Trainer(limit_val_batches=1)` was configured") == 1
    assert "GPU available:" not in r.stdout + r.stderr  # the start-up block names the devices
    weights = tmp / "train" / "checkpoints" / "weights.pt"
    assert weights.is_file()
    return {"tmp": tmp, "root": root, "weights": weights}


#: `python -m yolo5l.val` on the smoke run's weights and dataset, at its training size, on the CPU.
VAL_ARGS = ("data.synthetic.num_train=32", "data.synthetic.num_val=16", "data.imgsz=128", "data.num_workers=0",
            "trainer=cpu", "data.val_batch_size=8")  # fmt: skip


def _val(smoke: dict[str, Path], out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run("yolo5l.val", f"weights={smoke['weights']}", f"data.synthetic.root={smoke['root']}", *VAL_ARGS, *extra,
               f"hydra.run.dir={out}")  # fmt: skip


@pytest.fixture(scope="module")
def val_default(smoke) -> tuple[subprocess.CompletedProcess, Path]:
    """One validation with the command's defaults (channels_last among them): its result and its run folder."""
    out = smoke["tmp"] / "val"
    return _val(smoke, out), out


def test_val_prints_table_and_writes_metrics(val_default):
    r, out = val_default
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if "mAP@0.5:0.95" in ln)
    assert lines[head].split() == ["precision", "recall", "mAP@0.5", "mAP@0.5:0.95"]
    row = [float(v) for v in lines[head + 1].split()]
    metrics = json.loads((out / "metrics.json").read_text())
    for value, key in zip(row, ("val/precision", "val/recall", "val/map_50", "val/map"), strict=True):
        assert 0.0 <= metrics[key] <= 1.0, key
        assert value == pytest.approx(metrics[key], abs=1e-4), key
    assert metrics["val/map"] <= metrics["val/map_50"]
    assert str(out / "metrics.json") in r.stdout or "metrics.json" in r.stdout


@pytest.mark.parametrize("entry", ["val", "predict"])
def test_collector_is_paused_for_start_up_and_running_for_the_work(smoke, entry, monkeypatch):
    """As for training (tests/test_cli.py): start-up runs without the cyclic GC, the work with it, on what start-up
    built frozen."""
    import gc

    import lightning.pytorch as pl

    import yolo5l.infer.boxes
    import yolo5l.predict
    import yolo5l.val

    seen = {}

    def probe(*_a, **_k):
        seen["work"], seen["frozen"] = gc.isenabled(), gc.get_freeze_count()
        raise KeyboardInterrupt  # stop here: the commands themselves are tested around this test

    monkeypatch.setattr(pl.Trainer, "validate", probe)  # where validation starts
    monkeypatch.setattr(yolo5l.infer.boxes, "non_max_suppression", probe)  # after prediction's first forward
    common = [f"weights={smoke['weights']}", f"hydra.run.dir={smoke['tmp'] / f'gc_{entry}'}"]
    if entry == "val":
        args = [*common, f"data.synthetic.root={smoke['root']}", "data.synthetic.num_train=32",
                "data.synthetic.num_val=16", "data.imgsz=128", "trainer=cpu", "data.val_batch_size=8"]  # fmt: skip
    else:
        args = [*common, f"source={next(smoke['root'].rglob('*.jpg'))}", "imgsz=128", "device=cpu"]
    monkeypatch.setattr(sys, "argv", [f"yolo5l.{entry}", *args])
    main = yolo5l.val.main if entry == "val" else yolo5l.predict.main
    before = gc.get_freeze_count()
    try:
        with pytest.raises(KeyboardInterrupt):
            main()
        seen["left"] = gc.get_freeze_count()
    finally:
        gc.unfreeze()
        gc.enable()
    assert seen["work"] is True
    assert seen["frozen"] > before + 10_000
    assert seen["left"] == before  # handed back as the interrupted work left `running`


def test_val_channels_last_gives_the_same_metrics(smoke, val_default):
    """`channels_last` (the default) is only a memory format: metrics equal the channels-first run's."""
    r, out = val_default
    assert r.returncode == 0, r.stderr[-3000:]
    assert "module.channels_last" not in (out / ".hydra" / "overrides.yaml").read_text()  # the default: true
    metrics = {"true": json.loads((out / "metrics.json").read_text())}
    out = smoke["tmp"] / "val_cl_false"
    r = _val(smoke, out, "module.channels_last=false")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics["false"] = json.loads((out / "metrics.json").read_text())
    for key in ("val/map_50", "val/map", "val/precision", "val/recall"):
        assert metrics["true"][key] == pytest.approx(metrics["false"][key], abs=2e-3), key


def test_val_coco_backend_and_a_bad_backend(smoke):
    out = smoke["tmp"] / "val_coco"
    r = _val(smoke, out, "module/metric=coco")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["val/map"] <= metrics["val/map_50"] <= 1.0
    r = _val(smoke, smoke["tmp"] / "val_bad", "module/metric=voc")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "unknown module/metric 'voc': choose one of coco, yolov5" in r.stderr


def test_predict_writes_drawn_images_json_and_txt(smoke):
    src = smoke["tmp"] / "images"
    src.mkdir()
    val_images = sorted((smoke["root"]).rglob("*.jpg"))[:3]
    assert len(val_images) == 3
    for p in val_images:
        shutil.copy(p, src / p.name)
    out = smoke["tmp"] / "predict"
    r = run(
        "yolo5l.predict",
        f"weights={smoke['weights']}",
        f"source={src}",
        "imgsz=128",
        "conf_thres=0.001",  # a 2-step model: low scores, but boxes
        "max_det=50",
        "device=cpu",
        f"hydra.run.dir={out}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    preds = json.loads((out / "predictions.json").read_text())
    assert preds, "no detections at conf 0.001"
    names = {0: "rectangle", 1: "ellipse", 2: "triangle", 3: "cross"}
    by_image: dict[str, list[dict]] = {}
    for d in preds:
        by_image.setdefault(Path(d["image"]).name, []).append(d)
    assert set(by_image) <= {p.name for p in val_images}
    for p in val_images:
        h, w = cv2.imread(str(p)).shape[:2]
        dets = by_image.get(p.name, [])
        assert len(dets) <= 50
        for d in dets:
            x1, y1, x2, y2 = d["box_xyxy"]
            assert 0 <= x1 <= x2 <= w
            assert 0 <= y1 <= y2 <= h
            assert d["name"] == names[d["class"]]
            assert 0.001 <= d["score"] <= 1
        drawn = cv2.imread(str(out / p.name))
        assert drawn is not None
        assert drawn.shape[:2] == (h, w)
        if dets:
            assert (drawn != cv2.imread(str(p))).any()  # boxes drawn
        txt = (out / "labels" / f"{p.stem}.txt").read_text().split("\n")[:-1]
        assert len(txt) == len(dets)
        for line, d in zip(txt, dets, strict=True):
            c, cx, cy, bw, bh, score = line.split()
            assert int(c) == d["class"]
            x1, y1, x2, y2 = d["box_xyxy"]
            assert float(cx) == pytest.approx((x1 + x2) / 2 / w, abs=1e-3)
            assert float(cy) == pytest.approx((y1 + y2) / 2 / h, abs=1e-3)
            assert float(bw) == pytest.approx((x2 - x1) / w, abs=1e-3)
            assert float(bh) == pytest.approx((y2 - y1) / h, abs=1e-3)
            assert all(0 <= float(v) <= 1 for v in (cx, cy, bw, bh, score))


def test_batch_size_search_refuses_two_devices(tmp_path):
    r = run(
        "yolo5l.train",
        f"hydra.run.dir={tmp_path / 'run'}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "data.batch_size=-1",
        timeout=120,
    )
    assert r.returncode == 2
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: data.batch_size=-1")
    assert "needs a single device" in last


def test_finetune_from_ultralytics_weights_with_frozen_backbone(tmp_path):
    """`weights=<ultralytics yolov5s.pt> freeze=10`: every tensor but the Detect convs (80 -> 4 classes) is taken from
    the file, and the frozen backbone's convolutions leave training unchanged."""
    import torch
    from test_weights import YOLOV5S_YAML, _randomize, _ultralytics_ckpt, fake_ultralytics

    with fake_ultralytics() as yolo:
        torch.manual_seed(0)
        src = yolo.DetectionModel(YOLOV5S_YAML)
        _randomize(src)
        src.half()
        path = tmp_path / "yolov5s.pt"
        torch.save(_ultralytics_ckpt(src), path)
        src_state = {k: v.float() for k, v in src.state_dict().items()}
    run_dir = tmp_path / "run"
    r = run(
        "yolo5l.train",
        "experiment=smoke",
        "model=yolov5s",
        f"weights={path}",
        "freeze=10",
        f"hydra.run.dir={run_dir}",
        f"data.synthetic.root={tmp_path / 'synthetic'}",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "logger=none",
        "plots=false",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"transferred 343/349 items from {path}" in r.stdout + r.stderr
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    trained = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    backbone = [k for k in src_state if k.startswith(tuple(f"model.{i}." for i in range(10))) and "conv.weight" in k]
    assert len(backbone) > 20
    for k in backbone:  # frozen: exactly the file's weights (EMA of a constant is that constant)
        torch.testing.assert_close(trained[k], src_state[k], rtol=0, atol=0, msg=k)
    assert not torch.equal(trained["model.17.cv1.conv.weight"], src_state["model.17.cv1.conv.weight"])  # trained
    torch.testing.assert_close(trained["model.24.anchors"], src_state["model.24.anchors"])


def test_commands_other_than_train_import_lightning_only_for_their_work():
    """What `python -m yolo5l.<entry>` imports before its config is checked stays light: a mistake or `--help` is
    answered without importing Lightning (and with it SciPy and torch._dynamo, 2-3 s on a small CPU). One process
    imports each command in turn (what an earlier one imported cannot hide a later one's import of Lightning: it
    would have been seen then), then asks val for its `--help`."""
    entries = ["val", "predict", "export", "convert", "benchmark"]
    code = (
        "import json, sys\n"
        "heavy = lambda: sorted({'lightning', 'scipy'} & set(sys.modules))\n"
        "seen = {}\n"
        f"for entry in {entries!r}:\n"
        "    __import__(f'yolo5l.{entry}')\n"
        "    seen[entry] = heavy()\n"
        "sys.argv = ['yolo5l.val', '--help']\n"
        "try:\n"
        "    sys.modules['yolo5l.val'].main()\n"
        "except SystemExit as e:\n"
        "    seen['val --help'] = [e.code, *heavy()]\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {**{e: [] for e in entries}, "val --help": [0]}
