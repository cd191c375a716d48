"""`yolo5l.training.amp_check` (YOLOv5 v7.0's `check_amp`): fp32 and autocast detections of a fixed image compared; a
disagreement (or non-finite autocast outputs, or an error) turns mixed precision off. On the CPU with stand-in models
under bf16 autocast; on CUDA for real (`gpu`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from yolo5l.models.yolo import YOLOv5
from yolo5l.training.amp_check import amp_agrees, check_amp, check_image


class StandIn(nn.Module):
    """Decodes to two confident boxes; under autocast it shifts them by `shift` pixels, or gives NaN."""

    def __init__(self, shift: float = 0.0, nan: bool = False, fail: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.shift, self.nan, self.fail = shift, nan, fail

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x.mean() * self.w]

    def decode(self, heads: list[torch.Tensor]) -> torch.Tensor:
        autocast = torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
        if autocast and self.fail:
            raise RuntimeError("no kernel for this dtype")
        boxes = torch.tensor([[100.0, 100.0, 50.0, 60.0, 0.9, 0.9], [400.0, 300.0, 80.0, 40.0, 0.8, 0.9]])
        boxes = boxes.to(heads[0].device) + heads[0] * 0  # (2, 6): cx, cy, w, h, objectness, 1 class
        if autocast:
            boxes = boxes + torch.tensor([self.shift, 0, 0, 0, 0, 0], device=boxes.device)
            if self.nan:
                boxes = boxes * float("nan")
        return boxes[None]


def test_the_check_image_is_fixed():
    a, b = check_image(), check_image()
    assert a.shape == (640, 640, 3)
    assert a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 10  # shapes on a gradient, not a blank frame


def test_agreeing_and_disagreeing_stand_ins():
    assert amp_agrees(StandIn(), "cpu", torch.bfloat16)
    assert amp_agrees(StandIn(shift=30.0), "cpu", torch.bfloat16)  # 30 px of 640: inside YOLOv5's 0.1 tolerance
    assert not amp_agrees(StandIn(shift=100.0), "cpu", torch.bfloat16)  # 100 px: outside it
    assert not amp_agrees(StandIn(nan=True), "cpu", torch.bfloat16)  # NaN: no detections either way, still wrong


def test_a_real_model_runs_through_the_check_on_the_cpu(one_thread):
    model = YOLOv5(num_classes=3, depth=0.33, width=0.125)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert amp_agrees(model, "cpu", torch.bfloat16, size=128)
    assert model.training  # the check works on a copy
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_check_amp_falls_back_to_fp32_with_one_line():
    precision, line = check_amp(StandIn(shift=100.0), "bf16-mixed", "cpu", device="cpu")
    assert precision == "32-true"
    assert line.startswith("AMP check:")
    assert "32-true" in line
    assert "\n" not in line
    assert check_amp(StandIn(), "bf16-mixed", "cpu", device="cpu") == ("bf16-mixed", None)
    precision, line = check_amp(StandIn(fail=True), "bf16-mixed", "cpu", device="cpu")
    assert precision == "32-true"
    assert "RuntimeError: no kernel" in line


def test_check_amp_leaves_fp32_and_the_cpu_alone():
    assert check_amp(StandIn(shift=100.0), "32-true", "cpu", device="cpu") == ("32-true", None)
    assert check_amp(StandIn(shift=100.0), "bf16-mixed", "cpu") == ("bf16-mixed", None)  # only CUDA is checked


def test_build_trains_in_the_precision_the_check_gives(tmp_path, monkeypatch, capsys):
    import yolo5l.training.amp_check
    from yolo5l.config import compose_config
    from yolo5l.train import build

    seen = {}

    def disagree(model, precision, accelerator, device=None):
        seen["model"] = model
        return "32-true", "AMP check: stand-in disagreement"

    monkeypatch.setattr(yolo5l.training.amp_check, "check_amp", disagree)
    cfg = compose_config(
        ["experiment=smoke", f"data.synthetic.root={tmp_path / 'data'}", "trainer.precision=bf16-mixed"],
        output_dir=tmp_path / "run",
    )
    _, module, trainer = build(cfg)
    assert seen["model"] is module.model  # the model as built (and loaded), before training
    assert "32" in str(trainer.precision)
    assert "AMP check: stand-in disagreement" in capsys.readouterr().out


@pytest.mark.gpu
def test_on_cuda_a_real_model_keeps_16_mixed_and_a_disagreeing_one_does_not():
    torch.manual_seed(0)
    model = YOLOv5.from_name("yolov5s", num_classes=80)
    assert check_amp(model, "16-mixed", "gpu") == ("16-mixed", None)
    assert amp_agrees(model, "cuda", torch.float16)
    precision, line = check_amp(StandIn(shift=100.0), "16-mixed", "gpu")
    assert precision == "32-true"
    assert "cuda" in line
