"""AutoAnchor (`yolo5l.training.autoanchor`, `yolo5l.callbacks.autoanchor`): YOLOv5 v7.0's BPR, anchors-per-target
and fitness definitions on hand-made boxes, the re-fit on thin boxes, determinism, and the anchors reaching the loss
and every file a run writes (and not re-fitted on resume)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yolo5l.callbacks.autoanchor import AutoAnchor, apply_anchors
from yolo5l.models.yolo import ANCHORS_P3_P5
from yolo5l.training.autoanchor import (
    anchor_fitness,
    anchor_metrics,
    check_anchors,
    evolve_anchors,
    kmean_anchors,
    kmeans,
    label_wh,
)

COCO_ANCHORS = torch.tensor(ANCHORS_P3_P5, dtype=torch.float32).reshape(3, 3, 2)


def _v7_ratio_metric(wh: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """YOLOv5's ratio metric, written as its definition: x = min over w, h of min(r, 1 / r), r = wh / anchor."""
    r = wh[:, None] / k[None]
    return torch.min(r, 1 / r).min(2)[0]  # (N, n)


def thin_boxes(images: int = 100, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Vertical and horizontal objects 2-5 px wide and 60-300 px long in 640 x 640 images (the issue's dataset)."""
    rng = np.random.default_rng(seed)
    labels = []
    for _ in range(images):
        rows = []
        for _ in range(rng.integers(3, 10)):
            a, b = rng.uniform(2, 5) / 640, rng.uniform(60, 300) / 640
            w, h = (a, b) if rng.random() < 0.5 else (b, a)
            rows.append([0, 0.5, 0.5, w, h])
        labels.append(np.asarray(rows, np.float32))
    return labels, np.full((images, 2), 640)


# ---- the definitions -------------------------------------------------------------------------------------------------
def test_bpr_aat_and_fitness_on_hand_made_boxes():
    anchors = torch.tensor([[10.0, 10.0], [40.0, 40.0]])
    wh = torch.tensor([[10.0, 10.0], [20.0, 20.0], [100.0, 5.0]])
    # box 1: x = 1 and 0.25 (not > 1/4): one anchor; box 2: x = 0.5 and 0.5: two; box 3: x = 0.1 and 0.125: none
    bpr, aat = anchor_metrics(wh, anchors, thr=4.0)
    assert bpr == pytest.approx(2 / 3)
    assert aat == pytest.approx(1.0)
    # best x per box: 1, 0.5, 0.125 (below 1/4: counts 0)
    assert float(anchor_fitness(wh, anchors, thr=4.0)) == pytest.approx((1 + 0.5 + 0) / 3)
    # a looser threshold lets box 3 in: 1/thr = 0.1 < 0.125
    assert anchor_metrics(wh, anchors, thr=10.0)[0] == pytest.approx(1.0)
    assert anchor_metrics(torch.zeros(0, 2), anchors) == (0.0, 0.0)


def test_metrics_and_fitness_match_the_ratio_definition_on_random_boxes():
    g = torch.Generator().manual_seed(1)
    wh = torch.exp(torch.randn(5000, 2, generator=g) * 1.2 + 3.5)
    k = torch.exp(torch.randn(9, 2, generator=g) + 3.5)
    x = _v7_ratio_metric(wh, k)
    best = x.max(1)[0]
    bpr, aat = anchor_metrics(wh, k)
    assert bpr == pytest.approx(float((best > 0.25).double().mean()), abs=1e-12)
    assert aat == pytest.approx(float((x > 0.25).double().sum(1).mean()), abs=1e-12)
    fit = float((best * (best > 0.25)).mean())
    assert float(anchor_fitness(wh, k)) == pytest.approx(fit, rel=1e-5)
    # many anchor sets at once give each one's fitness
    sets = torch.stack([k, k * 2, k / 3])
    batched = anchor_fitness(wh, sets)
    assert batched.shape == (3,)
    torch.testing.assert_close(batched, torch.stack([anchor_fitness(wh, s) for s in sets]))


def test_label_wh_is_pixels_at_the_training_size():
    labels = [np.array([[0, 0.5, 0.5, 0.5, 0.25]], np.float32), np.zeros((0, 5), np.float32)]
    shapes_hw = np.array([[480, 640], [100, 100]])  # the long side (640 wide) becomes 320
    wh = label_wh(labels, shapes_hw, imgsz=320)
    torch.testing.assert_close(wh, torch.tensor([[160.0, 60.0]]))
    g = torch.Generator().manual_seed(0)
    jittered = label_wh(labels, shapes_hw, imgsz=320, jitter=(0.9, 1.1), generator=g)
    ratio = (jittered / wh)[0]
    assert 0.9 <= float(ratio[0]) <= 1.1
    assert float(ratio[0]) == pytest.approx(float(ratio[1]))  # one scale per image


def test_kmeans_finds_separated_clusters(one_thread):
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    points = torch.cat([c + torch.randn(200, 2, generator=g) * 0.3 for c in centres])
    found = kmeans(points, 3, generator=torch.Generator().manual_seed(0))
    found = found[torch.argsort(found[:, 0] * 100 + found[:, 1])]
    torch.testing.assert_close(found, centres[[0, 2, 1]], atol=0.1, rtol=0)
    assert kmeans(torch.ones(10, 2), 3) is None  # fewer distinct points than clusters


def test_evolution_never_lowers_the_fitness():
    labels, shapes = thin_boxes(20)
    wh = label_wh(labels, shapes, 640)
    start = COCO_ANCHORS.reshape(-1, 2)
    k, f = evolve_anchors(wh, start, generations=20, population=8, generator=torch.Generator().manual_seed(0))
    assert f == pytest.approx(float(anchor_fitness(wh, k)))
    assert f > float(anchor_fitness(wh, start))
    assert (k >= 2.0).all()


# ---- the check and the re-fit ----------------------------------------------------------------------------------------
def test_thin_boxes_get_new_anchors_with_bpr_above_098():
    labels, shapes = thin_boxes()
    result = check_anchors(COCO_ANCHORS, labels, shapes, imgsz=640)
    assert result.bpr < 0.1  # COCO's anchors match almost none of them
    assert result.anchors is not None
    assert result.anchors.shape == (3, 3, 2)
    assert result.new_bpr >= 0.98
    assert result.new_aat > 3
    areas = result.anchors.reshape(-1, 2).prod(1)
    assert (areas[1:] >= areas[:-1]).all()  # smallest first: P3 gets the small ones
    assert "Best Possible Recall" in result.lines[0]
    assert "poor fit" in result.lines[0]
    assert "BPR" in result.lines[-1]
    assert "was" in result.lines[-1]
    # at 320 px the same boxes shrink by half: still re-fitted above 0.98
    assert check_anchors(COCO_ANCHORS, labels, shapes, imgsz=320).new_bpr >= 0.98


def test_good_anchors_are_kept_without_a_refit():
    k = COCO_ANCHORS.reshape(-1, 2)
    labels = [np.concatenate([np.zeros((9, 1)), np.full((9, 2), 0.5), (k / 640).numpy()], 1).astype(np.float32)]
    result = check_anchors(COCO_ANCHORS, labels, np.array([[640, 640]]), imgsz=640)
    assert result.bpr == 1.0
    assert result.anchors is None
    assert result.new_bpr is None
    assert "fit the dataset" in result.lines[-1]


def test_a_refit_that_is_not_better_is_dropped(monkeypatch):
    import yolo5l.training.autoanchor as aa

    labels, shapes = thin_boxes(10)
    monkeypatch.setattr(aa, "kmean_anchors", lambda *a, **k: torch.full((9, 2), 500.0))
    result = aa.check_anchors(COCO_ANCHORS, labels, shapes, imgsz=640)
    assert result.anchors is None
    assert result.new_bpr is not None
    assert result.new_bpr <= result.bpr
    assert "keeping the original anchors" in result.lines[-1]


def test_the_refit_is_deterministic_under_the_seed():
    labels, shapes = thin_boxes(30)
    a = check_anchors(COCO_ANCHORS, labels, shapes, imgsz=640, seed=3)
    b = check_anchors(COCO_ANCHORS, labels, shapes, imgsz=640, seed=3)
    c = check_anchors(COCO_ANCHORS, labels, shapes, imgsz=640, seed=4)
    assert torch.equal(a.anchors, b.anchors)
    assert a.bpr == b.bpr
    assert not torch.equal(a.anchors, c.anchors)


def test_sampling_keeps_the_fitness_of_the_full_set(one_thread):
    g = np.random.default_rng(0)
    labels = [
        np.c_[np.zeros(8), np.full((8, 2), 0.5), np.exp(g.normal(-2, 1, (8, 2))).clip(0.003, 1)] for _ in range(500)
    ]
    wh0 = label_wh(labels, np.full((500, 2), 640), 640)
    full = kmean_anchors(wh0, 9, 640, generations=30, generator=torch.Generator().manual_seed(0), max_boxes=None)
    sample = kmean_anchors(wh0, 9, 640, generations=30, generator=torch.Generator().manual_seed(0), max_boxes=2000)
    assert float(anchor_fitness(wh0, sample)) == pytest.approx(float(anchor_fitness(wh0, full)), rel=0.02)


# ---- in a training run -----------------------------------------------------------------------------------------------
def _thin_data(tiny_data):
    """TinyData whose training labels (what AutoAnchor reads) are the thin boxes, at 640 px."""
    labels, shapes = thin_boxes(40)

    class Thin(tiny_data):
        imgsz = 640
        train_dataset = type("Labels", (), {"labels": labels, "shapes": shapes})()

    return Thin(n=4, batch_size=2)


def test_new_anchors_reach_the_loss_and_every_file_and_resume_keeps_them(
    tmp_path, tiny_module, tiny_data, make_trainer, one_thread
):
    from yolo5l.callbacks import EMACallback, LastCheckpoint
    from yolo5l.callbacks.checkpoint import RunConfig
    from yolo5l.models.weights import load_weights

    ck = tmp_path / "ck"
    module = tiny_module()
    auto = AutoAnchor(seed=0, generations=20)
    run = RunConfig({"model": {"depth": 0.33, "width": 0.125}, "data": {"imgsz": 64}})  # last.ckpt's model size
    trainer = make_trainer(tmp_path, [auto, EMACallback(), LastCheckpoint(dirpath=ck), run], max_epochs=1)
    trainer.fit(module, datamodule=_thin_data(tiny_data))
    assert auto.result is not None
    assert auto.result.anchors is not None
    assert auto.result.new_bpr >= 0.98
    stride = torch.tensor([8.0, 16.0, 32.0]).view(-1, 1, 1)
    expected = (auto.result.anchors / stride).half().float()  # grid units, at the precision the files keep
    torch.testing.assert_close(module.model.anchors, expected)
    torch.testing.assert_close(module.loss.anchors, expected)  # the loss matches targets to the new anchors
    for name in ("best.pt", "weights.pt", "last.ckpt"):
        model, _ = load_weights(ck / name)
        torch.testing.assert_close(model.anchors, expected, msg=name)
        torch.testing.assert_close(model.anchor_pixels(), expected * stride, msg=name)
    raw = torch.load(ck / "last.ckpt", map_location="cpu", weights_only=True)
    for key in ("state_dict", "current_model_state"):  # the EMA and the raw weights both carry them
        torch.testing.assert_close(raw[key]["model.model.24.anchors"], expected)

    # resume: no second check (the checkpoint's anchors win), and the loss follows the restored model
    fresh = tiny_module()
    again = AutoAnchor(seed=0, generations=20)
    trainer = make_trainer(tmp_path, [again, EMACallback(), LastCheckpoint(dirpath=ck)], max_epochs=2)
    trainer.fit(fresh, datamodule=_thin_data(tiny_data), ckpt_path=str(ck / "last.ckpt"))
    assert again.result is None
    torch.testing.assert_close(fresh.model.anchors, expected)
    torch.testing.assert_close(fresh.loss.anchors, expected)


def test_noautoanchor_and_good_anchors_change_nothing(tmp_path, tiny_module, tiny_data, make_trainer, one_thread):
    module = tiny_module()
    before = module.model.anchors.clone()
    off = AutoAnchor(noautoanchor=True)
    make_trainer(tmp_path, [off], max_epochs=1, limit_train_batches=1, limit_val_batches=0).fit(
        module, datamodule=_thin_data(tiny_data)
    )
    assert off.result is None
    torch.testing.assert_close(module.model.anchors, before)


def test_autoanchor_must_run_before_the_ema(tmp_path, tiny_module, tiny_data, make_trainer):
    from yolo5l.callbacks import EMACallback

    trainer = make_trainer(tmp_path, [EMACallback(), AutoAnchor()], max_epochs=1)
    with pytest.raises(RuntimeError, match="AutoAnchor must come before EMACallback"):
        trainer.fit(tiny_module(), datamodule=_thin_data(tiny_data))


def test_apply_anchors_rounds_to_half_and_sets_the_loss(tiny_module):
    module = tiny_module()
    px = torch.tensor([[3.3, 7.7], [5.1, 9.9], [8.0, 8.0]]).repeat(3, 1).reshape(3, 3, 2) * torch.tensor(
        [1.0, 4.0, 16.0]
    ).view(-1, 1, 1)
    grid = apply_anchors(module, px)
    torch.testing.assert_close(grid, (px / torch.tensor([8.0, 16.0, 32.0]).view(-1, 1, 1)).half().float())
    assert torch.equal(module.model.anchors, grid)
    assert torch.equal(module.loss.anchors, grid)


def test_the_config_wires_noautoanchor_to_the_callback(tmp_path):
    from hydra.utils import instantiate

    from yolo5l.config import compose_config

    cfg = compose_config(["noautoanchor=true", "hyp.anchor_t=3.5", "seed=7"], output_dir=tmp_path / "run")
    cb = instantiate(cfg.callbacks.autoanchor)
    assert isinstance(cb, AutoAnchor)
    assert not cb.enabled
    assert cb.thr == 3.5
    assert cb.seed == 7
    names = list(cfg.callbacks)
    assert names[0] == "autoanchor"
    assert names.index("autoanchor") < names.index("ema")  # the anchors are set before the EMA copies the model
    assert instantiate(compose_config([], output_dir=tmp_path / "run2").callbacks.autoanchor).enabled
