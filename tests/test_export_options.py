"""ultralytics/yolov5 v7.0 `export.py` flags in `python -m yolo5l.export`: several formats in one call
(`format=[onnx,torchscript]`, v7.0's `--include`), the formats yolo5l does not write (refused in one line), a
rectangular `imgsz=[h,w]`, and the in-graph NMS's `agnostic_nms` and `topk_per_class`."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch import nn
from torchvision.ops import box_iou

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import onnx
import onnxruntime as ort
from _deploy_model import untrained_weights

from yolo5l import _cli
from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.deploy.exported import load_exported
from yolo5l.deploy.formats import NOT_WRITTEN, output_path, parse_formats
from yolo5l.deploy.onnx_nms import EndToEnd
from yolo5l.export import export_formats
from yolo5l.exporter import DecodedYOLOv5, export_model, prepare_for_export
from yolo5l.models.weights import load_weights
from yolo5l.models.yolo import YOLOv5

NAMES = ["rectangle", "ellipse", "triangle", "cross"]
TOL = {"rtol": 1e-4, "atol": 1e-3}  # fp32 through another runtime (as tests/test_export.py)
UNWRITTEN = ["saved_model", "pb", "tfjs", "edgetpu", "paddle"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_options")


@pytest.fixture(scope="module")
def weights(tmp) -> Path:
    """An untrained yolov5n for four classes, with BatchNorm statistics that make fusing change weights."""
    return untrained_weights(tmp / "w.pt", NAMES)


def _main(argv: list[str], monkeypatch) -> int:
    """`python -m yolo5l.export <argv>` in this process (as tests/test_export.py runs it); its exit code."""
    from yolo5l.export import main

    monkeypatch.setattr(sys, "argv", ["yolo5l", *argv])
    monkeypatch.setattr(_cli, "_gc_paused", False)
    monkeypatch.setattr(_cli, "_start_up_frozen", False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        main()
        return 0
    except SystemExit as e:
        return int(e.code)
    finally:
        gc.unfreeze()
        gc.enable()
        for handler in root.handlers[:]:  # the run folder's job log, which Hydra added
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)


def _refused(weights: Path, tmp: Path, monkeypatch, capsys, *args: str) -> str:
    """The one error line of a command that must fail before it writes anything (exit code 2)."""
    run_dir = tmp / "refused"
    before = sorted(p.name for p in weights.parent.iterdir())
    code = _main([f"weights={weights}", "device=cpu", *args, f"hydra.run.dir={run_dir}"], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("error: "), err
    assert not run_dir.exists()
    assert sorted(p.name for p in weights.parent.iterdir()) == before  # nothing written beside the weights
    return err[0].removeprefix("error: ")


# ---- formats yolo5l does not write ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", UNWRITTEN)
def test_unwritten_format_is_refused_with_its_reason_and_the_alternative(weights, tmp, monkeypatch, capsys, fmt):
    line = _refused(weights, tmp, monkeypatch, capsys, f"format={fmt}")
    assert line == f"format={fmt}: {NOT_WRITTEN[fmt]}"
    assert " is not written (" in line
    assert "): use format=" in line  # the alternative
    with pytest.raises(UserError, match=rf"^format={fmt}: "):  # the Python API says the same
        export_model(YOLOv5.from_name("yolov5n", num_classes=2), tmp / "never", fmt)
    assert not (tmp / "never").exists()


def test_unwritten_format_on_the_command_line(weights, tmp):
    run_dir = tmp / "cli_refused"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.export", f"weights={weights}", "format=saved_model", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: format=saved_model: TF SavedModel is not written (it needs TensorFlow): use format=onnx (onnx2tf "
        "converts it) or format=tflite"
    ]
    assert "Traceback" not in r.stdout + r.stderr
    assert not run_dir.exists()


# ---- several formats in one call ------------------------------------------------------------------------------------
def test_parse_formats_takes_a_name_a_list_or_commas():
    assert parse_formats("onnx") == ["onnx"]
    assert parse_formats(["onnx", "openvino"]) == ["onnx", "openvino"]
    assert parse_formats("onnx, OpenVINO,") == ["onnx", "openvino"]  # v7.0 lower-cases --include too
    assert parse_formats(["torchscript", "onnx", "torchscript"]) == ["torchscript", "onnx"]  # each once, in order
    with pytest.raises(UserError, match=r"names no format: pass format=onnx, or several as format=\[onnx,openvino\]"):
        parse_formats([])
    with pytest.raises(UserError, match=r"^format='onxx' is not one of: onnx, torchscript, openvino"):
        parse_formats(["onnx", "onxx"])
    with pytest.raises(UserError, match=r"^format=pb: TF GraphDef is not written"):
        parse_formats("onnx,pb")


@pytest.fixture(scope="module")
def listed(tmp, weights) -> tuple[int, str, Path]:
    """`python -m yolo5l.export weights=w.pt format=[onnx,torchscript] imgsz=[64,96]` in this process, on a copy of the
    weights in a folder of its own: (exit code, stdout, that folder)."""
    folder = tmp / "listed"
    folder.mkdir()
    shutil.copy(weights, folder / "w.pt")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        argv = [f"weights={folder / 'w.pt'}", "format=[onnx,torchscript]", "imgsz=[64,96]", "device=cpu",
                f"hydra.run.dir={tmp / 'listed_run'}"]  # fmt: skip
        code = _main(argv, mp)
    return code, stdout.getvalue(), folder


def test_a_list_writes_each_format_named_as_its_own_export(listed):
    code, out, folder = listed
    assert code == 0, out
    assert sorted(p.name for p in folder.iterdir()) == ["w.onnx", "w.pt", "w.torchscript"]
    for fmt in ("onnx", "torchscript"):
        assert folder / f"w.{fmt}" == output_path(folder, "w", fmt)
    # One line per format, in the order asked, then both in the outputs block.
    lines = [ln for ln in out.splitlines() if "max abs difference" in ln]
    assert [ln.split(" vs ")[0] for ln in lines] == ["[yolo5l] onnxruntime", "[yolo5l] torch.jit"]
    for line in lines:
        assert "on the example input (1, 3, 64, 96) fp32" in line
        assert float(line.rsplit(" ", 1)[1]) < 1e-3
    block = out[out.index("Outputs:") :].splitlines()
    assert [row.split()[0] for row in block[1:3]] == ["onnx:", "torchscript:"]


def test_rectangular_files_take_height_by_width(listed, weights):
    _, _, folder = listed
    net = DecodedYOLOv5(prepare_for_export(load_weights(weights)[0]))
    proto = onnx.load(str(folder / "w.onnx"))
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 64, 96]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["imgsz"]) == [64, 96]
    extra = {"config.txt": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        torch.jit.load(str(folder / "w.torchscript"), _extra_files=extra)
    assert json.loads(extra["config.txt"])["shape"] == [1, 3, 64, 96]
    x = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = net(x)
    assert want.shape == (2, 3 * (8 * 12 + 4 * 6 + 2 * 3), 5 + len(NAMES))
    for fmt in ("onnx", "torchscript"):
        model, names, imgsz, _ = load_exported(folder / f"w.{fmt}")
        # val and predict letterbox squares: the one that fits the file is its shorter side.
        assert (names, imgsz) == (NAMES, 64)
        torch.testing.assert_close(model(x), want, **TOL)
    static, *_ = load_exported(folder / "w.onnx")
    assert static.size == (64, 96)
    square = x[:, :, :, :64]  # a 64x64 letterboxed image is padded on the right to the file's width
    padded = torch.nn.functional.pad(square, (0, 32), value=114 / 255)
    with torch.no_grad():
        torch.testing.assert_close(static(square), net(padded), **TOL)
    with pytest.raises(UserError, match=r"takes 64x96 images .* got 96x96: use an image size of at most 64"):
        static(torch.rand(1, 3, 96, 96))


def test_openvino_takes_a_rectangle(weights, tmp):
    pytest.importorskip("openvino")
    cfg = compose_config([f"weights={weights}", "format=openvino", "imgsz=[64,96]", f"output={tmp / 'rect_openvino'}",
                          "device=cpu"], config_name="export", output_dir=tmp / "rect_openvino_run")  # fmt: skip
    model, _, imgsz, _ = load_exported(export_formats(cfg)["openvino"])
    assert (model.size, imgsz) == ((64, 96), 64)
    x = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = DecodedYOLOv5(prepare_for_export(load_weights(weights)[0]))(x)
    torch.testing.assert_close(model(x), want, **TOL)


def test_int8_calibration_images_take_the_rectangle(tmp):
    from yolo5l.deploy.calibration import calibration_images

    path = tmp / "calib.jpg"
    cv2.imwrite(str(path), np.full((50, 200, 3), 200, np.uint8))
    (image,) = calibration_images([path], (64, 96))
    assert image.shape == (1, 3, 64, 96)
    assert image.dtype == np.float32
    # 200x50 shrunk to 96x24, letterboxed: grey above and below, the image's 200/255 in the middle rows.
    np.testing.assert_allclose(image[0, :, 32, :], 200 / 255, atol=1e-6)
    np.testing.assert_allclose(image[0, :, 0, :], 114 / 255, atol=1e-6)


def test_output_with_several_formats_is_their_folder(weights, tmp):
    out = tmp / "several"
    cfg = compose_config([f"weights={weights}", "format='torchscript,onnx'", f"output={out}", "imgsz=64",
                          "device=cpu"], config_name="export", output_dir=tmp / "several_run")  # fmt: skip
    written = export_formats(cfg)
    assert written == {"torchscript": out / "w.torchscript", "onnx": out / "w.onnx"}
    assert sorted(p.name for p in out.iterdir()) == ["w.onnx", "w.torchscript"]
    assert load_exported(out / "w.onnx")[2] == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["format=[onnx,paddle]"], "format=paddle: PaddlePaddle is not written (it needs paddlepaddle and x2paddle)"),
        (["format=[onnx,onxx]"], "format='onxx' is not one of: onnx, torchscript, openvino, tflite, ncnn, coreml"),
        (["format=[onnx,torchscript]", "nms=true"],
         "nms=true applies to format=onnx or coreml, not format=torchscript: drop nms=true (or export "
         "format=torchscript in a call of its own)"),
        (["format=[onnx,torchscript]", "output=OUT/x.onnx"],
         "output=OUT/x.onnx names a file, but format= lists 2 formats: pass a folder for them all"),
        (["format=onnx,torchscript"],
         "format=onnx,torchscript: values separated by commas are a sweep, one run each (add -m); for a list write "
         "format=[onnx,torchscript]"),
    ],
)  # fmt: skip
def test_a_list_with_a_bad_format_writes_nothing(weights, tmp, monkeypatch, capsys, args, message):
    args = [a.replace("OUT", str(tmp)) for a in args]
    assert _refused(weights, tmp, monkeypatch, capsys, *args).startswith(message.replace("OUT", str(tmp)))
    assert not (tmp / "x.onnx").exists()


def test_a_list_checks_every_format_can_be_written_before_the_first(weights, tmp, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    line = _refused(weights, tmp, monkeypatch, capsys, "format=[onnx,openvino]")
    assert line == 'format=openvino needs the openvino extra: pip install -e ".[openvino]"'


# ---- rectangular sizes and NMS options: what is refused -------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["format=tflite", "imgsz=[64,96]"],
         "imgsz=[64,96]: format=tflite files are written square; pass one size (imgsz=96), or use "
         "format=onnx|torchscript|openvino|engine for a rectangular input"),
        (["imgsz=[64,-32]"], "imgsz=-32 must be a positive image size in pixels"),
        (["imgsz=[64,96,128]"], "imgsz=[64,96,128] must be one size (imgsz=640) or [height,width] (imgsz=[480,640])"),
        (["agnostic_nms=true"], "agnostic_nms sets the NMS inside the file: add nms=true (format=onnx), or drop"),
        (["nms=true", "topk_per_class=0"], "topk_per_class=0 must be an integer of at least 1, or null (max_det)"),
        (["format=coreml", "nms=true", "topk_per_class=5"],
         "topk_per_class applies to format=onnx nms=true, not format=coreml: drop topk_per_class"),
        (["nms=true", "agnostic_nms=true", "topk_per_class=5"],
         "topk_per_class caps each class, and agnostic_nms=true makes one class of all: drop one"),
    ],
)  # fmt: skip
def test_option_mistakes_are_one_line(weights, tmp, monkeypatch, capsys, args, message):
    assert _refused(weights, tmp, monkeypatch, capsys, *args).startswith(message)


def test_square_formats_refuse_a_rectangle_in_the_api(tmp):
    model = YOLOv5.from_name("yolov5n", num_classes=2)
    with pytest.raises(UserError, match=r"format=ncnn files are written square"):
        export_model(model, tmp / "never_ncnn_model", "ncnn", imgsz=(64, 96))


# ---- the in-graph NMS: agnostic and a per-class cap -----------------------------------------------------------------
class _Fixed(nn.Module):
    """A 'detector' whose decoded output is fixed: (1, N, 5 + nc) rows, whatever the image."""

    def __init__(self, rows: list[list[float]]) -> None:
        super().__init__()
        self.register_buffer("rows", torch.tensor([rows], dtype=torch.float32))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.rows + images.mean() * 0  # tied to the input, so that the graph takes one


# cx, cy, w, h, objectness, 2 class scores. Boxes 0 and 1 overlap (IoU 0.82) with different best classes; 2 and 3 are
# apart from everything, class 0; box 4 is class 0 below the best of 0, 2, 3.
ROWS = [
    [20, 20, 20, 20, 1.0, 0.9, 0.1],
    [21, 21, 20, 20, 1.0, 0.2, 0.8],
    [60, 60, 10, 10, 1.0, 0.7, 0.0],
    [100, 20, 10, 10, 1.0, 0.6, 0.0],
    [100, 60, 10, 10, 1.0, 0.5, 0.0],
]


def _run_both(net: EndToEnd, tmp: Path, name: str) -> list[tuple[int, float, list[float]]]:
    """The detections of `net` eagerly and as ONNX (onnxruntime), which must agree: (class, score, box) by score."""
    from yolo5l.exporter import _export_onnx

    example = torch.rand(1, 3, 32, 32)
    path = tmp / f"{name}.onnx"
    path.write_bytes(_export_onnx(net, example, 17, False, False, {"nms": True}))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = [torch.from_numpy(y) for y in session.run(None, {"images": example.numpy()})]
    with torch.no_grad():
        want = net(example)
    results = []
    for boxes, scores, classes, count in (got, want):
        n = int(count[0])
        rows = [(int(classes[0, k]), round(float(scores[0, k]), 4), boxes[0, k].tolist()) for k in range(n)]
        results.append(sorted(rows, key=lambda r: -r[1]))
    assert results[0] == results[1]
    return results[0]


def test_class_aware_nms_keeps_overlapping_boxes_of_other_classes(tmp):
    kept = _run_both(EndToEnd(_Fixed(ROWS), conf_thres=0.3, iou_thres=0.45, max_det=10), tmp, "aware")
    # Box 0 for class 0 (0.9), box 1 for class 1 (0.8): they overlap, but their classes differ. Box 1's class-0
    # score (0.2) is below conf_thres.
    assert [(c, s) for c, s, _ in kept] == [(0, 0.9), (1, 0.8), (0, 0.7), (0, 0.6), (0, 0.5)]


def test_agnostic_nms_suppresses_across_classes(tmp):
    kept = _run_both(EndToEnd(_Fixed(ROWS), 0.3, 0.45, 10, agnostic=True), tmp, "agnostic")
    # Box 1 (best class 1) overlaps box 0, which scores higher: gone, whatever its class.
    assert [(c, s) for c, s, _ in kept] == [(0, 0.9), (0, 0.7), (0, 0.6), (0, 0.5)]
    assert kept[0][2] == [10.0, 10.0, 30.0, 30.0]
    rows = [[*r[:5], r[6], r[5]] for r in ROWS]  # classes swapped: each box keeps its best class
    kept = _run_both(EndToEnd(_Fixed(rows), 0.3, 0.45, 10, agnostic=True), tmp, "agnostic_swapped")
    assert [c for c, _, _ in kept] == [1, 1, 1, 1]


def test_topk_per_class_caps_each_class_before_max_det(tmp):
    kept = _run_both(EndToEnd(_Fixed(ROWS), 0.3, 0.45, 10, topk_per_class=2), tmp, "topk")
    assert [(c, s) for c, s, _ in kept] == [(0, 0.9), (1, 0.8), (0, 0.7)]  # class 0's best two, class 1's one


def test_exported_end_to_end_model_with_agnostic_nms(weights, tmp):
    """The real detector: an agnostic file keeps no two boxes that overlap above iou_thres, of any classes."""
    model = load_weights(weights)[0]
    with torch.no_grad():  # objectness and class scores spread far apart (an untrained head scores all boxes alike)
        for conv in model.detect.m:
            conv.bias.copy_(torch.empty_like(conv.bias).uniform_(-4, 2, generator=torch.Generator().manual_seed(0)))
    image = np.random.default_rng(0).random((1, 3, 64, 64), dtype=np.float32)
    overlap = {}
    for agnostic in (False, True):
        path, diff = export_model(copy.deepcopy(model), tmp / f"agnostic{int(agnostic)}.onnx", "onnx", names=NAMES,
                                  imgsz=64, nms=True, agnostic_nms=agnostic, conf_thres=0.05, iou_thres=0.3,
                                  max_det=300)  # fmt: skip
        assert diff < 1e-3
        meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
        assert (meta["nms"], meta["agnostic_nms"], meta["topk_per_class"]) == ("true", json.dumps(agnostic), "300")
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        boxes, _, classes, count = session.run(None, {"images": image})
        n = int(count[0])
        assert len(set(classes[0, :n].tolist())) > 1  # detections of several classes
        iou = box_iou(torch.from_numpy(boxes[0, :n]), torch.from_numpy(boxes[0, :n])).fill_diagonal_(0)
        overlap[agnostic] = float(iou.max())
    assert overlap[False] > 0.3  # per class, boxes of other classes may overlap
    assert overlap[True] <= 0.3 + 1e-4  # agnostic: none do


def test_coreml_nms_pipeline_can_be_class_agnostic(weights, tmp):
    ct = pytest.importorskip("coremltools")
    path, _ = export_model(load_weights(weights)[0], tmp / "agnostic.mlpackage", "coreml", names=NAMES, imgsz=64,
                           nms=True, agnostic_nms=True)  # fmt: skip
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    nms = spec.pipeline.models[-1].nonMaximumSuppression
    assert nms.pickTop.perClass is False


# ---- the flag table --------------------------------------------------------------------------------------------------
# ultralytics/yolov5 v7.0 export.py::parse_opt: every argument, aliases included
V7_EXPORT_FLAGS = (
    "data", "weights", "imgsz", "img", "img-size", "batch-size", "device", "half", "inplace", "keras", "optimize",
    "int8", "dynamic", "simplify", "opset", "verbose", "workspace", "nms", "agnostic-nms", "topk-per-class",
    "topk-all", "iou-thres", "conf-thres", "include",
)  # fmt: skip


def test_the_flag_table_has_every_v7_export_flag():
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    section = next(s for s in text.split("\n## ")[1:] if s.startswith("ultralytics/yolov5 v7.0 `export.py`"))
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    found = [f.lstrip("-") for row in rows for f in row.split("|")[1].replace("`", " ").split() if f.startswith("--")]
    assert sorted(set(found)) == sorted(V7_EXPORT_FLAGS)
    assert all(row.split("|")[2].strip() for row in rows)  # each has a yolo5l form, or says why none
    # Each format of v7.0's --include has its row.
    words = {w for row in rows if "--include" in row for w in row.split("|")[1].replace("`", " ").split()}
    assert {"torchscript", "onnx", "openvino", "engine", "coreml", "tflite", *UNWRITTEN} <= words


@pytest.mark.parametrize("flag", V7_EXPORT_FLAGS)
def test_each_v7_export_flag_typed_as_is_gets_one_line(flag):
    from yolo5l.overrides import check_overrides
    from yolo5l.v7_options import V7_OPTIONS, V7_WITHOUT

    with pytest.raises(UserError) as e:
        check_overrides(["weights=w.pt", f"--{flag}"], "export")
    message = str(e.value)
    assert "\n" not in message
    instead, without = V7_OPTIONS["export"].get(f"--{flag}"), V7_WITHOUT["export"].get(f"--{flag}")
    assert (instead or without) is not None, flag
    assert (f"write {instead}" if instead else f"no counterpart here: {without}") in message
