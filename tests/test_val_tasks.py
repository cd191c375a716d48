"""`python -m yolo5l.val` tasks and saved predictions: task=val|test|train|speed|study, augment, save_txt, save_conf,
save_hybrid (in-process through the entry point's own function, on a tiny synthetic dataset)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.data.letterbox import resized_shape
from yolo5l.val_tasks import check_val_options
from yolo5l.validation import validate_weights

COMMON = ["data.num_workers=0", "trainer.accelerator=cpu", "trainer.precision=32", "plots=false",
          "data.val_batch_size=4", "data.imgsz=64", "data.cache=none"]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """Tiny yolov5 weights (width 0.125) for the 4 synthetic classes, the synthetic data yaml (4 val images) and one
    with a 3-image test split (train images copied as test)."""
    from yolo5l.data.synthetic import ensure_synthetic
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    tmp = tmp_path_factory.mktemp("valtasks")
    plain = ensure_synthetic(tmp / "syn", num_train=5, num_val=4, min_side=80, max_side=140)
    root = plain.parent
    for kind in ("images", "labels"):
        (root / kind / "test").mkdir()
        for f in sorted((root / kind / "train").iterdir())[:3]:
            shutil.copy(f, root / kind / "test" / f.name)
    data = yaml.safe_load(plain.read_text())
    with_test = root / "with_test.yaml"
    with_test.write_text(yaml.safe_dump({**data, "test": "images/test"}))
    torch.manual_seed(0)
    weights = tmp / "w.pt"
    save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125), weights, imgsz=64)
    return {"tmp": tmp, "plain": plain, "with_test": with_test, "weights": weights, "root": root}


def val(setup, out: str, *args: str, data: str = "with_test") -> tuple[dict[str, float], Path]:
    run = setup["tmp"] / out
    cfg = compose_config([f"weights={setup['weights']}", f"data.file={setup[data]}", *COMMON, *args], "val", run)
    return validate_weights(cfg), run


@pytest.mark.parametrize(("task", "images"), [("val", 4), ("test", 3), ("train", 5)])
def test_task_picks_the_split(setup, capsys, task, images):
    metrics, _ = val(setup, f"split_{task}", f"task={task}")
    out = capsys.readouterr().out
    assert f"{task}: {images} images" in out
    row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["all"])
    assert int(row.split()[1]) == images  # the per-class table's image count
    assert 0.0 <= metrics["val/map"] <= 1.0


def test_a_missing_test_split_is_one_line(setup):
    with pytest.raises(UserError, match=r"has no 'test:' split: add test: .* or validate on task=val"):
        val(setup, "no_test", "task=test", data="plain")
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.val", f"weights={setup['weights']}", f"data.file={setup['plain']}", *COMMON,
         "task=test", f"hydra.run.dir={setup['tmp'] / 'no_test_cli'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: Dataset file")
    with pytest.raises(UserError, match="task='tset' is not a task: choose one of val, test, train, speed, study"):
        val(setup, "bad_task", "task=tset")


def _label_rows(path: Path) -> np.ndarray:
    return np.loadtxt(path, ndmin=2) if path.is_file() and path.stat().st_size else np.zeros((0, 6))


def test_save_hybrid_writes_every_label_plus_predictions(setup):
    metrics, run = val(setup, "hybrid", "save_hybrid=true", "save_conf=true", "module.conf_thres=0.001")
    assert metrics["val/map_50"] > 0.99  # the labels are among the "predictions", at score 1 (v7.0 warns of this)
    for label in sorted((setup["root"] / "labels" / "val").glob("*.txt")):
        truth = np.loadtxt(label, ndmin=2)
        rows = _label_rows(run / "labels" / label.name)
        assert rows.shape[1] == 6  # class cx cy w h score
        at_one = rows[rows[:, 5] == 1.0, :5]
        assert len(at_one) == len(truth)
        order = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
        # Boxes map back with the height's ratio h / h0 on both axes (v7.0's scale_boxes), and the resized sides are
        # whole pixels (v7.0's load_image truncates them): x comes back scaled by (w / w0) / (h / h0).
        with Image.open(setup["root"] / "images" / "val" / f"{label.stem}.jpg") as im:
            w0, h0 = im.size
        h, w = resized_shape(h0, w0, 64)
        fx = (w / w0) / (h / h0)
        np.testing.assert_allclose(order(at_one), order(truth * [1, fx, 1, fx, 1]), atol=1e-4)
        assert len(rows) >= len(truth)


_DIRECT: dict[bool, dict[str, list[str]]] = {}


@torch.no_grad()
def _direct_predictions(setup, augment: bool) -> dict[str, list[str]]:
    """What val should write with save_txt, computed here from the weights, the datamodule's batches, TTA and NMS."""
    if augment in _DIRECT:
        return _DIRECT[augment]
    from hydra.utils import instantiate

    from yolo5l.eval.save_preds import txt_lines
    from yolo5l.infer.boxes import non_max_suppression, to_original
    from yolo5l.infer.tta import augmented_decode
    from yolo5l.models.weights import load_weights

    model = load_weights(setup["weights"])[0].fuse().eval()
    cfg = compose_config([f"weights={setup['weights']}", f"data.file={setup['with_test']}", *COMMON], "val",
                         setup["tmp"] / "direct")  # fmt: skip
    dm = instantiate(cfg.data, _convert_="all")
    out = {}
    for images, _, paths, shapes in dm.val_dataloader():
        images = images.float() / 255
        decoded = augmented_decode(model, images) if augment else model.decode(model(images))
        dets = non_max_suppression(decoded, 0.001, 0.6, multi_label=True, max_det=300)
        dets = to_original(dets, images.shape[2:], shapes)
        for det, path, shape in zip(dets, paths, shapes, strict=True):
            if len(det):
                out[Path(path).stem] = txt_lines(det, shape[0], save_conf=False)
    _DIRECT[augment] = out
    return out


@pytest.mark.parametrize("augment", [False, True])
def test_save_txt_equals_the_direct_computation_with_and_without_tta(setup, augment):
    _, run = val(setup, f"txt_{augment}", "save_txt=true", f"augment={str(augment).lower()}",
                 "module.conf_thres=0.001", "module.fuse_eval=true")  # fmt: skip
    want = _direct_predictions(setup, augment)
    got = {p.stem: p.read_text().splitlines() for p in (run / "labels").glob("*.txt")}
    assert want
    assert set(got) == set(want)
    for stem, lines in want.items():
        assert len(got[stem]) == len(lines), stem
        g = np.array([[float(v) for v in ln.split()] for ln in got[stem]])
        w = np.array([[float(v) for v in ln.split()] for ln in lines])
        assert g.shape[1] == 5  # no score without save_conf
        np.testing.assert_allclose(g, w, atol=1e-4)
    if augment:  # TTA gives other detections than the plain pass
        assert want != _direct_predictions(setup, False)


def test_speed_prints_and_writes_v7_lines_at_batch_1_and_the_configured_batch(setup, capsys):
    _, run = val(setup, "speed", "task=speed")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Speed: ")]
    assert len(lines) == 2
    assert lines[0].endswith("NMS per image at shape (1, 3, 64, 64)")
    assert lines[1].endswith("NMS per image at shape (4, 3, 64, 64)")
    assert "ms pre-process, " in lines[0]
    assert "ms inference, " in lines[0]
    speed = json.loads((run / "speed.json").read_text())
    assert [s["shape"][0] for s in speed] == [1, 4]
    assert all(s["images"] == 4 and s["inference_ms"] > 0 and s["nms_ms"] >= 0 for s in speed)


@pytest.mark.parametrize(("augment", "sizes"), [("false", [64, 96]), ("true", [96])])
def test_study_rows_equal_val_at_each_size(setup, augment, sizes):
    """The study's plain loop (with TTADetector under augment) gives the mAP of the Lightning validation."""
    _, run = val(setup, f"study_{augment}", "task=study", f"study_sizes={sizes}".replace(" ", ""), f"augment={augment}")
    rows = (run / "study.csv").read_text().splitlines()
    assert rows[0].split(",") == ["imgsz", "precision", "recall", "map_50", "map", "pre_process_ms", "inference_ms",
                                  "nms_ms"]  # fmt: skip
    assert [int(r.split(",")[0]) for r in rows[1:]] == sizes
    assert (run / "study.png").stat().st_size > 1000
    metrics, _ = val(setup, f"study_check_{augment}", "data.imgsz=96", f"augment={augment}")
    row = [float(v) for v in rows[-1].split(",")]
    assert row[3] == pytest.approx(metrics["val/map_50"], abs=1e-5)
    assert row[4] == pytest.approx(metrics["val/map"], abs=1e-5)
    assert row[6] > 0


@pytest.mark.parametrize("task", ["speed", "study"])
def test_speed_and_study_take_the_weights_dataset_and_study_checks_the_classes(setup, capsys, task):
    """As task=val: without data= the dataset the weights record (not the default synthetic set, generated for
    nothing); a study, which scores the model, refuses a model of other classes."""
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    torch.manual_seed(0)
    own = save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125), setup["tmp"] / f"own_{task}.pt", imgsz=64,
                       data=str(setup["with_test"]))  # fmt: skip
    run = setup["tmp"] / f"own_data_{task}"
    sizes = ["study_sizes=[64]"] if task == "study" else []
    capsys.readouterr()
    validate_weights(compose_config([f"weights={own}", *COMMON, f"task={task}", *sizes], "val", run))
    out = capsys.readouterr().out
    assert "/with_test.yaml (the dataset the weights were trained on)" in out
    assert "val: 4 images" in out  # with_test's val split, not the default set's
    one_class = save_weights(YOLOv5(num_classes=1, depth=0.33, width=0.125), setup["tmp"] / f"one_{task}.pt")
    cfg = compose_config([f"weights={one_class}", f"data.file={setup['with_test']}", *COMMON, f"task={task}", *sizes],
                         "val", setup["tmp"] / f"one_class_{task}")  # fmt: skip
    if task == "speed":  # times only: any images do
        validate_weights(cfg)
        return
    with pytest.raises(UserError, match=r"one_study\.pt predicts 1 classes but the dataset has 4: pass the data="):
        validate_weights(cfg)


def test_study_and_speed_of_a_p6_model_use_its_stride(setup):
    """A P6 model's rectangular batches and study sizes are multiples of 64, its largest stride."""
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    torch.manual_seed(0)
    p6 = setup["tmp"] / "p6.pt"
    save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125, cfg="p6"), p6, imgsz=128)
    run = setup["tmp"] / "study_p6"
    cfg = compose_config([f"weights={p6}", f"data.file={setup['with_test']}", *COMMON, "task=study",
                          "study_sizes=[128]"], "val", run)  # fmt: skip
    validate_weights(cfg)
    assert [int(r.split(",")[0]) for r in (run / "study.csv").read_text().splitlines()[1:]] == [128]
    cfg = compose_config([f"weights={p6}", f"data.file={setup['with_test']}", *COMMON, "task=study",
                          "study_sizes=[64,96]"], "val", setup["tmp"] / "study_p6_bad")  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"study_sizes=96 is not a positive multiple of 64, .*: try 64 or 128",
    ):
        validate_weights(cfg)


def test_bad_study_sizes_and_augment_of_an_exported_file(setup):
    with pytest.raises(UserError, match=r"study_sizes=\[64, 100\] must be a list of image sizes"):
        val(setup, "bad_sizes", "task=study", "study_sizes=[64,100]")
    fake = setup["tmp"] / "model.onnx"
    fake.write_bytes(b"")
    cfg = compose_config([f"weights={fake}", "augment=true", *COMMON], "val", setup["tmp"] / "onnx")
    with pytest.raises(UserError, match=r"augment=true needs \.pt weights"):
        validate_weights(cfg)


def test_a_test_split_from_the_val_folder_keeps_its_own_label_cache(tmp_path):
    from yolo5l.data.dataset_yaml import load_dataset_file

    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"not read here")
    data = {"path": str(tmp_path), "train": "images", "val": "images", "names": ["x"]}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({**data, "test": "images"}))
    without, spec = load_dataset_file(tmp_path / "d.yaml"), load_dataset_file(tmp_path / "t.yaml")
    assert spec.files("test") == spec.files("val") == [tmp_path / "images" / "a.jpg"]
    assert spec.cache_path("val") == without.cache_path("val")  # unchanged by the test entry
    assert spec.cache_path("train") == without.cache_path("train")
    assert len({spec.cache_path(s) for s in ("train", "val", "test")}) == 3
    with pytest.raises(UserError, match="has no 'test:' split"):
        without.files("test")


def _precision(tmp_path, *args: str) -> str:
    return compose_config(["weights=w.pt", *args], "val", tmp_path / "run").trainer.precision


def test_val_precision_is_float32_unless_half_as_v7(tmp_path, monkeypatch):
    """v7.0's val.py runs float32 unless --half (fp16, on CUDA only), and times speed/study in fp16 on a GPU. On a CPU
    with bf16 (faked here) val's default is float32 too; half=true asks for bf16 autocast there."""
    from yolo5l.base import hardware

    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    assert _precision(tmp_path, "trainer.accelerator=cpu") == "32-true"
    assert _precision(tmp_path, "trainer.accelerator=cpu", "half=true") == "bf16-mixed"
    assert _precision(tmp_path, "trainer.accelerator=cpu", "task=speed") == "32-true"
    assert _precision(tmp_path, "trainer.accelerator=cuda") == "32-true"
    assert _precision(tmp_path, "trainer.accelerator=cuda", "half=true") == "16-mixed"
    assert _precision(tmp_path, "trainer.accelerator=cuda", "task=study") == "16-mixed"
    assert _precision(tmp_path, "half=true", "trainer.precision=32-true") == "32-true"  # typed: it decides
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    assert _precision(tmp_path, "trainer.accelerator=cpu", "half=true") == "32-true"


def test_the_trainer_validates_at_the_precision_val_picks(setup, monkeypatch, capsys):
    """On a (faked) bf16 CPU the Trainer of `python -m yolo5l.val` gets 32-true by default and bf16-mixed with
    half=true, with one line saying so; on a CPU without bf16, half=true is one line and float32."""
    import lightning.pytorch as pl

    from yolo5l.base import hardware

    given = []

    class Trainer(pl.Trainer):  # what conf/trainer's `_target_: lightning.pytorch.Trainer` builds, recording
        def __init__(self, *args, precision=None, **kwargs):
            given.append(str(precision))
            super().__init__(*args, precision=precision, **kwargs)

    monkeypatch.setattr(pl, "Trainer", Trainer)
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    common = [a for a in COMMON if not a.startswith("trainer.precision=")]
    for name, args in (("default", []), ("half", ["half=true"])):
        run = setup["tmp"] / f"precision_{name}"
        validate_weights(compose_config([f"weights={setup['weights']}", f"data.file={setup['with_test']}", *common,
                                         *args], "val", run))  # fmt: skip
    assert given == ["32-true", "bf16-mixed"]
    out = capsys.readouterr().out
    assert out.count("half=true") == 1
    assert "half=true on the CPU: bf16 autocast (trainer.precision=bf16-mixed" in out
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    check_val_options(compose_config([f"weights={setup['weights']}", "half=true", "trainer.accelerator=cpu"], "val",
                                     setup["tmp"] / "no_bf16"))  # fmt: skip
    assert "this CPU has no bf16 (AMX or AVX512-BF16): validating in float32" in capsys.readouterr().out
    with pytest.raises(UserError, match="half='yes' must be true or false"):
        check_val_options(compose_config([f"weights={setup['weights']}", "half=yes"], "val", setup["tmp"] / "bad"))


_SPEED = re.compile(r"Speed: ([\d.]+)ms pre-process, ([\d.]+)ms inference, ([\d.]+)ms NMS per image at shape \((.*)\)")


def _speed(out: str) -> tuple[list[float], str]:
    """The figures and the shape of the one Speed line in `out`."""
    lines = [ln for ln in out.splitlines() if ln.startswith("Speed: ")]
    assert len(lines) == 1, lines
    m = _SPEED.fullmatch(lines[0])
    assert m, lines[0]
    return [float(v) for v in m.groups()[:3]], m.group(4)


def test_every_validation_prints_v7s_speed_line(setup, capsys, tmp_path):
    """After the tables, v7.0's per-image times at (batch, 3, imgsz, imgsz), for .pt weights (Lightning's validation)
    and an exported file (the plain loop)."""
    from yolo5l.export import export_weights

    val(setup, "speed_line_pt", "task=test")
    ms, shape = _speed(capsys.readouterr().out)
    assert shape == "3, 3, 64, 64"  # the loader's batch: the 3 test images (data.val_batch_size=4)
    assert all(t >= 0 for t in ms)
    assert ms[1] > 0  # a forward pass takes time; the copy and NMS of 3 tiny images may round to 0.0
    cfg = compose_config([f"weights={setup['weights']}", "format=torchscript", f"output={tmp_path / 'w.torchscript'}",
                          "imgsz=64", "device=cpu"], "export", tmp_path / "export")  # fmt: skip
    exported = export_weights(cfg)
    capsys.readouterr()
    run = tmp_path / "val_exported"
    validate_weights(compose_config([f"weights={exported}", f"data.file={setup['with_test']}", *COMMON], "val", run))
    ms, shape = _speed(capsys.readouterr().out)
    assert shape == "4, 3, 64, 64"
    assert all(t >= 0 for t in ms)
    assert sum(ms) > 0


@pytest.mark.parametrize("cache", ["ram", "disk"])
def test_standalone_val_caches_the_split_it_validates(setup, capsys, cache):
    """`data.cache=ram|disk` (v7.0's train.py `--cache`, which caches the val images too) works for a validation alone:
    the split's images are cached and the metrics are those without a cache; a second run reads the disk cache."""
    plain, _ = val(setup, f"no_cache_{cache}")
    capsys.readouterr()
    cached, _ = val(setup, f"cache_{cache}", f"data.cache={cache}")
    out = capsys.readouterr().out
    ram, disk = r"cached 4 images \(.*\) in RAM", r"disk cache .*: 4 images \(.*\), 4 written, 0 reused"
    line = ram if cache == "ram" else disk
    assert re.search(rf"^val: 4 images, .*; {line}$", out, re.M), out
    assert cached == pytest.approx(plain, abs=1e-6)
    if cache == "disk":
        assert len(list(setup["root"].glob("images/val.npycache/*/*.npy"))) == 4
        again, _ = val(setup, "cache_disk_again", "data.cache=disk")
        assert re.search(r"^val: 4 images, .*; disk cache .*: 4 images \(.*\), 0 written, 4 reused$",
                         capsys.readouterr().out, re.M)  # fmt: skip
        assert again == pytest.approx(plain, abs=1e-6)


def test_an_image_size_off_the_stride_is_rounded_up_with_a_warning(setup, capsys):
    """v7.0's check_img_size: the next multiple of the model's largest stride (64 for P6), one warning line."""
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    val(setup, "imgsz_70", "data.imgsz=70")
    out = capsys.readouterr().out
    assert "warning: data.imgsz=70 is not a multiple of 32, the model's largest stride: using data.imgsz=96" in out
    assert _speed(out)[1] == "4, 3, 96, 96"
    torch.manual_seed(0)
    p6 = setup["tmp"] / "p6_imgsz.pt"
    save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125, cfg="p6"), p6, imgsz=128)
    cfg = compose_config([f"weights={p6}", f"data.file={setup['with_test']}", *COMMON, "data.imgsz=96"], "val",
                         setup["tmp"] / "imgsz_p6")  # fmt: skip
    validate_weights(cfg)
    out = capsys.readouterr().out
    assert out.count("warning: data.imgsz=") == 1
    assert "data.imgsz=96 is not a multiple of 64, the model's largest stride: using data.imgsz=128" in out
    assert _speed(out)[1] == "4, 3, 128, 128"


# ultralytics/yolov5 v7.0 val.py::parse_opt and detect.py::parse_opt: every argument, aliases included
V7_VAL_FLAGS = (
    "data", "weights", "batch-size", "imgsz", "img", "img-size", "conf-thres", "iou-thres", "max-det", "task", "device",
    "workers", "single-cls", "augment", "verbose", "save-txt", "save-hybrid", "save-conf", "save-json", "project",
    "name", "exist-ok", "half", "dnn",
)  # fmt: skip
V7_DETECT_FLAGS = (
    "weights", "source", "data", "imgsz", "img", "img-size", "conf-thres", "iou-thres", "max-det", "device", "view-img",
    "save-txt", "save-conf", "save-crop", "nosave", "classes", "agnostic-nms", "augment", "visualize", "update",
    "project", "name", "exist-ok", "line-thickness", "hide-labels", "hide-conf", "half", "dnn", "vid-stride",
)  # fmt: skip


@pytest.mark.parametrize(("script", "flags"), [("val.py", V7_VAL_FLAGS), ("detect.py", V7_DETECT_FLAGS)])
def test_the_flag_tables_have_every_v7_val_and_detect_flag(script, flags):
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    section = next(s for s in text.split("\n## ")[1:] if s.startswith(f"ultralytics/yolov5 v7.0 `{script}`"))
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    found = [f.lstrip("-") for row in rows for f in row.split("|")[1].replace("`", " ").split() if f.startswith("--")]
    assert sorted(set(found)) == sorted(flags)
    assert all(row.split("|")[2].strip() for row in rows)  # each has a yolo5l form, or says why none
