"""Deployment formats (`python -m yolo5l.export format=openvino|tflite|ncnn|coreml|engine`, `nms=true`): each one that
runs here is written from a small trained yolov5n, run, and scored by `python -m yolo5l.val` against the `.pt`:
fp32 within 0.002 mAP@0.5:0.95, fp16 within 0.005, int8 within 0.03. CoreML is checked for what it declares;
TensorRT's code path, its error without CUDA and its calibration batches everywhere, its build on a GPU."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _deploy_model import IMGSZ, WEIGHTS, data_overrides, train

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.deploy.exported import load_exported
from yolo5l.deploy.formats import find_format, output_path
from yolo5l.export import export_weights

pytestmark = pytest.mark.heavy  # every format end to end: make test-ci (CI) runs them

NAMES = ["rectangle", "ellipse", "triangle", "cross"]
TOLERANCE = {"fp32": 0.002, "fp16": 0.005, "int8": 0.03}  # mAP@0.5:0.95 from the .pt's


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deploy")


@pytest.fixture(scope="module")
def weights(tmp) -> Path:
    """The trained weights (tests/data/deploy_yolov5n.pt; trained anew only where the file is missing)."""
    return WEIGHTS if WEIGHTS.is_file() else train(tmp / "trained.pt")


@pytest.fixture(scope="module")
def dataset(tmp) -> Path:
    from _deploy_model import SYNTHETIC

    root = tmp / "synthetic"
    ensure_synthetic(root, **SYNTHETIC)
    return root


def _export(weights: Path, out: Path, *overrides: str) -> Path:
    cfg = compose_config([f"weights={weights}", f"output={out}", f"imgsz={IMGSZ}", "device=cpu", *overrides],
                         config_name="export", output_dir=out.parent / f"run_{out.name}")  # fmt: skip
    return export_weights(cfg)


def _val(path: Path, dataset: Path, out: Path) -> dict[str, float]:
    from yolo5l.validation import validate_weights

    overrides = [f"weights={path}", *data_overrides(dataset), "data.num_workers=0", "data.cache=none",
                 "data.val_batch_size=8", "trainer=cpu", "trainer.precision=32", "plots=false"]  # fmt: skip
    return validate_weights(compose_config(overrides, config_name="val", output_dir=out))


@pytest.fixture(scope="module")
def pt_map(weights, dataset, tmp) -> dict[str, float]:
    """The .pt's metrics; the static formats validate square images, so the .pt is scored on those too (ultralytics'
    val.py does the same for exported models) through its fixed-size ONNX twin."""
    metrics = _val(weights, dataset, tmp / "val_pt")
    assert metrics["val/map_50"] > 0.5, metrics  # it detects most shapes: the tolerances compare real detections
    square = _export(weights, tmp / "square.onnx")  # fp32, fixed 128x128 like the static formats
    return {"rect": metrics, "square": _val(square, dataset, tmp / "val_square")}


def _check_map(got: dict[str, float], pt_map: dict, precision: str, square: bool) -> None:
    want = pt_map["square" if square else "rect"]
    for key in ("val/map", "val/map_50"):
        assert got[key] == pytest.approx(want[key], abs=TOLERANCE[precision]), (key, got[key], want[key])


# ---- OpenVINO -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_openvino_scores_the_pt_map(weights, dataset, tmp, pt_map, precision):
    pytest.importorskip("openvino")
    args = {"fp32": [], "fp16": ["half=true"], "int8": ["int8=true", f"calib_data={dataset / 'images' / 'train'}"]}
    folder = _export(weights, tmp / f"w_{precision}_openvino_model", "format=openvino", "dynamic=true",
                     *args[precision])  # fmt: skip
    assert find_format(folder) == "openvino"
    xml, meta = folder / f"w_{precision}.xml", yaml.safe_load((folder / f"w_{precision}.yaml").read_text())
    assert xml.is_file()
    assert xml.with_suffix(".bin").is_file()
    assert (meta["names"], meta["stride"], meta["imgsz"], meta["task"]) == (dict(enumerate(NAMES)), 32, IMGSZ, "detect")
    model, names, imgsz, stride = load_exported(folder)
    assert (names, imgsz, stride, model.batch, model.size) == (NAMES, IMGSZ, 32, None, None)
    _check_map(_val(folder, dataset, tmp / f"val_ov_{precision}"), pt_map, precision, square=False)


# ---- TFLite ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tflite_fp32(weights, tmp) -> Path:
    pytest.importorskip("litert_torch")
    return _export(weights, tmp / "w.tflite", "format=tflite")


def test_tflite_layout_and_metadata(tflite_fp32):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(tflite_fp32))
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()
    assert list(inp["shape"]) == [1, IMGSZ, IMGSZ, 3]  # NHWC, as ultralytics' TFLite
    assert inp["dtype"] == np.float32
    assert list(out["shape"]) == [1, 3 * (16**2 + 8**2 + 4**2), 5 + len(NAMES)]
    with zipfile.ZipFile(tflite_fp32) as zf:  # where ultralytics v7.0's DetectMultiBackend reads it
        meta = eval(zf.read(zf.namelist()[0]).decode())  # a Python literal, as v7.0 reads it (ast.literal_eval)
    assert (meta["names"], meta["stride"], meta["imgsz"]) == (dict(enumerate(NAMES)), 32, IMGSZ)
    model, names, *_ = load_exported(tflite_fp32)
    assert (names, model.batch, model.size) == (NAMES, 1, (IMGSZ, IMGSZ))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_tflite_scores_the_pt_map(weights, dataset, tmp, pt_map, tflite_fp32, precision):
    from yolo5l.deploy._io import append_metadata, read_appended_metadata
    from yolo5l.deploy.tflite import quantize_tflite

    if precision == "fp32":
        path = tflite_fp32
    elif precision == "int8":  # the command line's int8 path, calibrated on the train images
        path = _export(weights, tmp / "w-int8.tflite", "format=tflite", "int8=true", f"calib_data={dataset}/data.yaml")
        assert path.stat().st_size < tflite_fp32.stat().st_size / 2  # int8 weights
    else:  # fp16 from the fp32 file (what half=true runs after the conversion)
        raw = tflite_fp32.read_bytes()
        raw = raw[: raw.rfind(b"PK\x03\x04")]  # the flatbuffer without the appended metadata
        path = tmp / "w-fp16.tflite"
        path.write_bytes(append_metadata(quantize_tflite(raw, half=True), read_appended_metadata(tflite_fp32)))
        assert path.stat().st_size < tflite_fp32.stat().st_size * 0.6  # fp16 weights
    _check_map(_val(path, dataset, tmp / f"val_tflite_{precision}"), pt_map, precision, square=True)


# ---- ncnn -----------------------------------------------------------------------------------------------------------
def test_ncnn_scores_the_pt_map(weights, dataset, tmp, pt_map):
    pytest.importorskip("ncnn")
    pytest.importorskip("pnnx")
    folder = _export(weights, tmp / "w_ncnn_model", "format=ncnn")
    assert sorted(p.name for p in folder.iterdir()) == ["metadata.yaml", "model.ncnn.bin", "model.ncnn.param"]
    meta = yaml.safe_load((folder / "metadata.yaml").read_text())
    assert (meta["names"], meta["stride"], meta["imgsz"]) == (dict(enumerate(NAMES)), 32, IMGSZ)
    _check_map(_val(folder, dataset, tmp / "val_ncnn"), pt_map, "fp32", square=True)


# ---- end-to-end ONNX ------------------------------------------------------------------------------------------------
def test_onnx_nms_graph_and_map(weights, dataset, tmp, pt_map):
    import onnx
    import onnxruntime as ort

    path = _export(weights, tmp / "e2e.onnx", "nms=true", "dynamic=true", "conf_thres=0.001", "iou_thres=0.6")
    proto = onnx.load(str(path))
    assert "NonMaxSuppression" in {n.op_type for n in proto.graph.node}
    assert [o.name for o in proto.graph.output] == ["boxes", "scores", "classes", "count"]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert (json.loads(meta["names"]), meta["nms"], meta["stride"]) == (NAMES, "true", "32")
    session = ort.InferenceSession(str(path))
    x = np.random.default_rng(0).random((2, 3, IMGSZ, IMGSZ), dtype=np.float32)
    boxes, scores, classes, count = session.run(None, {"images": x})
    assert boxes.shape == (2, 300, 4)
    assert scores.shape == classes.shape == (2, 300)
    assert count.shape == (2,)
    for b in range(2):  # sorted, and zero past the count
        n = int(count[b])
        assert np.all(np.diff(scores[b, :n]) <= 0)
        assert not scores[b, n:].any()
        assert not boxes[b, n:].any()
    model, *_ = load_exported(path)
    assert model.end_to_end
    # val's NMS (conf 0.001, IoU 0.6) equals the file's: the same mAP as the .pt.
    _check_map(_val(path, dataset, tmp / "val_e2e"), pt_map, "fp32", square=False)


def test_predict_takes_the_new_formats(weights, dataset, tmp):
    pytest.importorskip("openvino")
    from yolo5l.predict import predict

    folder = _export(weights, tmp / "p_openvino_model", "format=openvino")
    source = dataset / "images" / "val"
    preds = {}
    for name, path in [("pt", weights), ("openvino", folder)]:
        cfg = compose_config(
            [f"weights={path}", f"source={source}", f"imgsz={IMGSZ}", "conf_thres=0.25", "device=cpu",
             "save_images=false"], config_name="predict", output_dir=tmp / f"predict_{name}",
        )  # fmt: skip
        preds[name] = predict(cfg)
    assert preds["pt"], "no detections"
    assert len(preds["openvino"]) == len(preds["pt"])
    for got, want in zip(preds["openvino"], preds["pt"], strict=True):
        assert (got["image"], got["class"]) == (want["image"], want["class"])
        assert got["box_xyxy"] == pytest.approx(want["box_xyxy"], abs=0.05)


# ---- CoreML ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nms", [False, True])
def test_coreml_declares_inputs_outputs_and_metadata(weights, tmp, nms):
    pytest.importorskip("coremltools")
    from yolo5l.deploy.coreml import describe_coreml

    path = _export(weights, tmp / f"w{int(nms)}.mlpackage", "format=coreml", f"nms={str(nms).lower()}")
    assert find_format(path) == "coreml"
    assert (path / "Manifest.json").is_file()
    desc = describe_coreml(path)
    assert desc["inputs"]["image"] == "imageType"
    image = desc["spec"].description.input[0].type.imageType
    assert (image.width, image.height) == (IMGSZ, IMGSZ)
    assert (desc["metadata"]["names"], desc["metadata"]["imgsz"], desc["metadata"]["stride"]) == (NAMES, IMGSZ, 32)
    assert desc["pipeline"] is nms
    if nms:  # Vision's detection outputs, and the thresholds as optional inputs
        assert set(desc["outputs"]) == {"confidence", "coordinates"}
        assert {"iouThreshold", "confidenceThreshold"} <= set(desc["inputs"])
    else:
        assert list(desc["outputs"]) == ["output0"]
    with pytest.raises(UserError, match=r"do not run Core ML models \(on any system\): load it in a Core ML app"):
        load_exported(path)


# ---- TensorRT -------------------------------------------------------------------------------------------------------
def test_tensorrt_calibration_batches():
    from yolo5l.deploy.tensorrt import CalibrationBatches

    images = [np.full((1, 3, 8, 8), i, dtype=np.float32) for i in range(5)]
    batches = list(CalibrationBatches(images, batch=2))
    assert len(batches) == len(CalibrationBatches(images, 2)) == 3
    for b in batches:
        assert b.shape == (2, 3, 8, 8)
        assert b.dtype == np.float32
        assert b.flags.c_contiguous
    assert [b[:, 0, 0, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4, 0]]  # the last filled from the start


def test_calibration_images_from_data(dataset):
    from yolo5l.deploy.calibration import calibration_files, calibration_images

    files = calibration_files(dataset / "data.yaml", count=10)
    assert len(files) == 10
    assert all("train" in str(f) for f in files)
    arrays = calibration_images(files[:2], IMGSZ)
    for a in arrays:
        assert a.shape == (1, 3, IMGSZ, IMGSZ)
        assert a.dtype == np.float32
        assert 0 <= a.min() <= a.max() <= 1
    with pytest.raises(UserError, match="int8=true needs calibration images"):
        calibration_files(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_engine_without_cuda_is_one_line(weights, tmp):
    from yolo5l.deploy.tensorrt import check_cuda

    with pytest.raises(UserError, match=r"format=engine needs a CUDA GPU"):
        check_cuda(torch.device("cpu"))
    with pytest.raises(UserError, match=r"format=engine needs a CUDA GPU"):
        _export(weights, tmp / "w.engine", "format=engine")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_engine_builds_and_scores_on_a_gpu(weights, dataset, tmp, pt_map, precision):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("tensorrt")
    extra = ["half=true"] if precision == "fp16" else ["int8=true", f"calib_data={dataset}/data.yaml"]
    path = _export(weights, tmp / f"w_{precision}.engine", "format=engine", "device=cuda", *extra)
    assert yaml.safe_load(path.with_suffix(".yaml").read_text())["names"] == dict(enumerate(NAMES))
    _check_map(_val(path, dataset, tmp / f"val_engine_{precision}"), pt_map, precision, square=True)


# ---- TorchScript optimize=true, names, options --------------------------------------------------------------------
def test_torchscript_optimize(weights, tmp):
    from yolo5l.exporter import xnnpack_enabled

    if not xnnpack_enabled():
        with pytest.raises(UserError, match=r"optimize=true needs a PyTorch built with XNNPACK"):
            _export(weights, tmp / "m.torchscript", "format=torchscript", "optimize=true")
        return
    path = _export(weights, tmp / "m.torchscript", "format=torchscript", "optimize=true")
    extra = {"config.txt": ""}
    torch.jit.load(str(path), _extra_files=extra)
    assert json.loads(extra["config.txt"])["optimize"] is True


def test_default_names_are_ultralytics(tmp):
    assert output_path(tmp, "best", "openvino").name == "best_openvino_model"
    assert output_path(tmp, "best", "openvino", int8=True).name == "best_int8_openvino_model"
    assert output_path(tmp, "best", "tflite", half=True).name == "best-fp16.tflite"
    assert output_path(tmp, "best", "tflite", int8=True).name == "best-int8.tflite"
    assert output_path(tmp, "best", "ncnn").name == "best_ncnn_model"
    assert output_path(tmp, "best", "coreml").name == "best.mlpackage"
    assert output_path(tmp, "best", "engine").name == "best.engine"
    for name, fmt in [("a.tflite", "tflite"), ("b_openvino_model", "openvino"), ("c_ncnn_model", "ncnn"),
                      ("d.engine", "engine"), ("e.mlpackage", "coreml"), ("w.pt", None), ("x.ckpt", None)]:  # fmt: skip
        assert find_format(tmp / name) == fmt, name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["format=onnx", "int8=true"], "int8=true applies to format=openvino|tflite|engine|coreml, not format=onnx"),
        (["format=tflite", "nms=true"], "nms=true applies to format=onnx or coreml, not format=tflite"),
        (["format=onnx", "optimize=true"], "optimize=true applies to format=torchscript"),
        (["format=ncnn", "dynamic=true"], "dynamic=true: format=ncnn files take one input size"),
        (["format=openvino", "int8=true"], "int8=true needs calibration images: pass calib_data="),
        (["format=openvino", "int8=true", "calib_data=nowhere"], "calib_data=nowhere: no such file or folder"),
        (["nms=true", "iou_thres=2"], "iou_thres=2 must be a number in [0, 1]"),
    ],
)
def test_option_mistakes_are_one_line(weights, tmp, args, message):
    with pytest.raises(UserError) as e:
        _export(weights, tmp / "mistake.out", *args)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    ("fmt", "module", "extra"),
    [
        ("openvino", "openvino", "openvino"),
        ("tflite", "litert_torch", "tflite"),
        ("ncnn", "pnnx", "ncnn"),
        ("coreml", "coremltools", "coreml"),
    ],
)
def test_missing_extra_names_it(weights, tmp, monkeypatch, fmt, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` raises ImportError
    with pytest.raises(UserError) as e:
        _export(weights, tmp / "noextra.out", f"format={fmt}")
    assert str(e.value) == f'format={fmt} needs the {extra} extra: pip install -e ".[{extra}]"'


def test_benchmark_command_scores_and_times_each_format(weights, dataset, tmp):
    """`python -m yolo5l.benchmark`: a row per format (file size, mAP, ms per image) in benchmark.csv; the dynamic ONNX
    file scores what the .pt scores on the same (rectangular) batches."""
    import csv
    import subprocess

    run = tmp / "benchmark"
    args = [f"weights={weights}", *data_overrides(dataset), "data.num_workers=0", "data.cache=none",
            "formats=[pytorch,onnx]", "timing_runs=2", f"hydra.run.dir={run}"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "yolo5l.benchmark", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(run / "benchmark.csv", newline="") as f:
        rows = {r["format"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["pytorch", "onnx"], rows
    assert all(r["status"] == "ok" for r in rows.values()), rows
    pt, onnx = rows["pytorch"], rows["onnx"]
    assert float(pt["map_50"]) > 0.5, pt
    assert float(onnx["ms_per_image"]) > 0, onnx
    assert float(onnx["size_mb"]) > 1, onnx
    for key in ("map", "map_50"):
        assert float(onnx[key]) == pytest.approx(float(pt[key]), abs=TOLERANCE["fp32"]), key
