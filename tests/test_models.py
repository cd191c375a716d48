"""YOLOv5 model family: architecture counts against ultralytics' printed summaries, head maths, fuse, configs."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from yolo5l.models.common import Conv
from yolo5l.models.yolo import ANCHORS_P3_P5, YOLOv5

CONF_MODEL = Path(__file__).resolve().parents[1] / "conf" / "model"

# Per-layer parameter counts of yolov5s / 80 classes (reference §A.1 table, = ultralytics' printed summary).
YOLOV5S_LAYER_PARAMS = [
    3520, 18560, 18816, 73984, 115712, 295424, 625152, 1180672, 1182720, 656896, 131584, 0, 0,
    361984, 33024, 0, 0, 90880, 147712, 0, 296448, 590336, 0, 1182720, 229245,
]  # fmt: skip


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def randomize_bn(model: nn.Module) -> None:
    """Give every BatchNorm non-trivial statistics so that fuse and weight loading are really exercised."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)


@pytest.fixture(scope="module")
def yolov5s() -> YOLOv5:
    torch.manual_seed(0)
    return YOLOv5.from_name("yolov5s", num_classes=80)


def test_yolov5s_counts_match_ultralytics(yolov5s):
    assert n_params(yolov5s) == 7_235_389
    sd = yolov5s.state_dict()
    assert len(sd) == 349
    assert [n_params(m) for m in yolov5s.model] == YOLOV5S_LAYER_PARAMS
    # Ultralytics' names, including the head's anchors; the stride buffer is not persistent.
    for key in ["model.0.conv.weight", "model.0.bn.running_mean", "model.2.m.0.cv1.conv.weight",
                "model.9.cv2.bn.num_batches_tracked", "model.23.cv3.bn.weight", "model.24.m.0.weight",
                "model.24.m.2.bias", "model.24.anchors"]:  # fmt: skip
        assert key in sd, key
    assert not any("stride" in k for k in sd)
    assert sd["model.0.conv.weight"].shape == (32, 3, 6, 6)
    assert sd["model.24.m.0.weight"].shape == (255, 128, 1, 1)
    # 57 BatchNorms (yolov5s' 57 "no decay" weights) and 60 weights + 60 biases in the optimizer groups.
    assert sum(isinstance(m, nn.BatchNorm2d) for m in yolov5s.modules()) == 57
    assert sum(isinstance(m, nn.Conv2d) for m in yolov5s.modules()) == 60


@pytest.mark.parametrize(
    ("name", "params", "fused_params", "tensors"),
    [
        # Fused counts are what ultralytics prints after "Fusing layers..." (yolov5n 1,867,405; yolov5m 21,172,173).
        ("yolov5n", 1_872_157, 1_867_405, 349),
        ("yolov5s", 7_235_389, 7_225_885, 349),
        ("yolov5m", 21_190_557, 21_172_173, 481),
    ],
)
def test_family_parameter_counts(name, params, fused_params, tensors):
    model = YOLOv5.from_name(name, num_classes=80)
    assert n_params(model) == params
    assert len(model.state_dict()) == tensors
    # Fusing removes a BN's weight + bias and adds a conv bias: one parameter less per BN channel.
    bn_channels = sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert n_params(model.fuse()) == fused_params == params - bn_channels


def test_from_name_scales_and_errors():
    # 6 convs-worth of tensors per Conv and 7 in Detect: l has 101 Convs (33 bottlenecks), x 123 (44).
    for name, depth, width in [("yolov5l", 1.0, 1.0), ("yolov5x", 1.33, 1.25)]:
        model = YOLOv5.from_name(name, num_classes=2)
        assert (model.depth, model.width, model.num_classes) == (depth, width, 2)
        n_conv = sum(isinstance(m, Conv) for m in model.modules())
        assert n_conv == {"yolov5l": 101, "yolov5x": 123}[name]
        assert len(model.state_dict()) == 6 * n_conv + 7
    with pytest.raises(ValueError, match="unknown model name"):
        YOLOv5.from_name("yolov5q")
    with pytest.raises(ValueError, match="anchors must be 3 levels"):
        YOLOv5(anchors=[[10, 13, 16, 30]])
    with pytest.raises(ValueError, match="num_classes"):
        YOLOv5(num_classes=0)


def test_init_matches_yolov5(yolov5s):
    for m in yolov5s.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert (m.eps, m.momentum) == (1e-3, 0.03)
        if isinstance(m, nn.SiLU):
            assert m.inplace
    detect = yolov5s.detect
    for conv, s in zip(detect.m, [8, 16, 32]):
        # Default conv bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), then the YOLOv5 priors are added.
        bound = 1 / math.sqrt(conv.in_channels)
        b = conv.bias.detach().view(3, 85)
        assert (b[:, :4].abs() <= bound).all()
        assert ((b[:, 4] - math.log(8 / (640 / s) ** 2)).abs() <= bound).all()
        assert ((b[:, 5:] - math.log(0.6 / (80 - 0.99999))).abs() <= bound).all()
    assert math.log(8 / 80**2) == pytest.approx(-6.685, abs=1e-3)


def test_anchors_in_grid_units_and_order_check(yolov5s):
    assert yolov5s.stride.tolist() == [8.0, 16.0, 32.0]
    anchors = yolov5s.anchors
    assert anchors.shape == (3, 3, 2)
    assert anchors[0, 0].tolist() == [10 / 8, 13 / 8]
    assert anchors[2, 2].tolist() == [373 / 32, 326 / 32]
    pixels = torch.tensor(ANCHORS_P3_P5, dtype=torch.float32).view(3, 3, 2)
    torch.testing.assert_close(yolov5s.anchor_pixels(), pixels)
    # Levels listed largest first get flipped back (check_anchor_order), and (3, 3, 2) nests are accepted.
    reversed_model = YOLOv5(num_classes=1, anchors=pixels.flip(0).tolist())
    torch.testing.assert_close(reversed_model.anchors, anchors)


def test_forward_shapes_train_and_eval(yolov5s):
    x = torch.rand(2, 3, 64, 96)
    for mode in (True, False):
        yolov5s.train(mode)
        with torch.no_grad():
            heads = yolov5s(x)
        assert [tuple(h.shape) for h in heads] == [(2, 3, 8, 12, 85), (2, 3, 4, 6, 85), (2, 3, 2, 3, 85)]
    yolov5s.eval()
    with pytest.raises(ValueError, match="multiples of 32"):
        yolov5s(torch.rand(1, 3, 60, 64))


def test_gradients_reach_every_parameter():
    model = YOLOv5.from_name("yolov5n", num_classes=3).train()
    heads = model(torch.rand(1, 3, 64, 64))
    sum(h.float().square().mean() for h in heads).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_decode_hand_values(yolov5s):
    # Zero logits: sigmoid 0.5 -> xy = (2*0.5 - 0.5 + j) * s = cell centre, wh = (2*0.5)^2 * anchor = anchor.
    heads = [torch.zeros(1, 3, 8, 12, 85), torch.zeros(1, 3, 4, 6, 85), torch.zeros(1, 3, 2, 3, 85)]
    out = yolov5s.decode(heads)
    assert out.shape == (1, 3 * (96 + 24 + 6), 85)
    # Level 0, anchor 1, row y=2, column x=5 -> index a*ny*nx + y*nx + x.
    row = out[0, 1 * 96 + 2 * 12 + 5]
    torch.testing.assert_close(row[:4], torch.tensor([5.5 * 8, 2.5 * 8, 16.0, 30.0]))
    assert (row[4:] == 0.5).all()
    # Level 2 (first after 3*96 + 3*24 rows), anchor 2, y=1, x=2.
    row = out[0, 3 * 96 + 3 * 24 + 2 * 6 + 1 * 3 + 2]
    torch.testing.assert_close(row[:4], torch.tensor([2.5 * 32, 1.5 * 32, 373.0, 326.0]))


def test_decode_matches_loop_formula(yolov5s):
    g = torch.Generator().manual_seed(3)
    heads = [torch.randn(2, 3, ny, nx, 85, generator=g) for ny, nx in [(8, 12), (4, 6), (2, 3)]]
    out = yolov5s.decode(heads)
    rows = []
    for i, h in enumerate(heads):
        s = [8, 16, 32][i]
        anchors = torch.tensor(ANCHORS_P3_P5[i], dtype=torch.float32).view(3, 2)
        _, na, ny, nx, _ = h.shape
        for a in range(na):
            for y in range(ny):
                for x in range(nx):
                    p = h[:, a, y, x].sigmoid()
                    cx = (2 * p[:, 0] - 0.5 + x) * s
                    cy = (2 * p[:, 1] - 0.5 + y) * s
                    wh = (2 * p[:, 2:4]) ** 2 * anchors[a]
                    rows.append(torch.cat([cx[:, None], cy[:, None], wh, p[:, 4:]], 1))
    torch.testing.assert_close(out, torch.stack(rows, 1))


def test_decode_inference_mode_channels_last_and_grad():
    model = YOLOv5.from_name("yolov5n", num_classes=7).eval()
    randomize_bn(model)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        ref = model.decode(model(x))
    model_cl = YOLOv5.from_name("yolov5n", num_classes=7).eval()
    model_cl.load_state_dict(model.state_dict())
    model_cl = model_cl.to(memory_format=torch.channels_last)
    with torch.inference_mode():
        out = model_cl.decode(model_cl(x.contiguous(memory_format=torch.channels_last)))
        out_again = model_cl.decode(model_cl(x))  # cached grid reused
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_again, out)
    # Decoding with autograd after an inference_mode call still works (the grid cache is keyed by mode).
    with torch.no_grad():
        heads = [h.requires_grad_(True) for h in model_cl(x)]
    model_cl.decode(heads).sum().backward()
    assert all(h.grad is not None for h in heads)


def test_channels_last_heads_are_dense_views_with_equal_loss_and_grads():
    """channels_last heads skip the transposing copy; values, loss and gradients equal the contiguous heads'."""
    from yolo5l.training.loss import YOLOv5Loss

    torch.manual_seed(0)
    model = YOLOv5.from_name("yolov5n", num_classes=3).train()
    model_cl = YOLOv5.from_name("yolov5n", num_classes=3).train().to(memory_format=torch.channels_last)
    model_cl.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 64, 64)
    heads, heads_cl = model(x), model_cl(x.contiguous(memory_format=torch.channels_last))
    assert all(h.is_contiguous() for h in heads)
    assert not any(h.is_contiguous() for h in heads_cl)  # views: no copy
    assert all(h.stride(-1) == 1 for h in heads_cl)
    for h, h_cl in zip(heads, heads_cl, strict=True):
        torch.testing.assert_close(h_cl, h, atol=1e-4, rtol=1e-3)  # conv algorithms differ per memory format
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.4], [1, 2, 0.3, 0.6, 0.2, 0.2]])
    loss_fn = YOLOv5Loss.from_model(model, 64, box=0.05, obj=1.0, cls=0.5, anchor_t=4.0)
    loss, _ = loss_fn(heads, targets)
    loss_cl, _ = loss_fn(heads_cl, targets)
    torch.testing.assert_close(loss_cl, loss, atol=1e-4, rtol=1e-4)
    loss.sum().backward()
    loss_cl.sum().backward()
    for (name, p), p_cl in zip(model.named_parameters(), model_cl.parameters(), strict=True):
        torch.testing.assert_close(p_cl.grad, p.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_fuse_matches_unfused_in_eval():
    model = YOLOv5.from_name("yolov5s", num_classes=5)
    randomize_bn(model)
    model.eval()
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        ref_heads = model(x)
        ref = model.decode(ref_heads)
        assert model.fuse() is model
        heads = model(x)
        out = model.decode(heads)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    for h, r in zip(heads, ref_heads):
        torch.testing.assert_close(h, r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)


def test_fused_upsample_parity_or_fallback():
    plain = YOLOv5.from_name("yolov5n", num_classes=4).eval()
    fused = YOLOv5.from_name("yolov5n", num_classes=4, fused_upsample=True).eval()
    fused.load_state_dict(plain.state_dict())  # upsampling has no tensors: same keys either way
    if importlib.util.find_spec("yolo5l_kernels.upsample") is None:
        assert isinstance(fused.model[11], nn.Upsample)  # fallback
    else:
        from yolo5l_kernels.upsample import UpsampleNearest2x

        assert isinstance(fused.model[11], UpsampleNearest2x)
        assert isinstance(fused.model[15], UpsampleNearest2x)
    x = torch.rand(1, 3, 96, 64)
    with torch.no_grad():
        for a, b in zip(fused(x), plain(x)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["yolov5n", "yolov5s", "yolov5m", "yolov5l", "yolov5x", "yolov5n6", "yolov5s6"])
def test_every_model_config_instantiates(name):
    cfg = OmegaConf.load(CONF_MODEL / f"{name}.yaml")
    model = instantiate(cfg, num_classes=3)
    assert isinstance(model, YOLOv5)
    reference = YOLOv5.from_name(name, num_classes=3)
    assert (model.depth, model.width, model.num_classes) == (reference.depth, reference.width, 3)
    assert n_params(model) == n_params(reference)
    torch.testing.assert_close(model.anchors, reference.anchors)
    assert model.fused_upsample


def test_conf_model_folder_has_only_known_sizes():
    assert sorted(p.stem for p in CONF_MODEL.glob("*.yaml")) == [
        "yolov5l", "yolov5l6", "yolov5m", "yolov5m6", "yolov5n", "yolov5n6", "yolov5s", "yolov5s6", "yolov5x",
        "yolov5x6",
    ]  # fmt: skip
