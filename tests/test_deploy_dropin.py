"""Drop-in for ultralytics' loaders: the ONNX, TorchScript, OpenVINO and TFLite files yolo5l writes are loaded by
ultralytics/yolov5 v7.0's own `models/common.py::DetectMultiBackend` (PyPI `yolov5==7.0.14`, in `.refvenv/` at the
repository root or the python named by YOLO5L_REFERENCE_PYTHON; skipped without it), which reads the stride and the
class names from each file's metadata and gives yolo5l's outputs; v7.0's `val.py::run` scores each file as
`python -m yolo5l.val` does.

The reference environment needs onnxruntime, an openvino that still has `openvino.runtime` (v7.0 imports
`from openvino.runtime import Core`) and a TFLite interpreter (v7.0 imports `tflite_runtime.interpreter`, whose
successor ai-edge-litert the reference script maps to that name); scripts/bench_reference.py lists the install lines.
A format whose runtime is missing there is skipped with the import error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _deploy_model import IMGSZ, SYNTHETIC, WEIGHTS, data_overrides

from yolo5l.config import compose_config
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.deploy.exported import load_exported
from yolo5l.export import export_weights

pytestmark = pytest.mark.reference  # make refvenv; CI runs them with make test-ci
REPO = Path(__file__).resolve().parents[1]
NAMES = ["rectangle", "ellipse", "triangle", "cross"]
# format -> (the export's overrides, the runtime module the format needs here)
FORMATS = {
    "onnx": (["format=onnx"], "onnxruntime"),
    "torchscript": (["format=torchscript"], None),
    "openvino": (["format=openvino"], "openvino"),
    "tflite": (["format=tflite"], "litert_torch"),
}

_REFERENCE = textwrap.dedent(
    """
    import contextlib, io, json, logging, sys
    logging.disable(logging.CRITICAL)
    import numpy as np, torch
    try:
        import tflite_runtime.interpreter
    except ImportError:
        # ai-edge-litert is tflite_runtime under its new name (the same Interpreter and load_delegate); v7.0 imports
        # the old name, so it is registered under that name.
        with contextlib.suppress(ImportError):
            import ai_edge_litert, ai_edge_litert.interpreter
            sys.modules["tflite_runtime"] = ai_edge_litert
            sys.modules["tflite_runtime.interpreter"] = ai_edge_litert.interpreter
    with contextlib.suppress(ImportError):
        # v7.0 compiles OpenVINO models with the CPU plugin's default precision, which is bf16 on CPUs with AMX or
        # AVX512-BF16 (about 1% off a coordinate); yolo5l's runtime asks for f32, and so does the reference here.
        from openvino.runtime import Core

        _compile = Core.compile_model

        def _compile_f32(self, model, device_name="CPU", config=None, **kwargs):
            return _compile(self, model, device_name, {"INFERENCE_PRECISION_HINT": "f32", **(config or {})}, **kwargs)

        Core.compile_model = _compile_f32
    from yolov5 import val
    from yolov5.models.common import DetectMultiBackend

    out, data, imgsz, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    x = torch.from_numpy(np.load(f"{out}/x.npy"))
    result = {}
    for fmt, path in files.items():
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                model = DetectMultiBackend(path, device=torch.device("cpu"))
                y = model(x)
                y = y[0] if isinstance(y, (list, tuple)) else y
                np.save(f"{out}/ref_{fmt}.npy", y.float().numpy())
                (_, _, map50, map_, *_), *_ = val.run(data=data, weights=path, imgsz=imgsz, batch_size=1,
                                                      device="cpu", workers=0, plots=False, project=out,
                                                      name=f"val_{fmt}")
            names = model.names
            names = [names[i] for i in sorted(names)] if isinstance(names, dict) else list(names)
            result[fmt] = {"stride": int(model.stride), "names": names, "map50": map50, "map": map_}
        except Exception as e:
            result[fmt] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"}
    print(json.dumps(result))
    """
)


def _reference_python() -> str | None:
    path = os.environ.get("YOLO5L_REFERENCE_PYTHON") or str(REPO / ".refvenv" / "bin" / "python")
    return path if os.path.isfile(path) else None


def _val(path: Path, dataset: Path, out: Path) -> dict[str, float]:
    from yolo5l.validation import validate_weights

    overrides = [f"weights={path}", *data_overrides(dataset), "data.num_workers=0", "data.cache=none",
                 "data.val_batch_size=8", "trainer=cpu", "trainer.precision=32", "plots=false"]  # fmt: skip
    return validate_weights(compose_config(overrides, config_name="val", output_dir=out))


@pytest.fixture(scope="module")
def dropin(tmp_path_factory) -> dict:
    """yolo5l's exports of tests/data/deploy_yolov5n.pt, their outputs through yolo5l and v7.0's reading of them."""
    python = _reference_python()
    if python is None:
        pytest.skip(
            "no reference environment (.refvenv/ with yolov5==7.0.14, or YOLO5L_REFERENCE_PYTHON): "
            "python scripts/bench_reference.py prints how to make it"
        )
    tmp = tmp_path_factory.mktemp("dropin")
    dataset = tmp / "synthetic"
    ensure_synthetic(dataset, **SYNTHETIC)
    v7_data = tmp / "v7_data.yaml"  # v7.0 resolves a relative `path:` against its package, not the yaml
    v7_data.write_text(yaml.safe_dump({"path": str(dataset), "train": "images/train", "val": "images/val",
                                       "names": dict(enumerate(NAMES))}))  # fmt: skip
    x = torch.rand(1, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))
    np.save(tmp / "x.npy", x.numpy())
    files, skipped, ours = {}, {}, {}
    for fmt, (args, module) in FORMATS.items():
        if module is not None:
            try:
                __import__(module)
            except ImportError as e:
                skipped[fmt] = f"{module} is not installed here ({e})"
                continue
        out = tmp / {"onnx": "w.onnx", "torchscript": "w.torchscript", "openvino": "w_openvino_model",
                     "tflite": "w.tflite"}[fmt]  # fmt: skip
        cfg = compose_config([f"weights={WEIGHTS}", f"output={out}", f"imgsz={IMGSZ}", "device=cpu", *args],
                             config_name="export", output_dir=tmp / f"run_{fmt}")  # fmt: skip
        files[fmt] = str(export_weights(cfg))
        model, *_ = load_exported(files[fmt])
        ours[fmt] = model(x).numpy()
    config = tmp / "v7_config"  # offline: v7.0 fetches Arial.ttf into its config folder unless it is there
    config.mkdir()
    import matplotlib

    shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", config / "Arial.ttf")
    env = {**os.environ, "YOLOV5_CONFIG_DIR": str(config), "YOLO_CONFIG_DIR": str(config), "YOLO_OFFLINE": "1",
           "ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS": "1", "YOLO_AUTOINSTALL": "false", "WANDB_MODE": "disabled",
           "COMET_MODE": "disabled", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # fmt: skip
    r = subprocess.run([python, "-c", _REFERENCE, str(tmp), str(v7_data), str(IMGSZ), json.dumps(files)],
                       capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    for fmt in ref:
        if "error" not in ref[fmt]:
            ref[fmt]["output"] = np.load(tmp / f"ref_{fmt}.npy")
    return {"files": files, "skipped": skipped, "ours": ours, "ref": ref, "dataset": dataset, "tmp": tmp}


def _reference(dropin: dict, fmt: str) -> dict:
    if fmt in dropin["skipped"]:
        pytest.skip(dropin["skipped"][fmt])
    ref = dropin["ref"][fmt]
    if "error" in ref and ref["error"].startswith(("ImportError", "ModuleNotFoundError")):
        pytest.skip(f"the reference environment cannot run {fmt}: {ref['error']}")
    assert "error" not in ref, ref["error"]
    return ref


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_v7_loader_reads_stride_names_and_outputs(dropin, fmt):
    ref = _reference(dropin, fmt)
    assert ref["stride"] == 32
    assert ref["names"] == NAMES  # from the file's metadata (v7.0 falls back to class0, class1, ... without it)
    ours, theirs = dropin["ours"][fmt], ref["output"]
    assert theirs.shape == ours.shape == (1, 3 * sum((IMGSZ // s) ** 2 for s in (8, 16, 32)), 5 + len(NAMES))
    # Boxes in input pixels (v7.0 scales TFLite's fractions back by the image size), then objectness and classes.
    np.testing.assert_allclose(theirs[..., :4], ours[..., :4], atol=1e-2, rtol=1e-4)
    np.testing.assert_allclose(theirs[..., 4:], ours[..., 4:], atol=1e-4)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_v7_val_scores_what_yolo5l_val_scores(dropin, fmt):
    ref = _reference(dropin, fmt)
    ours = _val(Path(dropin["files"][fmt]), dropin["dataset"], dropin["tmp"] / f"val_{fmt}")
    assert ours["val/map_50"] > 0.5, ours  # it detects most shapes: the comparison is of real detections
    assert ref["map50"] == pytest.approx(ours["val/map_50"], abs=0.01)
    assert ref["map"] == pytest.approx(ours["val/map"], abs=0.01)
