"""Loading ultralytics/yolov5 checkpoints without ultralytics, the restricted unpickler, and the converter.

The ultralytics-format files are written here: fake ``models``, ``models.common`` and ``models.yolo`` modules are put
in ``sys.modules`` just long enough for ``torch.save`` to pickle a ``DetectionModel`` with ultralytics' attribute
layout (half precision, in the dict train.py writes), then removed again before loading.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import logging
import math
import os
import pathlib
import pickletools
import sys
import types
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

from yolo5l.convert import main as convert_main
from yolo5l.models.weights import (
    UnsafeCheckpointError,
    load_checkpoint,
    load_ultralytics,
    load_weights,
    save_weights,
)
from yolo5l.models.yolo import YOLOv5

# models/yolov5s.yaml of ultralytics/yolov5 v7.0, as DetectionModel.yaml holds it.
YOLOV5S_YAML = {
    "nc": 80,
    "depth_multiple": 0.33,
    "width_multiple": 0.50,
    "anchors": [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]],
    "backbone": [
        [-1, 1, "Conv", [64, 6, 2, 2]], [-1, 1, "Conv", [128, 3, 2]], [-1, 3, "C3", [128]],
        [-1, 1, "Conv", [256, 3, 2]], [-1, 6, "C3", [256]], [-1, 1, "Conv", [512, 3, 2]], [-1, 9, "C3", [512]],
        [-1, 1, "Conv", [1024, 3, 2]], [-1, 3, "C3", [1024]], [-1, 1, "SPPF", [1024, 5]],
    ],
    "head": [
        [-1, 1, "Conv", [512, 1, 1]], [-1, 1, "nn.Upsample", [None, 2, "nearest"]], [[-1, 6], 1, "Concat", [1]],
        [-1, 3, "C3", [512, False]], [-1, 1, "Conv", [256, 1, 1]], [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
        [[-1, 4], 1, "Concat", [1]], [-1, 3, "C3", [256, False]], [-1, 1, "Conv", [256, 3, 2]],
        [[-1, 14], 1, "Concat", [1]], [-1, 3, "C3", [512, False]], [-1, 1, "Conv", [512, 3, 2]],
        [[-1, 10], 1, "Concat", [1]], [-1, 3, "C3", [1024, False]], [[17, 20, 23], 1, "Detect", ["nc", "anchors"]],
    ],
}  # fmt: skip

# The globals a stripped yolov5 v7.0 checkpoint refers to (reference: "What an ultralytics/yolov5 checkpoint file
# holds"), plus the numpy scalar our fake `opt` carries (protocol 2 spells its bytes payload as _codecs.encode).
ULTRALYTICS_GLOBALS = {
    "collections OrderedDict", "__builtin__ set", "pathlib PosixPath", "torch FloatStorage", "torch HalfStorage",
    "torch LongStorage", "torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_parameter",
    "torch.nn.modules.activation SiLU", "torch.nn.modules.batchnorm BatchNorm2d",
    "torch.nn.modules.container ModuleList", "torch.nn.modules.container Sequential", "torch.nn.modules.conv Conv2d",
    "torch.nn.modules.pooling MaxPool2d", "torch.nn.modules.upsampling Upsample", "models.common Bottleneck",
    "models.common C3", "models.common Concat", "models.common Conv", "models.common SPPF", "models.yolo Detect",
    "models.yolo DetectionModel",
}  # fmt: skip
NUMPY_GLOBALS = {"numpy.core.multiarray scalar", "numpy._core.multiarray scalar", "numpy dtype", "_codecs encode"}
HEAD_CONVS = [f"model.24.m.{i}.{p}" for i in range(3) for p in ("weight", "bias")]


# ---------------------------------------------------------------------------------------------------------------
# A stand-in for ultralytics/yolov5 v7.0's models package (attribute layout only; written for these tests)
# ---------------------------------------------------------------------------------------------------------------


def _fake_ultralytics_modules() -> dict[str, types.ModuleType]:
    class Conv(nn.Module):
        def __init__(self, c1, c2, k=1, s=1, p=None):
            super().__init__()
            self.conv = nn.Conv2d(c1, c2, k, s, k // 2 if p is None else p, bias=False)
            self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
            self.act = nn.SiLU(inplace=True)

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))

    class Bottleneck(nn.Module):
        def __init__(self, c1, c2, shortcut=True):
            super().__init__()
            self.cv1 = Conv(c1, c2, 1, 1)
            self.cv2 = Conv(c2, c2, 3, 1)
            self.add = shortcut and c1 == c2

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C3(nn.Module):
        def __init__(self, c1, c2, n=1, shortcut=True):
            super().__init__()
            c_ = c2 // 2
            self.cv1 = Conv(c1, c_, 1, 1)
            self.cv2 = Conv(c1, c_, 1, 1)
            self.cv3 = Conv(2 * c_, c2, 1)
            self.m = nn.Sequential(*[Bottleneck(c_, c_, shortcut) for _ in range(n)])

        def forward(self, x):
            return self.cv3(torch.cat([self.m(self.cv1(x)), self.cv2(x)], 1))

    class SPPF(nn.Module):
        def __init__(self, c1, c2, k=5):
            super().__init__()
            self.cv1 = Conv(c1, c1 // 2, 1, 1)
            self.cv2 = Conv(c1 * 2, c2, 1, 1)
            self.m = nn.MaxPool2d(k, 1, k // 2)

        def forward(self, x):
            x = self.cv1(x)
            y = [x]
            for _ in range(3):
                y.append(self.m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class Concat(nn.Module):
        def __init__(self, dimension=1):
            super().__init__()
            self.d = dimension

        def forward(self, x):
            return torch.cat(x, self.d)

    class Detect(nn.Module):
        stride = None

        def __init__(self, nc, anchors, ch):
            super().__init__()
            self.nc, self.no, self.nl, self.na = nc, nc + 5, len(anchors), len(anchors[0]) // 2
            self.grid = [torch.empty(0) for _ in range(self.nl)]
            self.anchor_grid = [torch.empty(0) for _ in range(self.nl)]
            self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
            self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
            self.inplace = True

        def forward(self, xs):
            z = []
            xs = list(xs)
            for i in range(self.nl):
                xs[i] = self.m[i](xs[i])
                bs, _, ny, nx = xs[i].shape
                xs[i] = xs[i].view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
                if not self.training:
                    yv, xv = torch.meshgrid(torch.arange(ny), torch.arange(nx), indexing="ij")
                    grid = torch.stack((xv, yv), 2).view(1, 1, ny, nx, 2).float() - 0.5
                    anchor_grid = (self.anchors[i] * self.stride[i]).view(1, self.na, 1, 1, 2)
                    xy, wh, conf = xs[i].sigmoid().split((2, 2, self.nc + 1), 4)
                    xy = (xy * 2 + grid) * self.stride[i]
                    wh = (wh * 2) ** 2 * anchor_grid
                    z.append(torch.cat((xy, wh, conf), 4).view(bs, self.na * nx * ny, self.no))
            return xs if self.training else (torch.cat(z, 1), xs)

    class DetectionModel(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.yaml = copy.deepcopy(cfg)
            gd, gw = cfg["depth_multiple"], cfg["width_multiple"]
            layers, self.save, ch = [], [], [3]
            for i, (f, n, name, args) in enumerate(cfg["backbone"] + cfg["head"]):
                n = max(round(n * gd), 1) if n > 1 else n
                if name in ("Conv", "C3", "SPPF"):
                    c1, c2 = ch[f], math.ceil(args[0] * gw / 8) * 8
                    extra = [n, *args[1:]] if name == "C3" else args[1:]
                    m = {"Conv": Conv, "C3": C3, "SPPF": SPPF}[name](c1, c2, *extra)
                elif name == "nn.Upsample":
                    m, c2 = nn.Upsample(*[None if a == "None" else a for a in args]), ch[f]
                elif name == "Concat":
                    m, c2 = Concat(*args), sum(ch[x] for x in f)
                else:
                    m = Detect(cfg["nc"], cfg["anchors"], [ch[x] for x in f])
                m.i, m.f, m.type = i, f, name
                self.save.extend(x % i for x in ([f] if isinstance(f, int) else f) if x != -1)
                layers.append(m)
                ch = [] if i == 0 else ch
                ch.append(c2)
            self.model = nn.Sequential(*layers)
            detect = self.model[-1]
            detect.stride = torch.tensor([8.0, 16.0, 32.0, 64.0][: detect.nl])  # P3-P5, or P3-P6
            detect.anchors /= detect.stride.view(-1, 1, 1)
            self.stride = detect.stride
            self.names = {i: f"class{i}" for i in range(cfg["nc"])}
            self.inplace = True

        def forward(self, x):
            y = []
            for m in self.model:
                if m.f != -1:
                    x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
                x = m(x)
                y.append(x if m.i in self.save else None)
            return x

    common = types.ModuleType("models.common")
    yolo = types.ModuleType("models.yolo")
    for mod, classes in ((common, (Conv, Bottleneck, C3, SPPF, Concat)), (yolo, (Detect, DetectionModel))):
        for cls in classes:
            cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
            setattr(mod, cls.__name__, cls)
    package = types.ModuleType("models")
    package.__path__ = []
    package.common, package.yolo = common, yolo
    return {"models": package, "models.common": common, "models.yolo": yolo}


def _randomize(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
                m.num_batches_tracked.fill_(1234)


def _ultralytics_ckpt(model: nn.Module | None, ema: nn.Module | None = None) -> dict:
    return {
        "epoch": -1,
        "best_fitness": None,
        "model": model,
        "ema": ema,
        "updates": None,
        "optimizer": None,
        "opt": {
            "weights": "yolov5s.pt",
            "data": pathlib.PosixPath("data/coco.yaml"),
            "save_dir": pathlib.PosixPath("runs/train/exp"),
            "epochs": 300,
            "hyp": {"lr0": 0.01, "anchor_t": np.float64(4.0)},
        },
        "git": {},
        "date": "2022-11-22T12:00:00.000000",
    }


@contextlib.contextmanager
def fake_ultralytics():
    """Install the fake `models` package for as long as a test pickles with it."""
    fakes = _fake_ultralytics_modules()
    assert not any(name in sys.modules for name in fakes)
    sys.modules.update(fakes)
    try:
        yield fakes["models.yolo"]
    finally:
        for name in fakes:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def ultralytics_file(tmp_path_factory):
    """yolov5s.pt in ultralytics' format plus a float32 reference output of the same (fp16-rounded) weights."""
    root = tmp_path_factory.mktemp("ultralytics")
    with fake_ultralytics() as yolo:
        torch.manual_seed(0)
        model = yolo.DetectionModel(YOLOV5S_YAML)
        _randomize(model)
        with torch.no_grad():  # as if autoanchor had refined the anchors: the buffer, not the yaml, is the truth
            model.model[-1].anchors.mul_(1.1)
        model.half()
        reference = copy.deepcopy(model).float().eval()
        x = torch.rand(2, 3, 64, 96)
        with torch.no_grad():
            pred, _ = reference(x)
        path = root / "yolov5s.pt"
        torch.save(_ultralytics_ckpt(model), path)
        # A training checkpoint with both `model` and `ema`: the EMA is what yolov5's attempt_load uses.
        ema = copy.deepcopy(model)
        with torch.no_grad():
            ema.model[0].conv.weight.fill_(0.25)
        both_path = root / "last.pt"
        torch.save(_ultralytics_ckpt(model, ema), both_path)
    return types.SimpleNamespace(path=path, both_path=both_path, x=x, pred=pred, reference=reference)


def _pickle_globals(path: pathlib.Path) -> set[str]:
    with zipfile.ZipFile(path) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    return {str(arg) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


def test_fake_file_has_ultralytics_globals(ultralytics_file):
    found = _pickle_globals(ultralytics_file.path)
    assert found - NUMPY_GLOBALS == ULTRALYTICS_GLOBALS


def test_load_transfers_all_and_matches_reference(ultralytics_file, caplog):
    assert "models" not in sys.modules  # nothing of ultralytics is importable here
    with caplog.at_level(logging.INFO, logger="yolo5l.models.weights"):
        model, info = load_ultralytics(ultralytics_file.path)
    assert "models" not in sys.modules
    assert (info.transferred, info.total, info.skipped) == (349, 349, [])
    assert f"Transferred 349/349 items from {ultralytics_file.path}" in caplog.text
    assert info.file_num_classes == 80
    assert info.names[:2] == ["class0", "class1"]
    assert len(info.names) == 80
    assert (model.num_classes, model.depth, model.width) == (80, 0.33, 0.5)
    sd = model.state_dict()
    ref_sd = ultralytics_file.reference.state_dict()
    assert set(sd) == set(ref_sd)
    for k, v in sd.items():
        assert v.dtype == (torch.int64 if k.endswith("num_batches_tracked") else torch.float32), k
        torch.testing.assert_close(v, ref_sd[k].to(v.dtype), rtol=0, atol=0, msg=k)
    # Anchors come from the (autoanchor-refined) buffer: 1.1x the yaml's pixels, rounded to fp16.
    torch.testing.assert_close(
        model.anchor_pixels(), torch.tensor(YOLOV5S_YAML["anchors"]).view(3, 3, 2) * 1.1, rtol=1e-3, atol=0
    )
    model.eval()
    with torch.no_grad():
        pred = model.decode(model(ultralytics_file.x))
    assert pred.shape == ultralytics_file.pred.shape == (2, 3 * (96 + 24 + 6), 85)
    # Same fp16-rounded weights computed in float32 on both sides: only op-order rounding differs.
    torch.testing.assert_close(pred, ultralytics_file.pred, rtol=1e-4, atol=1e-3)


def test_other_num_classes_skips_only_detect_convs(ultralytics_file):
    model, info = load_ultralytics(ultralytics_file.path, num_classes=3)
    assert (info.transferred, info.total) == (343, 349)
    assert info.skipped == HEAD_CONVS
    assert info.names == ["0", "1", "2"]
    assert model.model[24].m[0].weight.shape == (3 * 8, 128, 1, 1)
    ref_sd = ultralytics_file.reference.state_dict()
    torch.testing.assert_close(model.state_dict()["model.23.cv3.conv.weight"], ref_sd["model.23.cv3.conv.weight"])
    torch.testing.assert_close(model.anchors, ref_sd["model.24.anchors"].float())


def test_prefers_ema_weights(ultralytics_file):
    model, info = load_ultralytics(ultralytics_file.both_path)
    assert info.transferred == 349
    assert (model.model[0].conv.weight == 0.25).all()


@pytest.mark.parametrize("legacy_format", [False, True])
@pytest.mark.parametrize("payload", ["system", "eval"])
def test_hostile_pickle_is_refused_and_never_runs(tmp_path, payload, legacy_format):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            if payload == "system":
                return os.system, (f"touch {marker}",)
            return builtins.eval, (f"open({str(marker)!r}, 'w').close()",)

    path = tmp_path / "evil.pt"
    ckpt = _ultralytics_ckpt(None)
    ckpt["model"] = Evil()
    torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy_format)
    refused = f"{os.system.__module__}.system" if payload == "system" else "builtins.eval"
    with pytest.raises(UnsafeCheckpointError, match=f"refused to unpickle global '{refused}'") as err:
        load_ultralytics(path)
    assert str(path) in str(err.value)
    assert not marker.exists()
    # The generic loader and the CLI refuse it too.
    with pytest.raises(UnsafeCheckpointError):
        load_weights(path)
    assert convert_main([str(path), str(tmp_path / "out.pt")]) == 2
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_refuses_other_torch_callables(tmp_path):
    # torch.load itself would bypass the restriction (it unpickles with the default pickle module).
    class Nested:
        def __reduce__(self):
            return torch.load, ("x.pt",)

    path = tmp_path / "nested.pt"
    torch.save({"model": Nested()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"torch\.serialization\.load"):
        load_ultralytics(path)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/save deprecation
def test_clear_errors_for_wrong_inputs(tmp_path, ultralytics_file):
    with pytest.raises(FileNotFoundError, match=r"missing\.pt: no such file"):
        load_ultralytics(tmp_path / "missing.pt")
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=r"notes\.pt: not a readable PyTorch checkpoint"):
        load_ultralytics(text)
    with pytest.raises(ValueError, match=r"notes\.pt: not a readable PyTorch checkpoint"):
        load_weights(text)
    state_dict_only = tmp_path / "sd.pt"
    torch.save(YOLOv5.from_name("yolov5n", num_classes=2).state_dict(), state_dict_only)
    with pytest.raises(ValueError, match="no yolov5 model in this file"):
        load_ultralytics(state_dict_only)
    ours = tmp_path / "ours.pt"
    save_weights(YOLOv5.from_name("yolov5n", num_classes=2), ours)
    with pytest.raises(ValueError, match="a yolo5l checkpoint, not an ultralytics one"):
        load_ultralytics(ours)
    with pytest.raises(ValueError, match="not a yolo5l checkpoint"):
        load_checkpoint(ultralytics_file.path)
    scripted = tmp_path / "yolov5s.torchscript"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), scripted)
    with pytest.raises(ValueError, match="TorchScript"):
        load_ultralytics(scripted)


@pytest.mark.filterwarnings("ignore:Couldn't retrieve source code")  # saving the fakes (renamed classes)
def test_legacy_torch_save_format(tmp_path):
    # Files from torch < 1.6 are not zip archives; the legacy reader takes the same restricted unpickler.
    cfg = {**copy.deepcopy(YOLOV5S_YAML), "width_multiple": 0.125, "nc": 2}
    path = tmp_path / "legacy.pt"
    with fake_ultralytics() as yolo:
        fake = yolo.DetectionModel(cfg)
        _randomize(fake)
        torch.save(_ultralytics_ckpt(fake.half()), path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    model, info = load_ultralytics(path)
    assert (info.transferred, info.total, model.width, model.num_classes) == (349, 349, 0.125, 2)
    torch.testing.assert_close(
        model.state_dict(),
        {k: v.float() if v.is_floating_point() else v for k, v in fake.state_dict().items()},
        rtol=0,
        atol=0,
    )


def test_other_architecture_loads_as_its_yaml(tmp_path):
    # Any architecture made of v7.0's blocks is built from the file's own yaml, key for key.
    cfg = copy.deepcopy(YOLOV5S_YAML)
    cfg["width_multiple"] = 0.125
    cfg["backbone"][9] = [-1, 1, "Conv", [1024, 1, 1]]  # no SPPF
    path = tmp_path / "custom.pt"
    with fake_ultralytics() as yolo:
        fake = yolo.DetectionModel(cfg)
        _randomize(fake)
        torch.save(_ultralytics_ckpt(fake), path)
    model, info = load_ultralytics(path)
    assert isinstance(model.cfg, dict)
    assert model.cfg["backbone"][9] == [-1, 1, "Conv", [1024, 1, 1]]
    assert (info.transferred, info.total) == (len(fake.state_dict()), len(fake.state_dict()))
    x = torch.rand(1, 3, 64, 96)
    fake.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.decode(model(x)), fake(x)[0], rtol=1e-5, atol=1e-4)
    # The yolo5l file keeps the yaml as plain data: it loads with weights_only and rebuilds the same model.
    out = tmp_path / "custom_yolo5l.pt"
    assert convert_main([str(path), str(out)]) == 0
    assert torch.load(out, weights_only=True)["model_config"]["cfg"]["backbone"][9][2] == "Conv"
    again, _ = load_checkpoint(out)
    torch.testing.assert_close(again.state_dict(), model.state_dict(), rtol=0, atol=1e-3)  # fp16 in the file


def test_yaml_that_does_not_fit_the_weights_is_named(tmp_path):
    with fake_ultralytics() as yolo:
        fake = yolo.DetectionModel({**copy.deepcopy(YOLOV5S_YAML), "width_multiple": 0.125})
        fake.yaml["backbone"][3] = [-1, 1, "Conv", [384, 3, 2]]  # the yaml says other channels than the weights
        path = tmp_path / "tampered.pt"
        torch.save(_ultralytics_ckpt(fake.half()), path)
        fake.yaml["head"][-1][2] = "Segment"
        seg = tmp_path / "seg.pt"
        torch.save(_ultralytics_ckpt(fake), seg)
    with pytest.raises(ValueError, match=r"tampered\.pt: \d+ tensors do not fit .* do not match the architecture"):
        load_ultralytics(path)
    with pytest.raises(ValueError, match=r"seg\.pt: its model yaml: layer 24 uses 'Segment', which yolo5l does not"):
        load_ultralytics(seg)


def test_convert_cli_round_trip(tmp_path, ultralytics_file, capsys):
    out = tmp_path / "yolov5s_yolo5l.pt"
    assert convert_main([str(ultralytics_file.path), str(out)]) == 0
    assert "Transferred 349/349 items" in capsys.readouterr().out
    ckpt = torch.load(out, weights_only=True)  # plain data: no custom globals
    assert set(ckpt) == {"model_config", "state_dict", "names", "imgsz", "data"}
    assert (ckpt["imgsz"], ckpt["data"]) == (None, None)  # an ultralytics .pt records neither
    assert ckpt["model_config"]["num_classes"] == 80
    assert (ckpt["model_config"]["depth"], ckpt["model_config"]["width"]) == (0.33, 0.5)
    assert len(ckpt["model_config"]["anchors"]) == 3
    assert all(len(level) == 6 for level in ckpt["model_config"]["anchors"])
    assert len(ckpt["state_dict"]) == 349
    assert ckpt["names"][79] == "class79"

    converted, info = load_checkpoint(out)
    assert (info.transferred, info.total, info.names[0]) == (349, 349, "class0")
    ref_sd = ultralytics_file.reference.state_dict()
    for k, v in converted.state_dict().items():  # lossless: the fp16 values, in float32
        torch.testing.assert_close(v, ref_sd[k].to(v.dtype), rtol=0, atol=0, msg=k)
    converted.eval()
    with torch.no_grad():
        pred = converted.decode(converted(ultralytics_file.x))
    torch.testing.assert_close(pred, ultralytics_file.pred, rtol=1e-4, atol=1e-3)
    # load_weights reads both formats (load_ultralytics alone would refuse the yolo5l file).
    for path in (out, ultralytics_file.path):
        via_dispatch, dispatch_info = load_weights(path)
        assert (dispatch_info.source, dispatch_info.transferred) == (str(path), 349)
        torch.testing.assert_close(via_dispatch.state_dict(), converted.state_dict(), rtol=0, atol=0)

    # Fine-tuning to another class count, from the converted file and at conversion time.
    model3, info3 = load_checkpoint(out, num_classes=3)
    assert (model3.num_classes, info3.transferred, info3.skipped) == (3, 343, HEAD_CONVS)
    out3 = tmp_path / "yolov5s_3cls.pt"
    assert convert_main([str(ultralytics_file.path), str(out3), "--num-classes", "3"]) == 0
    assert "Transferred 343/349 items" in capsys.readouterr().out
    assert torch.load(out3, weights_only=True)["model_config"]["num_classes"] == 3


def test_convert_cli_errors(tmp_path, capsys):
    missing = tmp_path / "missing.pt"
    assert convert_main([str(missing), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert "missing.pt: no such file; pass an ultralytics .pt (yolov5s.pt, a train.py best.pt) or a yolo5l run's" in err
    assert err.count("\n") == 1
    # The same mistake as a command: tests/test_cli.py (a_convert_mistake_on_the_command_line_is_one_line_and_status_2)
