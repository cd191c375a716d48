"""Test-time augmentation (`yolo5l.infer.tta`) against ultralytics/yolov5 v7.0's definition, for 3 and 4 output
levels."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from yolo5l.infer.tta import TTADetector, augmented_decode, clip_tails, descale, scale_image
from yolo5l.models.yolo import YOLOv5

REPO = Path(__file__).resolve().parents[1]
REF_PYTHON = REPO / ".refvenv" / "bin" / "python"


# ---- the oracle: v7.0's definition (models/yolo.py::_forward_augment, _descale_pred (in place), _clip_augmented;
# utils/torch_utils.py::scale_img), restated from its documented arithmetic -----------------------------------------
def _oracle_resize(x: Tensor, r: float, gs: int) -> Tensor:
    if r == 1.0:
        return x
    h, w = x.shape[2:]
    new = (int(h * r), int(w * r))
    x = F.interpolate(x, size=new, mode="bilinear", align_corners=False)
    target_h, target_w = math.ceil(h * r / gs) * gs, math.ceil(w * r / gs) * gs
    return F.pad(x, [0, target_w - new[1], 0, target_h - new[0]], value=0.447)


def oracle_tta(forward_once, x: Tensor, nl: int, gs: int) -> Tensor:
    """forward_once: images -> decoded (B, N, 5 + C). Returns v7.0's augmented inference output."""
    hw = x.shape[-2:]
    outs = []
    for r, flip in ((1.0, None), (0.83, 3), (0.67, None)):
        y = forward_once(_oracle_resize(x.flip(flip) if flip else x, r, gs)).clone()
        y[..., :4] /= r
        if flip == 3:
            y[..., 0] = hw[1] - y[..., 0]
        outs.append(y)
    cells = sum(4**k for k in range(nl))  # grid points of all levels, in units of the coarsest level's cells
    outs[0] = outs[0][:, : -(outs[0].shape[1] // cells)]  # the coarsest level of the full-size pass
    outs[-1] = outs[-1][:, (outs[-1].shape[1] // cells) * 4 ** (nl - 1) :]  # the finest level of the smallest pass
    return torch.cat(outs, 1)


class FourLevels(nn.Module):
    """A stand-in detector with 4 output levels (strides 8..64, as the P6 models): heads from pooled pixels, so
    flips and scales change them; decode as YOLOv5's (grid offsets, strides, 3 anchors)."""

    def __init__(self, nc: int = 2) -> None:
        super().__init__()
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0, 64.0]))
        self.proj = nn.Conv2d(3, 3 * (5 + nc), 1)
        self.no = 5 + nc

    def forward(self, x: Tensor) -> list[Tensor]:
        heads = []
        for s in self.stride.tolist():
            p = self.proj(F.avg_pool2d(x, int(s)))  # (B, 3 * no, H/s, W/s)
            b, _, ny, nx = p.shape
            heads.append(p.view(b, 3, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous())
        return heads

    def decode(self, heads: list[Tensor]) -> Tensor:
        out = []
        for h, s in zip(heads, self.stride.tolist(), strict=True):
            b, _, ny, nx, no = h.shape
            y = h.sigmoid()
            gy, gx = torch.meshgrid(torch.arange(ny), torch.arange(nx), indexing="ij")
            grid = torch.stack((gx, gy), -1).view(1, 1, ny, nx, 2).float()
            xy = (y[..., :2] * 2 - 0.5 + grid) * s
            wh = (y[..., 2:4] * 2) ** 2 * s * 4
            out.append(torch.cat((xy, wh, y[..., 4:]), -1).reshape(b, -1, no))
        return torch.cat(out, 1)


@pytest.fixture(scope="module")
def yolov5n() -> YOLOv5:
    torch.manual_seed(0)
    model = YOLOv5.from_name("yolov5n", num_classes=3).eval()
    for m in model.modules():  # BatchNorm statistics away from the identity, so that every layer matters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("hw", [(96, 128), (128, 64), (160, 160)])
@torch.no_grad()
def test_three_levels_equal_v7(yolov5n, hw):
    x = torch.rand(2, 3, *hw, generator=torch.Generator().manual_seed(1))
    got = augmented_decode(yolov5n, x)
    want = oracle_tta(lambda im: yolov5n.decode(yolov5n(im)), x, nl=3, gs=32)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # More rows than the plain pass, fewer than three full passes; the plain pass's finest levels come first.
    plain = yolov5n.decode(yolov5n(x))
    assert plain.shape[1] < got.shape[1] < 3 * plain.shape[1]
    p5 = 3 * (hw[0] // 32) * (hw[1] // 32)
    torch.testing.assert_close(got[:, : plain.shape[1] - p5], plain[:, :-p5])


@torch.no_grad()
def test_four_levels_equal_v7():
    torch.manual_seed(0)
    model = FourLevels().eval()
    x = torch.rand(2, 3, 128, 192)
    got = TTADetector(model)(x)
    want = oracle_tta(lambda im: model.decode(model(im)), x, nl=4, gs=64)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_given_heads_are_the_first_pass(yolov5n):
    x = torch.rand(1, 3, 64, 96)
    torch.testing.assert_close(augmented_decode(yolov5n, x, yolov5n(x)), augmented_decode(yolov5n, x))


def test_pieces_by_hand():
    x = torch.zeros(1, 3, 100, 60)
    assert scale_image(x, 1.0) is x
    y = scale_image(x, 0.67, 32)  # int(67) x int(40.2) content, padded to 96 x 64
    assert y.shape[2:] == (96, 64)
    assert (y[..., :67, :40] == 0).all()
    assert torch.allclose(y[..., 67:, :], torch.tensor(0.447))
    assert torch.allclose(y[..., :, 40:], torch.tensor(0.447))
    pred = torch.tensor([[[10.0, 20.0, 4.0, 8.0, 0.9, 0.5]]])
    torch.testing.assert_close(descale(pred, 3, 0.5, (100, 60)), torch.tensor([[[40.0, 40.0, 8.0, 16.0, 0.9, 0.5]]]))
    torch.testing.assert_close(descale(pred, 2, 0.5, (100, 60)), torch.tensor([[[20.0, 60.0, 8.0, 16.0, 0.9, 0.5]]]))
    a, b = torch.arange(21.0).view(1, 21, 1), torch.arange(21.0).view(1, 21, 1)
    first, last = clip_tails([a, b], [[16, 4, 1], [16, 4, 1]])
    assert first.shape[1] == 20
    assert last.shape[1] == 5
    assert last[0, 0, 0] == 16


_REF_SCRIPT = r"""
import json, sys, torch
from yolov5.models.yolo import Model
cfg = json.loads(sys.argv[1])
model = Model(cfg["yaml"], ch=3, nc=cfg["nc"]).eval()
model.load_state_dict(torch.load(cfg["state"], map_location="cpu"), strict=True)
x = torch.load(cfg["x"])
with torch.no_grad():
    y = model(x, augment=True)[0]
torch.save(y, cfg["out"])
"""


@pytest.mark.reference  # make test-ci (CI) runs it
@pytest.mark.skipif(not REF_PYTHON.exists(), reason="needs .refvenv with yolov5==7.0.14 (scripts/bench_reference.py)")
@torch.no_grad()
def test_side_by_side_with_ultralytics_v7(yolov5n, tmp_path):
    """The same weights in the real v7.0 package (`model(x, augment=True)`) and in yolo5l."""
    import os

    where = "import yolov5, pathlib; print(pathlib.Path(yolov5.__file__).parent)"
    probe = subprocess.run([str(REF_PYTHON), "-c", where], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        pytest.skip(f"the reference venv cannot import yolov5: {probe.stderr.strip().splitlines()[-1:]}")
    yaml_path = Path(probe.stdout.strip().splitlines()[-1]) / "models" / "yolov5n.yaml"
    torch.save({k: v.clone() for k, v in yolov5n.state_dict().items()}, tmp_path / "state.pt")
    x = torch.rand(2, 3, 96, 160, generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    cfg = {"yaml": str(yaml_path), "nc": 3, "state": str(tmp_path / "state.pt"), "x": str(tmp_path / "x.pt"),
           "out": str(tmp_path / "y.pt")}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS="1", YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(tmp_path),
               YOLOV5_CONFIG_DIR=str(tmp_path), PYTHONWARNINGS="ignore")  # fmt: skip
    r = subprocess.run([str(REF_PYTHON), "-c", _REF_SCRIPT, json.dumps(cfg)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    want = torch.load(tmp_path / "y.pt")
    got = augmented_decode(yolov5n, x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
