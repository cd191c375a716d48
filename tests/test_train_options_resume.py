"""Resume stays exact with v7.0's data options, and `callbacks.checkpoint.save_period` (v7.0 `--save-period`).

The runs are in-process fits of a `YOLODataModule` and a recording module that, like `YOLOv5Module`, publishes the
per-class mAPs of each validation (`class_maps`). A run preempted inside an epoch (SIGUSR1 from `SignalAt`, as in
tests/test_preemption.py) and resumed must see the very batches the uninterrupted run saw: the same images drawn by
weight, the same multi-scale sizes, the same quad groups, the same rectangular order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from test_preemption import SignalAt

from yolo5l.callbacks.checkpoint import LastCheckpoint
from yolo5l.callbacks.preemption import Preempted, PreemptionCheckpoint
from yolo5l.data.datamodule import YOLODataModule
from yolo5l.resume import read_resume_state

IMGSZ = 64


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn") / "synthetic"
    return {"root": str(root), "num_train": 16, "num_val": 4, "seed": 0, "min_side": 60, "max_side": 120}


class Recorder(LightningModule):
    """Records every training batch as it reaches the step; its validations give made-up per-class mAPs."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0]))
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[tuple[int, int], tuple] = {}
        self.class_maps: np.ndarray | None = None

    def training_step(self, batch, batch_idx):
        images, targets, paths, _ = batch
        self.seen[(self.current_epoch, batch_idx)] = (images.clone(), targets.clone(), tuple(paths))
        return (self.w * images.mean()).sum()

    def validation_step(self, batch, batch_idx):
        return None

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:  # a different map per class and epoch, as validations give
            nc = self.trainer.datamodule.num_classes
            self.class_maps = np.random.default_rng(self.current_epoch).random(nc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(synthetic, folder: Path, options: dict, signal_at: tuple[int, int] | None = None, resume: Path | None = None):
    dm = YOLODataModule(synthetic=synthetic, imgsz=IMGSZ, batch_size=4, num_workers=0, cache="none", seed=3, **options)
    module = Recorder()
    callbacks = [LastCheckpoint(dirpath=folder, weights_name=None), PreemptionCheckpoint()]
    if signal_at is not None:
        callbacks.append(SignalAt(*signal_at, "SIGUSR1"))
    trainer = Trainer(
        max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=folder,
        callbacks=callbacks, limit_val_batches=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm, ckpt_path=str(resume) if resume else None, weights_only=False)
    return module.seen


@pytest.mark.parametrize(
    "options",
    [
        {"image_weights": True, "multi_scale": True, "quad": True, "single_cls": True},
        {"image_weights": True, "hyp": {"mosaic": 1.0, "mixup": 0.5}},
        {"rect": True, "multi_scale": True},
    ],
    ids=["weights-scale-quad", "weights-mixup", "rect-scale"],
)
def test_preempted_mid_epoch_and_resumed_sees_the_same_batches(tmp_path, synthetic, options, one_thread):
    straight = _fit(synthetic, tmp_path / "straight", options)
    assert len(straight) == 12  # 3 epochs of 4 batches
    if options.get("multi_scale"):
        assert len({tuple(s[0].shape[2:]) for s in straight.values()}) > 1
    if options.get("quad"):
        assert all(s[0].shape[0] == 1 for s in straight.values())  # 4 images per batch -> one quad image

    folder = tmp_path / "stopped"
    with pytest.raises(Preempted):
        _fit(synthetic, folder, options, signal_at=(1, 1))
    state = read_resume_state(folder / "last.ckpt")
    assert (state.epochs_done, state.batches_done) == (1, 2)
    saved = torch.load(folder / "last.ckpt", weights_only=True)["YOLODataModule"]
    if options.get("image_weights"):  # the maps of validation 0, which epoch 1 draws with (no validation since)
        nc = 1 if options.get("single_cls") else 4
        assert saved["image_weights_maps"] == pytest.approx(np.random.default_rng(0).random(nc).tolist())
    resumed = _fit(synthetic, folder, options, resume=folder / "last.ckpt")
    assert sorted(resumed) == [(1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    for key, (images, targets, paths) in resumed.items():
        want = straight[key]
        assert paths == want[2], key
        assert torch.equal(images, want[0]), key
        assert torch.equal(targets, want[1]), key


def test_save_period_keeps_resumable_epoch_checkpoints(tmp_path, tiny_module, tiny_data, make_trainer, one_thread):
    """v7.0: `epoch{N}.pt` after epoch N (0-based) whenever N % save_period == 0; here each is a whole training
    checkpoint like last.ckpt (which `resume=` and `weights=` take), written atomically. Off by default."""
    folder = tmp_path / "ck"
    fast = {"max_epochs": 2, "limit_val_batches": 0}
    trainer = make_trainer(tmp_path, [LastCheckpoint(dirpath=folder, save_period=2)], **fast)
    trainer.fit(tiny_module(), tiny_data(n=4, batch_size=2))
    assert sorted(p.name for p in folder.iterdir()) == ["epoch0.ckpt", "last.ckpt", "weights.pt"]  # not epoch1
    first = torch.load(folder / "epoch0.ckpt", weights_only=True)
    last = torch.load(folder / "last.ckpt", weights_only=True)
    assert first.keys() == last.keys()
    assert (first["epoch"], first["global_step"]) == (0, 2)
    assert read_resume_state(folder / "epoch0.ckpt").epochs_done == 1
    # resuming from epoch 0 replays epoch 1 of the run
    resumed = make_trainer(tmp_path, [LastCheckpoint(dirpath=tmp_path / "again")], **fast)
    resumed.fit(tiny_module(), tiny_data(n=4, batch_size=2), ckpt_path=str(folder / "epoch0.ckpt"))
    assert not list((tmp_path / "again").glob("epoch*"))
    final = torch.load(tmp_path / "again" / "last.ckpt", weights_only=True)
    assert final["global_step"] == last["global_step"] == 4
    for k, v in last["state_dict"].items():
        assert torch.equal(final["state_dict"][k], v), k
