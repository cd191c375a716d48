from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from _clock import FakeClock, SlowItems
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

from yolo5l.callbacks import AtomicCheckpointIO, EMACallback, LastCheckpoint, ThroughputMonitor, ValEveryNEpochs
from yolo5l.eval.metrics import DetectionMAP
from yolo5l.models.weights import load_checkpoint


class _Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


def _perturb(net, k):
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
        net.scale.mul_(1.5)
        net.count.fill_(k)


def test_ema_matches_averaged_model_at_fixed_decay():
    net = _Net()
    cb = EMACallback(decay=0.9, tau=1e-12)  # the ramp is already at `decay` after one update
    cb._build(net)
    ref = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ref.update_parameters(net)  # first call copies
    for k in range(1, 6):
        _perturb(net, k)
        cb.on_train_batch_end(SimpleNamespace(global_step=k), net, None, None, k)
        ref.update_parameters(net)
    ema = cb.ema_state_dict
    for name, v in ref.module.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(ema[name], v, rtol=1e-6, atol=1e-6)
    assert int(ema["count"]) == 5  # integer buffers are copied
    assert cb.updates == 5


def test_ema_skips_micro_batches_without_a_step():
    net = _Net()
    cb = EMACallback(decay=0.9, tau=1e-12)
    cb._build(net)
    before = {k: v.clone() for k, v in cb.ema_state_dict.items()}
    _perturb(net, 1)
    cb.on_train_batch_end(SimpleNamespace(global_step=-1), net, None, None, 0)
    assert cb.updates == 0
    torch.testing.assert_close(cb.ema_state_dict, before)


def test_ema_decay_ramp_values():
    cb = EMACallback()  # 0.9999, tau 2000
    assert cb.decay_at(100) == pytest.approx(0.9999 * (1 - 2.718281828459045**-0.05))
    assert cb.decay_at(100) == pytest.approx(0.0488, abs=1e-4)
    assert cb.decay_at(1000) == pytest.approx(0.3934, abs=1e-4)
    assert cb.decay_at(2000) == pytest.approx(0.6321, abs=1e-4)
    assert cb.state_dict() == {"updates": 0}


def test_ema_swap_in_and_out():
    net = _Net()
    cb = EMACallback(decay=0.5, tau=1e-12)
    cb._build(net)
    _perturb(net, 1)
    cb.on_train_batch_end(SimpleNamespace(global_step=1), net, None, None, 0)
    raw = {k: v.clone() for k, v in net.state_dict().items()}
    ema = {k: v.clone() for k, v in cb.ema_state_dict.items()}
    assert not torch.equal(raw["a.weight"], ema["a.weight"])
    cb.on_validation_epoch_start(None, net)
    torch.testing.assert_close(net.state_dict(), ema)
    cb.on_validation_epoch_end(None, net)
    torch.testing.assert_close(net.state_dict(), raw)
    cb.on_train_end(None, net)
    torch.testing.assert_close(net.state_dict(), ema)


class _StopAfter(pl.Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


@pytest.fixture
def fit_ema(tiny_module, tiny_data, make_trainer):
    """`fit_ema(tmp_path, max_epochs, stop_after=None, ckpt_path=None)`: the tiny module trained with an EMA and
    last.ckpt in `tmp_path/ck`, atomically written; returns (trainer, module, EMACallback)."""

    def fit(tmp_path, max_epochs, stop_after=None, ckpt_path=None, ckpt_dir="ck"):
        module = tiny_module()
        ema = EMACallback(decay=0.9999, tau=3)
        cbs = [ema, LastCheckpoint(dirpath=tmp_path / ckpt_dir)]
        if stop_after is not None:
            cbs.append(_StopAfter(stop_after))
        tr = make_trainer(tmp_path, cbs, max_epochs=max_epochs, plugins=[AtomicCheckpointIO()])
        tr.fit(module, tiny_data(), ckpt_path=ckpt_path)
        return tr, module, ema

    return fit


@pytest.mark.usefixtures("one_thread")
def test_last_checkpoint_each_epoch_and_resume_equivalence(tmp_path, fit_ema):
    # uninterrupted: 3 epochs
    tr_a, mod_a, ema_a = fit_ema(tmp_path / "a", 3)
    # interrupted after epoch 0, then resumed from last.ckpt to the same 3 epochs
    tr_b, _, _ = fit_ema(tmp_path / "b", 3, stop_after=0)
    last = tmp_path / "b" / "ck" / "last.ckpt"
    assert last.exists()
    assert tr_b.current_epoch == 1
    ck = torch.load(last, weights_only=True)
    assert ck["epoch"] == 0
    assert "current_model_state" in ck
    assert ck["callbacks"][next(k for k in ck["callbacks"] if "EMACallback" in k)] == {"updates": 2}
    assert not any(p.name.endswith(".tmp") for p in last.parent.iterdir())
    tr_c, mod_c, ema_c = fit_ema(tmp_path / "b", 3, ckpt_path=last)
    assert tr_c.current_epoch == 3
    assert tr_c.global_step == tr_a.global_step == 6
    assert ema_c.updates == ema_a.updates == 6
    # training ended: the models hold the EMA weights, which must agree exactly, and so must the raw weights
    for (k, va), vc in zip(mod_a.state_dict().items(), mod_c.state_dict().values(), strict=True):
        torch.testing.assert_close(va, vc, rtol=0, atol=0, msg=k)
    raw_a = torch.load(tmp_path / "a" / "ck" / "last.ckpt", weights_only=True)["current_model_state"]
    raw_c = torch.load(last, weights_only=True)["current_model_state"]
    for k in raw_a:
        torch.testing.assert_close(raw_a[k], raw_c[k], rtol=0, atol=0, msg=k)


@pytest.mark.usefixtures("one_thread")
def test_stripped_weights_small_and_loadable(tmp_path, fit_ema):
    fit_ema(tmp_path, 1)
    w, last = tmp_path / "ck" / "weights.pt", tmp_path / "ck" / "last.ckpt"
    assert w.exists()
    assert w.stat().st_size < last.stat().st_size / 3
    ck = torch.load(w, weights_only=True)
    assert set(ck) == {"model_config", "state_dict", "names", "imgsz", "data"}
    assert ck["names"] == ["a", "b"]
    assert ck["state_dict"]["model.0.conv.weight"].dtype == torch.float16
    model, _ = load_checkpoint(w)
    assert model.num_classes == 2


class _ScriptedFitness(DetectionMAP):
    """YOLOv5's metric with `fitness` replaced by the next value of a script, so the test decides which epochs
    improve (the tiny module's real fitness is 0 on every epoch)."""

    def __init__(self, values):
        super().__init__()
        self.values = list(values)

    def compute(self):
        return {**super().compute(), "fitness": torch.tensor(self.values.pop(0))}


class _WatchBest(pl.Callback):
    """Per epoch: `LastCheckpoint.best_fitness` as the epoch starts, the logged `val/fitness`, and best.ckpt's
    digest, inode and mtime once the epoch (validation included) has ended."""

    def __init__(self, checkpoint, best):
        self.checkpoint, self.best = checkpoint, best
        self.best_at_start, self.fitness, self.best_file = {}, {}, {}

    def on_train_epoch_start(self, trainer, pl_module):
        self.best_at_start[trainer.current_epoch] = self.checkpoint.best_fitness

    def on_train_epoch_end(self, trainer, pl_module):
        epoch, st = trainer.current_epoch, self.best.stat()
        self.fitness[epoch] = float(trainer.callback_metrics["val/fitness"])
        self.best_file[epoch] = (hashlib.sha256(self.best.read_bytes()).hexdigest(), st.st_ino, st.st_mtime_ns)


def _best_record(path):
    """A checkpoint's epoch and the module's best-fitness record in it."""
    ckpt = torch.load(path, weights_only=True)
    return ckpt["epoch"], ckpt["yolo5l_best"]


@pytest.mark.usefixtures("one_thread")
def test_best_checkpoint_and_best_fitness_across_a_resume(tmp_path, tiny_module, tiny_data, make_trainer):
    ck = tmp_path / "ck"
    best, last = ck / "best.ckpt", ck / "last.ckpt"

    def fit(max_epochs, fitness, ckpt_path=None):
        module = tiny_module()
        module.map_metric = _ScriptedFitness(fitness)
        checkpoint = LastCheckpoint(save_best=True, dirpath=ck)
        watch = _WatchBest(checkpoint, best)
        tr = make_trainer(tmp_path, [checkpoint, watch], max_epochs=max_epochs, plugins=[AtomicCheckpointIO()])
        tr.fit(module, tiny_data(), ckpt_path=ckpt_path)
        return checkpoint, watch

    # first run, 2 epochs: epoch 1 improves on epoch 0, so best.ckpt is written again
    first, w1 = fit(2, [0.3, 0.5])
    assert w1.fitness == {0: pytest.approx(0.3), 1: pytest.approx(0.5)}
    assert w1.best_at_start == {0: None, 1: pytest.approx(0.3)}
    assert w1.best_file[1] != w1.best_file[0]
    top = max(w1.fitness.values())
    assert first.best_fitness == pytest.approx(top)
    epoch, state = _best_record(best)
    assert (epoch, state["fitness"]) == (1, pytest.approx(top))
    epoch, state = _best_record(last)
    assert (epoch, state["fitness"]) == (1, pytest.approx(top))  # what a resume restores

    # resumed from last.ckpt to 3 epochs with a new callback; epoch 2 scores below the best
    second, w2 = fit(3, [0.4], ckpt_path=last)
    assert w2.best_at_start == {2: pytest.approx(top)}  # restored from last.ckpt before the new epoch
    assert w2.fitness == {2: pytest.approx(0.4)}
    assert w2.best_file[2] == w1.best_file[1]  # no improvement: best.ckpt is the first run's epoch 1, untouched
    assert second.best_fitness == pytest.approx(top)
    epoch, state = _best_record(best)
    assert (epoch, state["fitness"]) == (1, pytest.approx(top))
    epoch, state = _best_record(last)
    assert (epoch, state["fitness"]) == (2, pytest.approx(top))


class _Boom:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_atomic_checkpoint_io_keeps_old_file_on_failure(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"epoch": 2, "w": torch.zeros(3), "boom": _Boom()}, path)
    assert torch.load(path, weights_only=True)["epoch"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]


class _ValRecorder(pl.Callback):
    def __init__(self):
        self.epochs = []

    def on_validation_epoch_start(self, trainer, pl_module):
        self.epochs.append(trainer.current_epoch)


def _boring_trainer(tmp_path, cbs, max_epochs):
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        callbacks=cbs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        limit_train_batches=2,
        limit_val_batches=1,
        enable_checkpointing=False,
    )


def test_val_every_n_epochs(tmp_path):
    cb = ValEveryNEpochs(2)
    assert [cb.should_validate(e, 5) for e in range(5)] == [False, True, False, True, True]
    rec = _ValRecorder()
    _boring_trainer(tmp_path, [cb, rec], 5).fit(BoringModel())
    assert rec.epochs == [1, 3, 4]
    with pytest.raises(ValueError, match="positive"):
        ValEveryNEpochs(0)


def test_throughput_monitor_warns_on_slow_data(tmp_path):
    clock = FakeClock()

    class Model(BoringModel):
        def train_dataloader(self):
            return DataLoader(SlowItems(clock, 0.03, 16), batch_size=2)  # 0.06 s of data a batch, steps take none

    mon = ThroughputMonitor(warn_above=0.10, verbose=False, clock=clock)
    with pytest.warns(UserWarning, match="num_workers"):
        _boring_trainer(tmp_path, [mon], 1).fit(Model())
    assert mon.last["data_wait"] > 0.5
    assert mon.last["images_per_sec"] > 0


@pytest.mark.usefixtures("one_thread")
def test_batch_plotter_writes_the_first_batches_as_jpeg_with_their_boxes(
    tmp_path, tiny_module, tiny_data, make_trainer
):
    import cv2
    import numpy as np
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from yolo5l.callbacks import BatchPlotter
    from yolo5l.infer.annotate import BOX_COLOR, draw_batch

    logger = TensorBoardLogger(tmp_path, name="", version="")
    tr = make_trainer(tmp_path, [BatchPlotter(num_batches=2)], max_epochs=1, logger=logger, limit_val_batches=0)
    tr.fit(tiny_module(), tiny_data())
    logger.experiment.flush()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    assert sorted(acc.Tags()["images"]) == ["train/batch0", "train/batch1"]
    (event,) = acc.Images("train/batch0")
    assert event.encoded_image_string[:2] == b"\xff\xd8"  # JPEG
    img = cv2.imdecode(np.frombuffer(event.encoded_image_string, np.uint8), cv2.IMREAD_COLOR_RGB)
    assert img.shape == (event.height, event.width, 3) == (64, 4 * 64, 3)  # 4 images of 64 px in a row
    # TinyData's images are grey: saturated yellow can only be the drawn box outlines (and class names)
    r, g, b = (img[..., k].astype(int) for k in range(3))
    assert ((r > 180) & (g > 180) & (b < 120)).sum() > 100
    # the drawing itself: boxes change only yellow pixels of the bare mosaic
    images, targets, *_ = next(iter(tiny_data().train_dataloader()))
    drawn, bare = draw_batch(images, targets), draw_batch(images, targets[:0])
    changed = np.any(drawn != bare, axis=-1)
    assert changed.sum() > 50
    assert (drawn[changed] == BOX_COLOR).all(-1).mean() > 0.5  # outlines exact; anti-aliased text blends


@pytest.mark.usefixtures("one_thread")
def test_every_n_epochs_still_writes_last_ckpt_at_the_end(tmp_path, tiny_module, tiny_data, make_trainer):
    """every_n_epochs=2 over 3 epochs: last.ckpt after epoch 1 and again at the end (epoch 2), the run's resume
    point; at epoch 0 none."""
    ck = tmp_path / "ck"
    seen = []

    class Watch(pl.Callback):  # reads last.ckpt after each epoch's checkpointing (checkpoint callbacks run last)
        def read(self):
            last = ck / "last.ckpt"
            seen.append(torch.load(last, weights_only=True)["epoch"] if last.exists() else None)

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch:
                self.read()

        def on_fit_end(self, trainer, pl_module):
            self.read()

    checkpoint = LastCheckpoint(every_n_epochs=2, dirpath=ck)
    trainer = make_trainer(tmp_path, [checkpoint, Watch()], max_epochs=3, plugins=[AtomicCheckpointIO()])
    trainer.fit(tiny_module(), tiny_data())
    assert seen == [None, 1, 2]
