"""`python -m yolo5l.export` and `yolo5l.deploy.exported`: real ONNX and TorchScript files of a small yolov5n, run with
onnxruntime and torch.jit on real images and compared with PyTorch; `yolo5l.val` and `yolo5l.predict` on them."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import re
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import onnx
from _deploy_model import untrained_weights

from yolo5l import _cli
from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.data.letterbox import letterbox
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.deploy.exported import EXTRA_HINT, ExportedModel, load_exported
from yolo5l.export import export_weights
from yolo5l.exporter import DecodedYOLOv5, export_model, prepare_for_export
from yolo5l.models.weights import load_weights, save_weights
from yolo5l.models.yolo import YOLOv5

NAMES = ["rectangle", "ellipse", "triangle", "cross"]  # the synthetic dataset's classes
IMGSZ = 128
# fp32 through another runtime: the same math, other kernels and summation orders (about 1e-4 px seen at 128 px).
TOL = {"rtol": 1e-4, "atol": 1e-3}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def weights(tmp) -> Path:
    """An untrained yolov5n for the synthetic classes, with BatchNorm statistics that make fusing change weights."""
    return untrained_weights(tmp / "w.pt", NAMES)


@pytest.fixture(scope="module")
def images(tmp) -> list[Path]:
    """Three JPEGs of shapes on noise, of different sizes and aspect ratios."""
    rng = np.random.default_rng(0)
    folder = tmp / "images"
    folder.mkdir()
    paths = []
    for i, (h, w) in enumerate([(120, 160), (128, 128), (150, 90)]):
        img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        cv2.rectangle(img, (10, 15), (w // 2, h // 2), (30, 200, 60), -1)
        cv2.circle(img, (w * 2 // 3, h * 2 // 3), min(h, w) // 5, (220, 40, 40), -1)
        paths.append(folder / f"im{i}.jpg")
        cv2.imwrite(str(paths[-1]), img)
    return paths


def _batch(paths: list[Path]) -> torch.Tensor:
    boxed = [letterbox(cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB), IMGSZ)[0] for p in paths]
    return torch.from_numpy(np.stack(boxed)).permute(0, 3, 1, 2).float() / 255


def _export(weights: Path, out: Path, *overrides: str) -> Path:
    cfg = compose_config([f"weights={weights}", f"output={out}", f"imgsz={IMGSZ}", "device=cpu", *overrides],
                         config_name="export", output_dir=out.parent / f"run_{out.name}")  # fmt: skip
    return export_weights(cfg)


@pytest.fixture(scope="module")
def command(tmp, weights) -> tuple[int, str]:
    """`python -m yolo5l.export weights=w.pt imgsz=128 dynamic=true`, in this process: (exit code, stdout)."""
    from yolo5l.export import main

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        argv = [f"weights={weights}", f"imgsz={IMGSZ}", "dynamic=true", "device=cpu", f"hydra.run.dir={tmp / 'cli'}"]
        code = _main(main, argv, mp)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def exported(tmp, weights, command) -> dict[str, Path]:
    assert command[0] == 0, command[1]
    return {
        "onnx": tmp / "w.onnx",  # the command's
        "torchscript": _export(weights, tmp / "w.torchscript", "format=torchscript"),
        "static": _export(weights, tmp / "static.onnx", "batch=2"),
    }


@pytest.fixture(scope="module")
def reference(weights):
    """The PyTorch model the files were made from: decoded boxes of a batch."""
    net = DecodedYOLOv5(prepare_for_export(load_weights(weights)[0]))

    @torch.no_grad()
    def run(images: torch.Tensor) -> torch.Tensor:
        return net(images)

    return run


def _main(entry, argv: list[str], monkeypatch) -> int:
    """Run an entry point's main() in this process as the command line would; its exit code."""
    monkeypatch.setattr(sys, "argv", ["yolo5l", *argv])
    monkeypatch.setattr(_cli, "_gc_paused", False)
    monkeypatch.setattr(_cli, "_start_up_frozen", False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        entry()
        return 0
    except SystemExit as e:
        return int(e.code)
    finally:
        gc.unfreeze()
        gc.enable()
        # Hydra gave the root logger a handler on the run folder's job log, which a failed command removes.
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)


# ---- the files --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_file_matches_pytorch_at_batch_1_and_3(exported, images, reference, fmt):
    model, names, imgsz, stride = load_exported(exported[fmt])
    assert (names, imgsz, stride) == (NAMES, IMGSZ, 32)
    assert (model.batch, model.size) == (None, None)  # dynamic: any batch and size
    for paths in (images[:1], images):
        x = _batch(paths)
        got, want = model(x), reference(x)
        assert got.shape == want.shape == (len(paths), 3 * (16**2 + 8**2 + 4**2), 5 + len(NAMES))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, **TOL)
    # Rectangular batches (validation's) run at their own size and batch.
    x = torch.rand(2, 3, 96, 160)
    torch.testing.assert_close(model(x), reference(x), **TOL)


def test_onnx_metadata_and_graph(exported):
    proto = onnx.load(str(exported["onnx"]))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["names"]) == NAMES
    assert (meta["stride"], meta["imgsz"], meta["dynamic"], meta["half"]) == ("32", str(IMGSZ), "true", "false")
    (inp,), (out,) = proto.graph.input, proto.graph.output
    assert (inp.name, out.name) == ("images", "output0")
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "height", "width"]
    # Only standard ONNX operators: no custom op, no Python op.
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    static = onnx.load(str(exported["static"]))
    assert [d.dim_value for d in static.graph.input[0].type.tensor_type.shape.dim] == [2, 3, IMGSZ, IMGSZ]


def test_torchscript_metadata(exported):
    extra = {"config.txt": ""}
    torch.jit.load(str(exported["torchscript"]), _extra_files=extra)
    meta = json.loads(extra["config.txt"])
    assert (meta["names"], meta["stride"], meta["imgsz"], meta["shape"]) == (NAMES, 32, IMGSZ, [1, 3, IMGSZ, IMGSZ])
    assert meta["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_torchscript_runs_where_it_was_traced(exported, images, reference, capsys):
    """The trace keeps its device in the decode's grids: a CPU file asked to run on CUDA runs on the CPU, saying so."""
    model = ExportedModel(exported["torchscript"], device="cuda")
    assert model.device == torch.device("cpu")
    assert "was exported on cpu and runs there" in capsys.readouterr().out
    x = _batch(images[:1])
    torch.testing.assert_close(model(x), reference(x), **TOL)


def test_training_kernels_stay_out_of_the_graph(tmp):
    """A model built with the fused BN+SiLU op and the fused upsample exports plain PyTorch / ONNX operators."""
    model = YOLOv5.from_name("yolov5n", num_classes=2, fused_bn_act=True, fused_upsample=True)
    path, diff = export_model(model, tmp / "fused.torchscript", "torchscript", imgsz=32)
    assert diff < 1e-3
    graph = str(torch.jit.load(str(path)).inlined_graph)
    for forbidden in ("yolo5l::", "PythonOp", "triton"):  # the custom ops, an autograd.Function, Triton kernels
        assert forbidden not in graph
    assert all(isinstance(model.model[i], nn.Upsample) for i in (11, 15))
    path, diff = export_model(model, tmp / "fused.onnx", "onnx", imgsz=32)
    assert diff < 1e-3
    assert {n.domain for n in onnx.load(str(path)).graph.node} <= {"", "ai.onnx"}


def test_static_file_runs_other_batches_and_smaller_images(exported, images, reference):
    model, *_ = load_exported(exported["static"])
    assert (model.batch, model.size) == (2, (IMGSZ, IMGSZ))
    x = _batch(images)  # 3 images: chunks of 2, the last one filled
    torch.testing.assert_close(model(x), reference(x), **TOL)
    small = x[:, :, :96]  # padded at the bottom: the boxes keep their coordinates
    padded = torch.nn.functional.pad(small, (0, 0, 0, IMGSZ - 96), value=114 / 255)
    torch.testing.assert_close(model(small), reference(padded), **TOL)
    with pytest.raises(UserError, match=r"takes 128x128 images .* got 160x160"):
        model(torch.rand(1, 3, 160, 160))


def test_ultralytics_style_metadata_loads(exported, tmp):
    """ultralytics writes names as str(dict) and no imgsz: names come out as a list, the size from the input."""
    proto = onnx.load(str(exported["static"]))
    meta = {p.key: p.value for p in proto.metadata_props}
    del proto.metadata_props[:]
    for key, value in {"stride": "32", "names": str(dict(enumerate(NAMES)))}.items():
        prop = proto.metadata_props.add()
        prop.key, prop.value = key, value
    path = tmp / "ultralytics.onnx"
    onnx.save(proto, str(path))
    _, names, imgsz, stride = load_exported(path)
    assert (names, imgsz, stride) == (NAMES, IMGSZ, 32)
    assert meta["batch"] == "2"


@pytest.mark.slow  # onnx-simplifier is optional, and slow to load and run
def test_simplify(weights, tmp, images, reference):
    pytest.importorskip("onnxsim")
    model, *_ = load_exported(_export(weights, tmp / "simple.onnx", "simplify=true", "dynamic=true"))
    x = _batch(images)
    torch.testing.assert_close(model(x), reference(x), **TOL)


# ---- the command line ---------------------------------------------------------------------------------------------
def test_command_writes_beside_the_weights_and_prints_the_difference(command, tmp):
    code, out = command
    assert code == 0
    assert (tmp / "w.onnx").is_file()
    assert (tmp / "cli" / ".hydra" / "config.yaml").is_file()  # the run folder records what was exported
    (line,) = [ln for ln in out.splitlines() if "max abs difference" in ln]
    assert line.startswith(f"[yolo5l] onnxruntime vs PyTorch on the example input (1, 3, {IMGSZ}, {IMGSZ}) fp32")
    assert float(line.rsplit(" ", 1)[1]) < 1e-3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["half=true", "device=cpu"], "error: half=true needs a CUDA device (device=cuda), not cpu"),
        (["format=pdf"], "error: format='pdf' is not one of: onnx, torchscript, openvino, tflite, ncnn, coreml"),
        (["imgsz=0"], "error: imgsz=0 must be a positive image size in pixels"),
        (["batch=0"], "error: batch=0 must be at least 1"),
        (["opset=9"], "error: opset=9 must be at least 11"),
        (["format=torchscript", "simplify=true"], "error: simplify=true applies to format=onnx"),
        (["output=WEIGHTS"], "error: output="),
    ],
)
def test_mistakes_are_one_line(weights, tmp, monkeypatch, capsys, args, message):
    from yolo5l.export import main

    run_dir = tmp / "mistake"
    args = [a.replace("WEIGHTS", str(weights)) for a in args]
    code = _main(main, [f"weights={weights}", *args, f"hydra.run.dir={run_dir}"], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(message), err
    assert "Traceback" not in "\n".join(err)
    assert not run_dir.exists()  # the failed command leaves no run folder


def test_missing_extra_names_it(weights, tmp, monkeypatch, capsys, exported):
    from yolo5l.export import main

    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    code = _main(main, [f"weights={weights}", f"hydra.run.dir={tmp / 'noextra'}"], monkeypatch)
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        'error: format=onnx needs the export extra: pip install -e ".[export]"'
    )
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(UserError, match=re.escape(f"w.onnx (ONNX) needs the export extra: {EXTRA_HINT}")):
        ExportedModel(exported["onnx"])


# ---- val and predict -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp) -> Path:
    root = tmp / "synthetic"
    ensure_synthetic(root, num_train=8, num_val=8, seed=0)
    return root


def _val_overrides(weights: Path, root: Path) -> list[str]:
    return [
        f"weights={weights}", f"data.synthetic.root={root}", "data.synthetic.num_train=8", "data.synthetic.num_val=8",
        f"data.imgsz={IMGSZ}", "data.num_workers=0", "data.cache=none", "data.val_batch_size=4", "trainer=cpu",
        "trainer.precision=32",
    ]  # fmt: skip


def test_val_on_exported_files_gives_the_pt_metrics(weights, exported, dataset, tmp):
    from yolo5l.validation import validate_weights

    keys = ("val/map", "val/map_50", "val/precision", "val/recall")
    results = {}
    # TorchScript gives PyTorch's output to the bit (tested above): its val is the slow test's.
    for name, path in [("pt", weights), ("onnx", exported["onnx"]), ("static", exported["static"])]:
        cfg = compose_config(_val_overrides(path, dataset), config_name="val", output_dir=tmp / f"val_{name}")
        results[name] = validate_weights(cfg)
        assert json.loads((tmp / f"val_{name}" / "metrics.json").read_text()) == results[name]
    assert results["pt"]["val/recall"] > 0  # the untrained model's boxes do hit some labels
    for key in keys:
        assert results["onnx"][key] == pytest.approx(results["pt"][key], abs=0.002), key
    # The fixed-size file validates square letterboxed images (ultralytics' val.py does the same for exports).
    assert all(0 <= results["static"][key] <= 1 for key in keys)


def test_val_runs_a_fixed_input_file_at_its_own_size(exported, dataset, tmp, capsys):
    """data.imgsz=64 with a fixed 128x128 ONNX file: one warning line, and the metrics of data.imgsz=128 (not 64 px
    letterboxed and padded into 128), as predict runs such a file."""
    from yolo5l.validation import validate_weights

    def run(name: str, size: int) -> tuple[dict, list[str]]:
        overrides = [*_val_overrides(exported["static"], dataset), f"data.imgsz={size}", "plots=false"]
        cfg = compose_config(overrides, config_name="val", output_dir=tmp / f"val_fixed_{name}")
        capsys.readouterr()
        return validate_weights(cfg), capsys.readouterr().out.splitlines()

    want, own = run("own", IMGSZ)
    got, lines = run("other", 64)
    assert not any(ln.startswith("warning:") for ln in own), own
    assert [ln for ln in lines if ln.startswith("warning:")] == [
        f"warning: static.onnx takes {IMGSZ}x{IMGSZ} images (a fixed input): validating at {IMGSZ} px, not "
        "data.imgsz=64; export with dynamic=true for other sizes"
    ]
    assert got == want


def test_predict_with_an_exported_file(weights, exported, images, tmp):
    from yolo5l.predict import predict

    preds = {}
    for name, path in [("pt", weights), ("static", exported["static"])]:
        cfg = compose_config(
            [f"weights={path}", f"source={images[0].parent}", f"imgsz={IMGSZ}", "conf_thres=0.001", "max_det=30",
             "device=cpu", "save_images=false"],
            config_name="predict", output_dir=tmp / f"predict_{name}",
        )  # fmt: skip
        preds[name] = predict(cfg)
    assert preds["pt"], "no detections at conf 0.001"
    # The fixed-batch (2) file runs predict's batch of 3 images in two chunks.
    assert len(preds["static"]) == len(preds["pt"])
    for got, want in zip(preds["static"], preds["pt"], strict=True):
        assert (got["image"], got["class"], got["name"]) == (want["image"], want["class"], want["name"])
        assert got["score"] == pytest.approx(want["score"], abs=1e-4)
        assert got["box_xyxy"] == pytest.approx(want["box_xyxy"], abs=0.05)


def test_predict_runs_a_fixed_input_file_at_its_own_size_and_batch(exported, images, tmp, capsys):
    """imgsz= and batch_size= that a fixed [2, 3, 128, 128] ONNX file cannot take: one warning line, predict runs at
    128 px in batches of 2 and says so, with the boxes of imgsz=128 (not 64 px letterboxed and padded into 128)."""
    from yolo5l.predict import predict

    def run(name: str, *args: str) -> tuple[list[dict], list[str]]:
        cfg = compose_config([f"weights={exported['static']}", f"source={images[0].parent}", "conf_thres=0.001",
                              "max_det=30", "device=cpu", "save_images=false", *args],
                             config_name="predict", output_dir=tmp / f"predict_fixed_{name}")  # fmt: skip
        capsys.readouterr()
        preds = predict(cfg)
        return preds, capsys.readouterr().out.splitlines()

    want, own = run("own", f"imgsz={IMGSZ}")
    got, lines = run("other", "imgsz=64", "batch_size=8")
    assert not any(ln.startswith("warning:") for ln in own), own
    assert [ln for ln in lines if ln.startswith("warning:")] == [
        "warning: static.onnx takes 128x128 images, batch 2 (a fixed input): predicting at 128 px, 2 images at a "
        "time; export with dynamic=true for other sizes"
    ]
    assert any(ln.endswith(f"detections in 3 images or frames at {IMGSZ} px") for ln in lines), lines
    assert any(ln.startswith("Speed:") and ln.endswith(f"at shape (2, 3, {IMGSZ}, {IMGSZ})") for ln in lines), lines
    assert want
    assert got == want


def test_image_size_defaults_to_the_one_the_weights_record(tmp):
    import inspect

    if "imgsz" not in inspect.signature(save_weights).parameters:
        pytest.skip("weights files do not record the training image size in this version")
    model = YOLOv5.from_name("yolov5n", num_classes=2)
    weights = save_weights(model, tmp / "sized.pt", imgsz=64)
    cfg = compose_config([f"weights={weights}", "device=cpu"], config_name="export", output_dir=tmp / "run_sized")
    _, _, imgsz, _ = load_exported(export_weights(cfg))
    assert imgsz == 64


def test_a_size_off_the_stride_is_rounded_up_as_v7_exports_it(tmp, capsys):
    model = YOLOv5.from_name("yolov5n", num_classes=2)
    weights = save_weights(model, tmp / "off_stride.pt", imgsz=64)
    cfg = compose_config([f"weights={weights}", "device=cpu", "imgsz=[40,70]"], config_name="export",
                         output_dir=tmp / "run_off_stride")  # fmt: skip
    graph = onnx.load(str(export_weights(cfg))).graph
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim] == [1, 3, 64, 96]
    err = capsys.readouterr()
    lines = (err.out + err.err).splitlines()
    assert any("imgsz=40 is not a multiple of 32, the model's largest stride: using imgsz=64" in ln for ln in lines)
    assert any("imgsz=70 is not a multiple of 32, the model's largest stride: using imgsz=96" in ln for ln in lines)


@pytest.mark.slow
def test_trained_model_validates_the_same_after_export(tmp_path):
    """A short real training on the synthetic shapes, then `yolo5l.val` on its weights.pt, its dynamic ONNX and its
    TorchScript file: the same mAP (measured on a 10-epoch model: mAP@0.5 0.5208 all three, equal to 1e-6; the
    8 epochs here reach 0.082, detections enough for the comparison)."""
    import subprocess

    def run(entry: str, *args: str) -> None:
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
        r = subprocess.run([sys.executable, "-m", entry, *args], capture_output=True, text=True, env=env, timeout=3000)
        assert r.returncode == 0, r.stderr[-3000:]

    root = tmp_path / "synthetic"
    run("yolo5l.train", "experiment=synthetic_learn", "trainer.max_epochs=8", f"data.synthetic.root={root}",
        f"hydra.run.dir={tmp_path / 'run'}", "logger=none")  # fmt: skip
    weights = tmp_path / "run" / "checkpoints" / "weights.pt"
    files = {"pt": weights, "onnx": tmp_path / "w.onnx", "torchscript": tmp_path / "w.torchscript"}
    run("yolo5l.export", f"weights={weights}", "imgsz=160", "dynamic=true", f"output={files['onnx']}",
        f"hydra.run.dir={tmp_path / 'e1'}")  # fmt: skip
    run("yolo5l.export", f"weights={weights}", "imgsz=160", "format=torchscript", f"output={files['torchscript']}",
        f"hydra.run.dir={tmp_path / 'e2'}")  # fmt: skip
    metrics = {}
    for name, path in files.items():
        run("yolo5l.val", f"weights={path}", f"data.synthetic.root={root}", "data.imgsz=160", "trainer=cpu",
            "trainer.precision=32", "data.cache=none", f"hydra.run.dir={tmp_path / name}")  # fmt: skip
        metrics[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert metrics["pt"]["val/map_50"] > 0.05  # it detects the shapes
    for name in ("onnx", "torchscript"):
        for key in ("val/map", "val/map_50", "val/precision", "val/recall"):
            assert metrics[name][key] == pytest.approx(metrics["pt"][key], abs=0.002), (name, key)
