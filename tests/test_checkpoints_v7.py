"""What an ultralytics/yolov5 v7.0 user has: unstripped ``last.pt``/``best.pt`` of a running or interrupted run, P6
checkpoints, and ``weights=`` building the model the file holds.

The files are written with the fake ``models`` package of tests/test_weights.py (ultralytics' attribute layout),
here as train.py writes them during a run: optimizer state, ``opt``, ``ema`` beside ``model``, numpy
``best_fitness``, ``updates``, ``wandb_id``, ``date``.
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import types

import _v7_yamls as V7
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_loss import oracle_loss
from test_weights import YOLOV5S_YAML, _pickle_globals, _randomize, _ultralytics_ckpt, fake_ultralytics

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.convert import main as convert_main
from yolo5l.models.model_source import build_model, model_stride
from yolo5l.models.weights import UnsafeCheckpointError, load_checkpoint, load_ultralytics, load_weights
from yolo5l.models.yolo import YOLOv5
from yolo5l.training.loss import YOLOv5Loss, loss_args

HYP = {"box": 0.05, "obj": 1.0, "cls": 0.5, "anchor_t": 4.0}


def _small(name: str, width: float = 0.125) -> dict:
    spec = V7.spec(name)
    spec["width_multiple"] = width
    return spec


def _optimizer_state(model: torch.nn.Module) -> dict:
    """A real SGD state after one step, with numpy learning rates as v7.0's warmup (np.interp) leaves them."""
    params = [p for p in model.parameters() if p.dtype == torch.float32]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.937, nesterov=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        p.grad = None
    state = opt.state_dict()
    for group in state["param_groups"]:
        group["lr"], group["momentum"] = np.float64(0.00913), np.float64(0.8871)
    return state


def _unstripped(model, ema, namespace: bool = False, imgsz: int = 320) -> dict:
    """The dict v7.0's train.py saves every epoch (utils/general.py::strip_optimizer has not run)."""
    opt = {
        "weights": "yolov5s.pt", "cfg": "", "data": "data/coco128.yaml", "epochs": 100, "batch_size": 16,
        "imgsz": imgsz, "save_dir": "runs/train/exp3", "hyp": {"lr0": np.float64(0.01), "anchor_t": 4.0},
        "noautoanchor": False, "freeze": [0],
    }  # fmt: skip
    return {
        "epoch": 41,
        "best_fitness": np.array([0.4321]),
        "model": model,
        "ema": ema,
        "updates": 12345,
        "optimizer": _optimizer_state(copy.deepcopy(model).float()),
        "opt": argparse.Namespace(**opt) if namespace else opt,
        "git": {"remote": "https://github.com/ultralytics/yolov5", "branch": "master", "commit": "915bbf2"},
        "wandb_id": "2xk4f0a1",
        "date": "2022-11-22T12:34:56.789012",
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Unstripped P5 files (opt as dict and as Namespace), a P6 release-like file, and their float references."""
    root = tmp_path_factory.mktemp("v7")
    x = torch.rand(2, 3, 128, 192)
    out = types.SimpleNamespace(x=x, root=root)
    with fake_ultralytics() as yolo:
        torch.manual_seed(0)
        cfg = {**copy.deepcopy(YOLOV5S_YAML), "width_multiple": 0.125, "nc": 4}
        raw = yolo.DetectionModel(cfg)
        _randomize(raw)
        ema = copy.deepcopy(raw)
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(0.9)  # the EMA differs from the raw weights everywhere
        out.ema_ref = copy.deepcopy(ema).eval()
        out.raw_ref = copy.deepcopy(raw).eval()
        out.last = root / "last.pt"
        torch.save(_unstripped(raw.half(), ema.half()), out.last)
        out.last_ns = root / "last_ns.pt"
        torch.save(_unstripped(raw, ema, namespace=True, imgsz=448), out.last_ns)
        out.ema_ref.half().float()  # the saved weights are fp16: compare against the same rounding
        out.raw_ref.half().float()

        torch.manual_seed(1)
        p6 = yolo.DetectionModel(_small("yolov5s6"))
        _randomize(p6)
        out.p6_ref = copy.deepcopy(p6).half().float()
        out.p6 = root / "yolov5s6.pt"
        torch.save(_ultralytics_ckpt(p6.half()), out.p6)  # a release file: stripped, opt without imgsz
    return out


def _decoded(model, x):
    model.eval()
    with torch.no_grad():
        return model.decode(model(x))


# ---------------------------------------------------------------------------------------------------------------
# Unstripped checkpoints and the numpy allow-list
# ---------------------------------------------------------------------------------------------------------------


def test_unstripped_file_really_holds_numpy_and_optimizer_state(files):
    found = _pickle_globals(files.last)
    assert {"numpy ndarray", "numpy dtype"} <= found  # best_fitness
    assert any(g.endswith("multiarray _reconstruct") for g in found)
    assert any(g.endswith("multiarray scalar") for g in found)  # the numpy learning rates
    assert "argparse Namespace" in _pickle_globals(files.last_ns)


@pytest.mark.parametrize("which", ["last", "last_ns"])
def test_unstripped_loads_the_ema_weights(files, which):
    model, info = load_weights(getattr(files, which))
    assert (info.transferred, info.total, info.file_num_classes) == (349, 349, 4)
    assert info.imgsz == (320 if which == "last" else 448)  # opt.imgsz, dict or Namespace
    ref_sd = files.ema_ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_sd[k].to(v.dtype), rtol=0, atol=0, msg=k)
    with torch.no_grad():
        expected = files.ema_ref(files.x)[0]
        raw = files.raw_ref(files.x)[0]
    pred = _decoded(model, files.x)
    torch.testing.assert_close(pred, expected, rtol=1e-4, atol=1e-3)
    assert (pred - raw).abs().max() > 1e-2  # the raw `model` entry was not taken


def test_unstripped_converts_and_trains_from(files, tmp_path, capsys):
    out = tmp_path / "best_yolo5l.pt"
    assert convert_main([str(files.last), str(out)]) == 0
    assert "Transferred 349/349 items" in capsys.readouterr().out
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["imgsz"] == 320
    assert ckpt["model_config"]["cfg"] is None
    cfg = compose_config([f"weights={files.last}", "data.imgsz=128"], output_dir=tmp_path / "run")
    model, info = build_model(cfg, num_classes=4, overrides=[f"weights={files.last}"])
    assert (model.width, info.transferred) == (0.125, 349)  # the file's model, not conf/model/yolov5s.yaml's 0.5
    assert (cfg.model_built.depth, cfg.model_built.width, cfg.model_built.cfg) == (0.33, 0.125, None)
    assert cfg.model.width == 0.5  # the config as given stays (a resumed run's command line is checked against it)


def _raw_pickle(tmp_path, module: str, name: str) -> str:
    """A checkpoint-like pickle that calls ``module.name('x')`` when loaded by plain pickle (protocol 2)."""
    path = tmp_path / f"{name}.pt"
    path.write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x01\x00\x00\x00x\x85R.")
    return str(path)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("numpy", "load"),
        ("numpy.lib.npyio", "load"),
        ("numpy.testing._private.utils", "runstring"),
        ("numpy.core.multiarray", "_frombuffer"),
        ("numpy._core.multiarray", "fromstring"),
        ("numpy.ctypeslib", "load_library"),
        ("numpy", "recarray"),
        ("numpy.core.numeric", "_frombuffer"),
    ],
)
def test_numpy_looking_globals_are_refused(tmp_path, module, name):
    path = _raw_pickle(tmp_path, module, name)
    with pytest.raises(UnsafeCheckpointError, match=f"refused to unpickle global '{module}.{name}'"):
        load_ultralytics(path)


@pytest.mark.filterwarnings("ignore:the matrix subclass")
@pytest.mark.parametrize("kind", ["masked", "recarray", "matrix", "object-array-of-a-function"])
def test_other_numpy_arrays_are_refused(tmp_path, kind):
    # numpy subclasses reconstruct through their own globals; an object array carries its items' globals.
    value = {
        "masked": lambda: np.ma.array([1.0, 2.0], mask=[0, 1]),
        "recarray": lambda: np.rec.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
        "matrix": lambda: np.matrix([[1, 2]]),
        "object-array-of-a-function": lambda: np.array([os.system], dtype=object),
    }[kind]()
    path = tmp_path / "arrays.pt"
    torch.save({"model": None, "best_fitness": value}, path)
    with pytest.raises(UnsafeCheckpointError):
        load_ultralytics(path)


def test_plain_numpy_values_round_trip_through_the_allow_list(tmp_path):
    from yolo5l.io.safe_pickle import restricted_pickle

    value = {"a": np.array([[0.5, 2.0]]), "i": np.int64(7), "f": np.float32(0.25), "d": np.dtype("f2"),
             "o": np.array([1, "x", None], dtype=object)}  # fmt: skip
    back = restricted_pickle.loads(pickle.dumps(value, protocol=2))
    np.testing.assert_array_equal(back["a"], value["a"])
    assert (back["i"], back["f"], back["d"], back["o"].tolist()) == (7, 0.25, np.dtype("f2"), [1, "x", None])


# ---------------------------------------------------------------------------------------------------------------
# P6
# ---------------------------------------------------------------------------------------------------------------


def test_p6_file_gives_identical_outputs_and_loss(files):
    model, info = load_ultralytics(files.p6)
    assert (model.cfg, model.detect.nl, model.stride.tolist()) == ("p6", 4, [8.0, 16.0, 32.0, 64.0])
    assert (info.transferred, info.total) == (459, 459)
    assert info.imgsz == 1280  # a release file records none: v7.0's P6 size
    ref_sd = files.p6_ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_sd[k].to(v.dtype), rtol=0, atol=0, msg=k)
    files.p6_ref.eval()
    with torch.no_grad():
        expected = files.p6_ref(files.x)[0]
    torch.testing.assert_close(_decoded(model, files.x), expected, rtol=1e-4, atol=1e-3)
    # Raw heads in training mode, and the loss of v7.0's ComputeLoss (the sync-full oracle) on the reference's
    # heads: 4 levels, balance (4, 1, 0.25, 0.06), gains x 3/4.
    model.train()
    files.p6_ref.train()
    heads = model(files.x)
    with torch.no_grad():
        ref_heads = files.p6_ref(files.x)
    assert [h.shape[2:4] for h in heads] == [(16, 24), (8, 12), (4, 6), (2, 3)]
    for h, r in zip(heads, ref_heads, strict=True):
        torch.testing.assert_close(h, r, rtol=1e-4, atol=1e-4)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.4, 0.6], [1, 3, 0.3, 0.7, 0.9, 0.8], [1, 0, 0.1, 0.2, 0.05, 0.07]])
    loss = YOLOv5Loss.from_model(model, 192, **loss_args(HYP))
    total, items = loss([h.detach() for h in heads], targets)
    ref_total, ref_items = oracle_loss(
        list(ref_heads), targets, model.anchors, 80, balance=(4.0, 1.0, 0.25, 0.06), imgsz=192
    )
    assert loss.balance == (4.0, 1.0, 0.25, 0.06)
    torch.testing.assert_close(items, ref_items, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(total, ref_total, rtol=1e-4, atol=1e-5)


def test_p6_release_names_resolve_to_the_v7_release(tmp_path, monkeypatch):
    from yolo5l.io.download import weights_url

    monkeypatch.chdir(tmp_path)
    for name in ("yolov5n6.pt", "yolov5x6.pt", "yolov5s.pt"):
        assert weights_url(name) == f"https://github.com/ultralytics/yolov5/releases/download/v7.0/{name}"
    assert weights_url("yolov5s7.pt") is None


def test_p6_converts_and_every_p6_size_builds_from_its_name(files, tmp_path):
    out = tmp_path / "s6.pt"
    assert convert_main([str(files.p6), str(out)]) == 0
    ckpt = torch.load(out, weights_only=True)
    assert (ckpt["model_config"]["cfg"], ckpt["imgsz"], len(ckpt["model_config"]["anchors"])) == ("p6", 1280, 4)
    model, _ = load_checkpoint(out)
    torch.testing.assert_close(_decoded(model, files.x), _decoded(load_ultralytics(files.p6)[0], files.x))
    for name in ("yolov5n6", "yolov5s6", "yolov5m6", "yolov5l6", "yolov5x6"):
        with torch.device("meta"):
            built = YOLOv5.from_name(name)
        assert sum(p.numel() for p in built.parameters()) == V7.V7_COUNTS[name][0], name
        assert built.describe() == name


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit trace/save deprecation
def test_export_and_predict_build_the_p6_model_from_the_file(files, tmp_path, capsys):
    from PIL import Image

    from yolo5l.deploy.exported import load_exported
    from yolo5l.export import export_weights
    from yolo5l.predict import predict

    cfg = compose_config(
        [f"weights={files.p6}", "format=torchscript", f"output={tmp_path / 's6.torchscript'}", "device=cpu",
         "imgsz=128"],
        config_name="export", output_dir=tmp_path / "run_export",
    )  # fmt: skip
    exported, names, imgsz, stride = load_exported(export_weights(cfg))
    assert (imgsz, stride, len(names)) == (128, 64, 80)  # stride 64 in the file's metadata
    x = torch.rand(1, 3, 128, 128)
    torch.testing.assert_close(exported(x), _decoded(load_ultralytics(files.p6)[0], x), rtol=1e-4, atol=1e-3)
    Image.new("RGB", (90, 60), (90, 120, 30)).save(tmp_path / "img.png")
    for size in (128, 96):  # 96: rounded up to 128, the next multiple of the stride 64, as v7.0's detect.py
        cfg = compose_config([f"weights={files.p6}", f"source={tmp_path / 'img.png'}", f"imgsz={size}"], "predict",
                             tmp_path / f"run_predict{size}")  # fmt: skip
        assert isinstance(predict(cfg), list)
    out = capsys.readouterr().out
    assert "warning: imgsz=96 is not a multiple of 64, the model's largest stride: using imgsz=128" in out
    assert out.count("warning: imgsz=") == 1


# ---------------------------------------------------------------------------------------------------------------
# weights= builds the file's model
# ---------------------------------------------------------------------------------------------------------------


def _cfg(tmp_path, *overrides):
    return compose_config(list(overrides), output_dir=tmp_path / "run"), list(overrides)


def test_weights_build_the_p6_model_without_model_option(files, tmp_path):
    cfg, typed = _cfg(tmp_path, f"weights={files.p6}", "data.imgsz=128")
    model, info = build_model(cfg, num_classes=3, overrides=typed)
    assert (model.cfg, model.num_classes, info.transferred, info.total) == ("p6", 3, 451, 459)  # new Detect convs
    built = cfg.model_built
    assert built.cfg == "p6"
    assert len(built.anchors) == 4
    assert built.width == 0.125
    rebuilt = YOLOv5(num_classes=3, depth=built.depth, width=built.width, anchors=built.anchors, cfg="p6")
    torch.testing.assert_close(rebuilt.anchors, model.anchors)  # the saved run config rebuilds it (resume)
    assert model_stride(model) == 64  # its sizes: multiples of 64


def test_resume_rebuilds_the_weights_model_without_the_file(files, tmp_path):
    from yolo5l.resume import merge_resume_config

    p6 = tmp_path / "copy.pt"
    p6.write_bytes(files.p6.read_bytes())
    typed = [f"weights={p6}", "data.imgsz=128"]
    cfg = compose_config(typed, output_dir=tmp_path / "run")
    model, _ = build_model(cfg, num_classes=3, overrides=typed)
    saved = OmegaConf.to_container(cfg)
    p6.unlink()  # resume reads the checkpoint, never the starting weights again
    merged = merge_resume_config(compose_config(typed, output_dir=tmp_path / "run"), saved, typed, "last.ckpt")
    again, info = build_model(merged, num_classes=3, overrides=typed)
    assert info is None
    assert again.architecture() == model.architecture()
    torch.testing.assert_close(again.anchors, model.anchors)


def test_typed_model_that_conflicts_with_the_weights_is_one_line(files, tmp_path):
    cfg, typed = _cfg(tmp_path, f"weights={files.p6}", "model=yolov5s")
    with pytest.raises(UserError) as err:
        build_model(cfg, num_classes=3, overrides=typed)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"weights={files.p6} holds a P6 model with depth 0.33, width 0.125 but model=yolov5s asks for yolov5s" in msg
    # The same architecture typed explicitly is fine; the conf default (model=yolov5s, not typed) never conflicts.
    cfg, typed = _cfg(tmp_path, f"weights={files.last}", "model=yolov5s", "model.width=0.125")
    model, _ = build_model(cfg, num_classes=4, overrides=typed)
    assert model.width == 0.125
    cfg, typed = _cfg(tmp_path, f"weights={files.last}", "model.depth=0.67")
    with pytest.raises(UserError, match=r"model\.depth=0\.67 asks for a P5 model with depth 0\.67, width 0\.5:"):
        build_model(cfg, num_classes=4, overrides=typed)


@pytest.mark.heavy  # a subprocess up to the data: the message itself is checked in-process above
def test_conflict_on_the_command_line_is_one_error_line_and_no_run_folder(files, tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"weights={files.p6}", "model=yolov5s",
         f"hydra.run.dir={run_dir}", f"data.synthetic.root={tmp_path / 'synthetic'}", "logger=none"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith(f"error: weights={files.p6} holds a P6 model with depth 0.33, width 0.125 but model=yolov5s")
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_typed_anchors_replace_the_files(files, tmp_path):
    anchors = "[[5,6,7,8,9,10],[11,12,13,14,15,16],[17,18,19,20,21,22]]"
    cfg, typed = _cfg(tmp_path, f"weights={files.last}", f"model.anchors={anchors}")
    model, _ = build_model(cfg, num_classes=4, overrides=typed)
    assert model.anchor_pixels()[0, 0].tolist() == [5.0, 6.0]
    cfg, typed = _cfg(tmp_path, f"weights={files.last}")
    model, _ = build_model(cfg, num_classes=4, overrides=typed)
    torch.testing.assert_close(model.anchors, files.ema_ref.model[-1].anchors.float())


@pytest.mark.heavy  # a training subprocess: make test-ci (CI)
def test_training_run_from_a_p6_file(files, tmp_path):
    """`python -m yolo5l.train weights=<P6 .pt>`: no model= needed; the run's checkpoint and weights are P6."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"weights={files.p6}", f"hydra.run.dir={run_dir}",
         f"data.synthetic.root={tmp_path / 'synthetic'}", "trainer.limit_train_batches=1",
         "trainer.limit_val_batches=1", "logger=none"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"transferred 451/459 items from {files.p6} (a P6 model with depth 0.33, width 0.125)" in r.stdout + r.stderr
    ckpt = torch.load(run_dir / "checkpoints" / "weights.pt", weights_only=True)
    assert ckpt["model_config"]["cfg"] == "p6"
    model, _ = load_checkpoint(run_dir / "checkpoints" / "weights.pt")
    assert model.detect.nl == 4
