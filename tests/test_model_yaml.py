"""Models from v7.0 model yamls (``YOLOv5(cfg=...)``, ``model.cfg=``) and the parts that see their output levels.

The yamls v7.0 ships build with v7.0's parameter counts (tests/_v7_yamls.py holds them as facts). With the reference
environment (``yolov5==7.0.14`` in ``.refvenv/`` at the repository root, or a python named by
``YOLO5L_REFERENCE_PYTHON``), v7.0's own DetectionModel and ComputeLoss are run on the same yamls and their
checkpoints must give identical outputs and losses here; without it those tests are skipped.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import textwrap
from pathlib import Path

import _v7_yamls as V7
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch import nn

from yolo5l.base.errors import UserError
from yolo5l.callbacks.ema import EMACallback
from yolo5l.config import compose_config
from yolo5l.models.common import Conv
from yolo5l.models.model_source import build_model
from yolo5l.models.weights import load_checkpoint, load_weights, save_weights
from yolo5l.models.yolo import YOLOv5, freeze_layers
from yolo5l.training.loss import YOLOv5Loss, loss_args

REPO = Path(__file__).resolve().parents[1]
HYP = {"box": 0.05, "obj": 1.0, "cls": 0.5, "anchor_t": 4.0}


def _write(tmp_path: Path, spec: dict, name: str = "model.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _small(name: str, width: float = 0.125, nc: int | None = None) -> dict:
    spec = V7.spec(name)
    spec["width_multiple"] = min(spec["width_multiple"], width)
    spec["depth_multiple"] = min(spec["depth_multiple"], 0.33)
    if nc is not None:
        spec["nc"] = nc
    return spec


# ---------------------------------------------------------------------------------------------------------------
# Building v7.0's yamls
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(V7.V7_COUNTS))
def test_v7_yamls_build_with_v7_counts(tmp_path, name):
    params, tensors, strides = V7.V7_COUNTS[name]
    with torch.device("meta"):  # shapes only: 144M parameters cost nothing here
        model = YOLOv5(cfg=_write(tmp_path, V7.spec(name)))
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(model.state_dict()) == tensors
    assert model.detect.stride.tolist() == strides
    assert model.num_classes == V7.spec(name)["nc"]
    assert all(k.startswith("model.") and k.split(".")[1].isdigit() for k in model.state_dict())
    assert len(model.model) == len(V7.spec(name)["backbone"]) + len(V7.spec(name)["head"])


def test_layer_names_are_ultralytics(tmp_path):
    with torch.device("meta"):
        ghost = YOLOv5(cfg=V7.spec("yolov5s-ghost"))
        v3 = YOLOv5(cfg=V7.spec("yolov3-spp"))
        tr = YOLOv5(cfg=V7.spec("yolov5s-transformer"))
    assert "model.2.m.0.conv.0.cv1.conv.weight" in ghost.state_dict()  # C3Ghost > GhostBottleneck > GhostConv
    assert "model.6.7.cv2.bn.running_var" in v3.state_dict()  # 8 Bottlenecks in an nn.Sequential
    assert "model.8.m.tr.0.ma.in_proj_weight" in tr.state_dict()  # C3TR > TransformerBlock > MultiheadAttention
    assert isinstance(YOLOv5(cfg=_small("yolov5s-LeakyReLU")).model[0].act, nn.LeakyReLU)


def test_released_tables_are_recognised():
    # A yaml of the released layers builds through the built-in tables: same modules, and `cfg` says which.
    p5 = YOLOv5(cfg=_small("yolov5s"))
    p6 = YOLOv5(cfg=_small("yolov5s6"))
    assert (p5.cfg, p6.cfg, p5.describe()) == (None, "p6", "a P5 model with depth 0.33, width 0.125")
    ref = YOLOv5(num_classes=80, depth=0.33, width=0.125)
    assert p5.architecture() == ref.architecture()
    assert [tuple(v.shape) for v in p5.state_dict().values()] == [tuple(v.shape) for v in ref.state_dict().values()]
    placeholders = YOLOv5(cfg=_small("yolov5-p6"))  # `anchors: 3`: v7.0's placeholders, for AutoAnchor to fit
    assert placeholders.cfg == "p6"
    assert placeholders.anchor_pixels()[0].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["backbone"].append([-1, 1, "Segment", [3]]), "layer 10 uses 'Segment', which yolo5l does not"),
        (lambda s: s["head"].insert(0, [-1, 1, "eval", ["1"]]), "uses 'eval', which yolo5l does not build"),
        (lambda s: s["head"].__setitem__(0, [-1, 0, "Conv", [512, 1, 1]]), r"layer 10 .* is not a \[from, number"),
        (lambda s: s["head"].__setitem__(2, [[-1, 16], 1, "Concat", [1]]), "layer 12 reads from 16, which is not"),
        (lambda s: s["head"].append([-1, 1, "Conv", [8, 1, 1]]), "a Detect head must be the last layer"),
        (lambda s: s.pop("anchors"), "missing anchors"),
        (lambda s: s.update(depth_multiple=-1), "depth_multiple=-1 must be a positive number"),
        (lambda s: s.update(activation="__import__('os').system('touch pwned')"), "activation=.* give one of"),
        (lambda s: s["head"].__setitem__(2, [[-1, 2], 1, "Concat", [1]]), "the layers do not fit together"),
        (lambda s: s["head"].__setitem__(0, [-1, 1, "Conv", [512, "x"]]), r"layer 10 \(Conv .*cannot be built"),
    ],
)
def test_bad_yaml_is_one_line_naming_the_file(tmp_path, change, message):
    spec = _small("yolov5s")
    change(spec)
    path = _write(tmp_path, spec, "bad.yaml")
    with pytest.raises(ValueError, match=message) as err:
        YOLOv5(cfg=path)
    assert str(err.value).startswith(str(path))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "pwned").exists()
    assert not Path("pwned").exists()


def test_missing_and_unreadable_yaml(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.yaml: no such model yaml"):
        YOLOv5(cfg=tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=r"give p5, p6 or the path of a YOLOv5 v7\.0 model \.yaml"):
        YOLOv5(cfg="p7")
    broken = tmp_path / "broken.yaml"
    broken.write_text("backbone: [[-1, 1, Conv\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: not valid YAML"):
        YOLOv5(cfg=broken)


# ---------------------------------------------------------------------------------------------------------------
# Everything that sees the output levels: forward, decode, fuse, freeze, loss, EMA, validation metrics
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["yolov5s6", "yolov5-p2", "yolov5-p34", "yolov3-tiny", "kitchen"])
def test_heads_decode_and_fuse_for_any_level_count(name):
    model = YOLOv5(cfg=_small(name, nc=3))
    x = torch.rand(1, 3, 128, 192)
    heads = model(x)
    strides = model.stride.tolist()
    assert [tuple(h.shape) for h in heads] == [(1, 3, 128 // s, 192 // s, 8) for s in strides]
    model.eval()
    with torch.no_grad():
        out = model.decode(model(x))
        fused = copy.deepcopy(model).fuse()
        torch.testing.assert_close(fused.decode(fused(x)), out, rtol=1e-4, atol=1e-3)
    assert out.shape == (1, sum(3 * (128 // s) * (192 // s) for s in strides), 8)
    with pytest.raises(ValueError, match=f"multiples of {int(max(strides))}"):
        model(torch.rand(1, 3, 128 + int(max(strides)) // 2, 192))
    loss = YOLOv5Loss.from_model(model, 128, **loss_args(HYP))
    assert loss.nl == len(strides)
    assert loss.balance == {3: (4.0, 1.0, 0.4)}.get(len(strides), (4.0, 1.0, 0.25, 0.06, 0.02)[: len(strides)])
    total, items = loss(model.train()(x), torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.4]]))
    assert torch.isfinite(total)
    assert items.shape == (3,)


def test_freeze_p6_backbone():
    model = YOLOv5(num_classes=2, width=0.125, cfg="p6")
    frozen = freeze_layers(model, 12)  # the P6 backbone is layers 0-11
    assert frozen
    assert all(n.split(".")[1] in {str(i) for i in range(12)} for n in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in frozen)
    assert any(n.startswith("model.11.") for n in frozen)
    assert not any(n.startswith("model.12.") for n in frozen)


def test_p6_trains_with_ema_and_validates(tmp_path, tiny_module, tiny_data, make_trainer, one_thread):
    torch.manual_seed(0)
    model = YOLOv5(num_classes=2, depth=0.33, width=0.125, cfg="p6", fused_upsample=True, fused_bn_act=True)
    module = tiny_module(nbs=4, model=model)  # batch 4: an optimizer step per batch
    ema = EMACallback(decay=0.9, tau=1)
    trainer = make_trainer(tmp_path, callbacks=[ema], max_epochs=1, limit_train_batches=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(module, datamodule=tiny_data(n=8, batch_size=4))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for key in ("val/map_50", "val/map", "val/loss_box", "val/loss_obj", "train/loss"):
        assert math.isfinite(metrics.get(key, math.nan)), key
    assert ema.updates == 2
    changed = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert any(k.startswith("model.33.m.3.") for k in changed)  # the P6 head trained


def test_yaml_model_round_trips_through_yolo5l_files(tmp_path):
    torch.manual_seed(0)
    model = YOLOv5(cfg=_small("yolov5s-ghost", nc=3))
    path = save_weights(model, tmp_path / "ghost.pt", half=False, imgsz=128)
    ckpt = torch.load(path, weights_only=True)
    assert json.dumps(ckpt["model_config"]["cfg"]["head"]) == json.dumps(model.cfg["head"])
    again, info = load_checkpoint(path)
    assert (info.transferred, info.imgsz, again.architecture()) == (len(model.state_dict()), 128, model.architecture())
    x = torch.rand(1, 3, 64, 64)
    model.eval()
    again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
    model.plain_upsample()  # export swaps the fused upsample out; a yaml model has it too
    assert not any(type(m).__name__ == "UpsampleNearest2x" for m in model.modules())


# ---------------------------------------------------------------------------------------------------------------
# model.cfg= on the command line
# ---------------------------------------------------------------------------------------------------------------


def test_typed_model_cfg_uses_the_yamls_multiples(tmp_path):
    path = _write(tmp_path, _small("yolov5-p2"), "p2.yaml")
    cfg = compose_config([f"model.cfg={path}"], output_dir=tmp_path / "run")
    model, info = build_model(cfg, num_classes=3, overrides=[f"model.cfg={path}"])
    assert info is None
    assert (model.depth, model.width, model.detect.nl, model.num_classes) == (0.33, 0.125, 4, 3)
    assert model.anchor_pixels()[0].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]  # the yaml's `anchors: 3`
    assert cfg.model_built.cfg["head"][-1][2] == "Detect"  # the run config rebuilds it (resume)
    assert (cfg.model_built.depth, cfg.model.cfg) == (0.33, str(path))
    typed = [f"model.cfg={path}", "model.width=0.25"]
    cfg = compose_config(typed, output_dir=tmp_path / "run")
    assert build_model(cfg, num_classes=3, overrides=typed)[0].width == 0.25
    typed = ["model.cfg=missing.yaml"]
    cfg = compose_config(typed, output_dir=tmp_path / "run")
    with pytest.raises(UserError, match=r"model\.cfg=missing\.yaml: missing\.yaml: no such model yaml"):
        build_model(cfg, num_classes=3, overrides=typed)


def test_resumed_yaml_run_matches_its_command_line_without_the_yaml(tmp_path):
    from yolo5l.resume import merge_resume_config

    path = _write(tmp_path, _small("yolov5-p2"), "p2.yaml")
    typed = [f"model.cfg={path}", "data.imgsz=128"]
    cfg = compose_config(typed, output_dir=tmp_path / "run")
    model, _ = build_model(cfg, num_classes=3, overrides=typed)
    saved = OmegaConf.to_container(cfg)
    path.unlink()
    merged = merge_resume_config(compose_config(typed, output_dir=tmp_path / "run"), saved, typed, "last.ckpt")
    again, _ = build_model(merged, num_classes=3, overrides=typed)
    assert again.architecture() == model.architecture()
    assert again.state_dict().keys() == model.state_dict().keys()


def test_train_build_wires_the_yaml_model_and_its_stride(tmp_path):
    from yolo5l.train import build

    path = _write(tmp_path, _small("yolov5s6"), "s6.yaml")
    typed = ["experiment=smoke", f"model.cfg={path}", f"data.synthetic.root={tmp_path / 'synthetic'}", "logger=none"]
    cfg = compose_config(typed, output_dir=tmp_path / "run")
    from hydra.core.hydra_config import HydraConfig

    assert list(HydraConfig.get().overrides.task) == typed  # what build_model reads as typed
    datamodule, module, _ = build(cfg)
    assert (module.model.cfg, module.model.width, datamodule.stride) == ("p6", 0.125, 64)
    assert module.loss.nl == 4


# ---------------------------------------------------------------------------------------------------------------
# Against v7.0 itself (skipped without the reference environment)
# ---------------------------------------------------------------------------------------------------------------


def _reference_python() -> str | None:
    path = os.environ.get("YOLO5L_REFERENCE_PYTHON") or str(REPO / ".refvenv" / "bin" / "python")
    return path if os.path.isfile(path) else None


_REFERENCE = textwrap.dedent(
    """
    import contextlib, copy, io, json, logging, sys
    logging.disable(logging.CRITICAL)
    import numpy as np, torch
    from torch import nn
    from yolov5.models.common import Conv
    from yolov5.models.yolo import DetectionModel
    from yolov5.utils.loss import ComputeLoss

    out, names = sys.argv[1], sys.argv[2:]
    hyp = {"box": 0.05, "obj": 1.0, "cls": 0.5, "anchor_t": 4.0, "cls_pw": 1.0, "obj_pw": 1.0, "fl_gamma": 0.0}
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.4, 0.6], [1, 2, 0.3, 0.7, 0.9, 0.8], [1, 0, 0.1, 0.2, 0.05, 0.07]])
    for name in names:
        Conv.default_act = nn.SiLU()  # parse_model sets it from a yaml's `activation` for the whole process
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model = DetectionModel(f"{out}/{name}.yaml")
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    c = m.num_features
                    m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(c, generator=g) * 0.1)
                    m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                    m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        x = torch.rand(2, 3, 256, 384, generator=g)
        model.eval()
        with torch.no_grad():
            pred = model(x)[0]
        raw = copy.deepcopy(model)
        with torch.no_grad():
            for p in raw.parameters():
                p.mul_(0.5)
        ckpt = {"epoch": 3, "best_fitness": np.array([0.25]), "model": raw, "ema": copy.deepcopy(model),
                "updates": 10, "optimizer": None, "opt": {"imgsz": 256}, "git": None, "date": "2022-11-22"}
        torch.save(ckpt, f"{out}/{name}.pt")
        model.train()  # batch statistics from here on (the running ones are saved above)
        nl, nc = model.model[-1].nl, model.model[-1].nc
        model.hyp = dict(hyp, box=hyp["box"] * 3 / nl, cls=hyp["cls"] * nc / 80 * 3 / nl,
                         obj=hyp["obj"] * (256 / 640) ** 2 * 3 / nl)  # as train.py scales them
        with torch.no_grad():
            total, items = ComputeLoss(model)(model(x), targets)
        torch.save({"x": x, "pred": pred, "total": total, "items": items, "targets": targets}, f"{out}/{name}.ref")
    """
)
_PARITY = [
    "yolov5s", "yolov5s6", "yolov5-p2", "yolov5-p7", "yolov5s-ghost", "yolov5s-transformer", "yolov5s-LeakyReLU",
    "yolov3-spp", "yolov3-tiny", "yolov5-bifpn", "kitchen",
]  # fmt: skip


@pytest.fixture(scope="module")
def v7_reference(tmp_path_factory):
    python = _reference_python()
    if python is None:
        pytest.skip("no reference environment (.refvenv/ with yolov5==7.0.14, or YOLO5L_REFERENCE_PYTHON)")
    root = tmp_path_factory.mktemp("v7ref")
    for name in _PARITY:
        _write(root, _small(name, width=0.25, nc=3 if name == "kitchen" else None), f"{name}.yaml")
    script = root / "reference.py"
    script.write_text(_REFERENCE)
    r = subprocess.run([python, str(script), str(root), *_PARITY], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


@pytest.mark.reference  # v7.0 (.refvenv) builds, runs and saves every model in a subprocess: make test-ci
@pytest.mark.parametrize("name", _PARITY)
def test_identical_outputs_and_loss_to_v7(v7_reference, name):
    ref = torch.load(v7_reference / f"{name}.ref", weights_only=True)
    model, info = load_weights(v7_reference / f"{name}.pt")  # the unstripped file: its EMA (`ema`) is taken
    assert info.transferred == info.total
    assert info.imgsz == 256
    model.eval()
    with torch.no_grad():
        pred = model.decode(model(ref["x"]))
    torch.testing.assert_close(pred, ref["pred"], rtol=1e-5, atol=1e-4)
    model.train()
    with torch.no_grad():
        total, items = YOLOv5Loss.from_model(model, 256, **loss_args(HYP))(model(ref["x"]), ref["targets"])
    torch.testing.assert_close(items, ref["items"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, ref["total"].reshape(total.shape), rtol=1e-5, atol=1e-6)
    assert any(isinstance(m, Conv) for m in model.modules())
