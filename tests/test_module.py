from __future__ import annotations

import pytest
import torch

from yolo5l.callbacks import EMACallback, LastCheckpoint, ThroughputMonitor, ValEveryNEpochs
from yolo5l.eval.metrics import precision_recall_at_best_f1
from yolo5l.training.optim import CosineLR, LinearLR, interp, optimizer_impl_kwargs, param_groups, yolov5_param_groups

KEYS = {
    "train/loss_box",
    "train/loss_obj",
    "train/loss_cls",
    "train/loss",
    "train/lr0",
    "train/lr1",
    "train/lr2",
    "val/map",
    "val/map_50",
    "val/precision",
    "val/recall",
    "val/fitness",
    "val/loss_box",
    "val/loss_obj",
    "val/loss_cls",
    "train/images_per_sec",
    "train/data_wait",
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fit_and_validate_end_to_end(tmp_path, precision, tiny_module, tiny_data, make_trainer):
    module = tiny_module()
    cbs = [EMACallback(tau=2), LastCheckpoint(dirpath=tmp_path / "ck"), ValEveryNEpochs(1), ThroughputMonitor()]
    tr = make_trainer(tmp_path, cbs, max_epochs=2, precision=precision)
    tr.fit(module, tiny_data())
    assert KEYS <= set(tr.callback_metrics)
    for k in KEYS:
        assert torch.isfinite(tr.callback_metrics[k]), k
    m = tr.callback_metrics
    torch.testing.assert_close(m["val/fitness"], 0.1 * m["val/map_50"] + 0.9 * m["val/map"])
    (out,) = tr.validate(module, tiny_data(), verbose=False)
    assert {"val/map", "val/map_50", "val/fitness"} <= set(out)
    preds = tr.predict(module, tiny_data().val_dataloader())
    assert len(preds) == 2
    assert all(p.shape[1] == 6 and p.shape[0] <= 300 for p in preds[0])


def _expected_steps(n_iter, nb, batch, nbs, warmup_epochs=3.0):
    """YOLOv5's accumulation rule written out directly (A.6)."""
    nw = max(round(warmup_epochs * nb), 100)
    last, steps = -1, 0
    for ni in range(n_iter):
        acc = max(1, round(1 + (nbs / batch - 1) * min(ni, nw) / nw)) if ni <= nw else max(round(nbs / batch), 1)
        if ni - last >= acc:
            last, steps = ni, steps + 1
    return steps


@pytest.mark.usefixtures("one_thread")
def test_warmup_accumulation_counts_optimizer_steps(tmp_path, tiny_module, tiny_data, make_trainer):
    module = tiny_module(nbs=40)
    tr = make_trainer(tmp_path, max_epochs=3, limit_val_batches=0)
    tr.fit(module, tiny_data(n=8, batch_size=2))
    expected = _expected_steps(12, 4, 2, 40)
    assert 1 < expected < 12
    assert tr.global_step == expected
    # after the loop, the warmup lr of the bias group went down from 0.1 towards lr0 * lf
    opt = module.optimizers().optimizer
    assert opt.param_groups[1]["momentum"] == pytest.approx(interp(11, (0, 100), (0.8, 0.937)))


def test_interp_and_schedules():
    assert interp(50, (0, 100), (0.1, 0.01)) == pytest.approx(0.055)
    assert interp(-1, (0, 100), (0.1, 0.01)) == 0.1
    assert interp(200, (0, 100), (0.1, 0.01)) == 0.01
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    lin, cos = LinearLR(opt, 300, 0.01).lr_lambdas[0], CosineLR(opt, 300, 0.01).lr_lambdas[0]
    assert lin(0) == 1.0
    assert lin(300) == pytest.approx(0.01)
    assert lin(150) == pytest.approx(0.505)
    assert cos(0) == pytest.approx(1.0)
    assert cos(300) == pytest.approx(0.01)
    assert cos(150) == pytest.approx(0.505)


def test_param_groups_and_optimizer(tiny_module):
    module = tiny_module()
    biases, decay, bn = param_groups(module.model)
    n_conv = sum(1 for m in module.model.modules() if isinstance(m, torch.nn.Conv2d))
    n_bn = sum(1 for m in module.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert len(decay) == n_conv
    assert len(bn) == n_bn
    assert len(biases) == n_bn + 3  # BN biases + the 3 Detect conv biases
    groups = yolov5_param_groups(module.model, 5e-4)
    assert [len(g["params"]) for g in groups] == [len(biases), len(decay), len(bn)]
    opt = torch.optim.SGD(groups, lr=0.01, momentum=0.937, nesterov=True, **optimizer_impl_kwargs("foreach"))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 5e-4, 0.0]
    assert opt.defaults["foreach"]
    assert optimizer_impl_kwargs("fused") == {"fused": True}
    assert optimizer_impl_kwargs("loop") == {"foreach": False}


def test_weight_decay_scales_with_nominal_batch(tmp_path, tiny_module, tiny_data, make_trainer):
    module = tiny_module(nbs=64)
    tr = make_trainer(tmp_path, max_epochs=1)
    module.trainer = tr
    tr.datamodule = tiny_data(batch_size=24)
    cfg = module.configure_optimizers()
    # bs 24: accumulate round(64/24) = 3, decay 5e-4 * 24 * 3 / 64 = 5.625e-4 (A.6)
    assert cfg["optimizer"].param_groups[1]["weight_decay"] == pytest.approx(5.625e-4)


def test_bad_inputs_are_named():
    from yolo5l.eval.metrics import DetectionMAP
    from yolo5l.models.yolo import YOLOv5
    from yolo5l.training.module import YOLOv5Module

    parts = {"loss": torch.nn.Identity(), "optimizer": None, "scheduler": None, "metric": DetectionMAP()}
    with pytest.raises(ValueError, match="class names"):
        YOLOv5Module(YOLOv5(2, 0.33, 0.125), names=["a"], **parts)
    with pytest.raises(ValueError, match="optimizer_impl"):
        YOLOv5Module(YOLOv5(2, 0.33, 0.125), names=["a", "b"], optimizer_impl="x", **parts)
    module = YOLOv5Module(YOLOv5(2, 0.33, 0.125), names=["a", "b"], **parts)
    with pytest.raises(ValueError, match="can only validate"):
        module.configure_optimizers()


@pytest.mark.usefixtures("one_thread")
def test_both_map_backends_validate_the_same_detections(tmp_path, tiny_module, tiny_data, make_trainer):
    from yolo5l.eval.metrics import DetectionMAP

    results = {}
    for backend in ("yolov5", "coco"):
        module = tiny_module(map_backend=backend)
        assert isinstance(module.map_metric, DetectionMAP) == (backend == "yolov5")
        (results[backend],) = make_trainer(tmp_path).validate(module, tiny_data(), verbose=False)
    assert KEYS - {k for k in KEYS if k.startswith("train/")} <= set(results["yolov5"])
    assert set(results["yolov5"]) == set(results["coco"])
    for k in ("val/loss_box", "val/loss_obj", "val/loss_cls"):  # same weights, same batches
        assert results["yolov5"][k] == pytest.approx(results["coco"][k])


def test_precision_recall_at_best_f1_hand_case():
    # Class 0: recall thresholds 0..0.5 reached at confidence 0.9 with precision 1, 0.5..1.0 at 0.2 with 0.5.
    r = 101
    rec = torch.linspace(0, 1, r)
    p0 = torch.where(rec <= 0.5, 1.0, 0.5).double()
    s0 = torch.where(rec <= 0.5, 0.9, 0.2).double()
    # class 1 has no labels (precision -1) and must be ignored
    p = torch.stack((p0, torch.full((r,), -1.0, dtype=torch.float64)), 1)
    s = torch.stack((s0, torch.zeros(r, dtype=torch.float64)), 1)
    prec, recall = precision_recall_at_best_f1(p, s)
    # F1 at conf in (0.2, 0.9]: 2*1*0.5/1.5 = 0.667; at conf <= 0.2: 2*0.5*1/1.5 = 0.667, tie -> smoothing decides;
    # both candidate points are valid answers of the definition
    assert (prec.item(), recall.item()) in {(1.0, 0.5), (0.5, 1.0)}
    # make the high-confidence point strictly better
    p0b = torch.where(rec <= 0.5, 1.0, 0.2).double()
    prec, recall = precision_recall_at_best_f1(torch.stack((p0b, p[:, 1]), 1), s)
    assert prec.item() == pytest.approx(1.0)
    assert recall.item() == pytest.approx(0.5)


def test_collate_contract_shapes(tiny_data, tiny_collate):
    images, targets, paths, shapes = tiny_collate([tiny_data().ds[0], tiny_data().ds[1]])
    assert images.shape == (2, 3, 64, 64)
    assert targets.shape == (2, 6)
    assert targets[:, 0].tolist() == [0.0, 1.0]
    assert len(paths) == len(shapes) == 2


def test_predict_step_takes_the_datamodules_uint8_batches(tiny_module):
    """`trainer.predict(module, dataloaders=datamodule.val_dataloader())` hands predict_step the loader's uint8
    batches (the datamodule's on_after_batch_transfer, which converts them, runs only for a trainer given the
    datamodule): the same detections as the [0, 1] floats."""
    module = tiny_module().eval()
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    shapes = [((48, 64), ((1.0, 1.0), (0.0, 8.0)))] * 2
    with torch.no_grad():
        got = module.predict_step((images, torch.zeros(0, 6), ["a.jpg", "b.jpg"], shapes), 0)
        want = module.predict_step((images.float() / 255, torch.zeros(0, 6), ["a.jpg", "b.jpg"], shapes), 0)
        plain = module.predict_step(images.float() / 255, 0)
    assert len(got) == 2
    for g, w, p in zip(got, want, plain, strict=True):
        torch.testing.assert_close(g, w)
        assert g.shape[1] == p.shape[1] == 6
