"""What a user watches: losses on the bar read at refresh only, a line per validation, epoch means in every CSV row,
throughput of the training batches alone, and a data-wait hint given once."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from _clock import FakeClock, SlowItems
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from yolo5l.callbacks import ThroughputMonitor, ValidationSummary, YOLOProgressBar
from yolo5l.callbacks.throughput import _advice
from yolo5l.config import compose_config
from yolo5l.tracking.loggers import read_metrics_csv
from yolo5l.train import build


@pytest.fixture(scope="module")
def smoke_fit(tmp_path_factory):
    """The real composition (`build`) on the smoke experiment: 3 epochs of 4 batches, logging every 50 steps (at
    64 px, without the plots and the TensorBoard graph, which nothing here reads)."""
    tmp = tmp_path_factory.mktemp("console")
    cfg = compose_config(
        ["experiment=smoke", f"data.synthetic.root={tmp / 'synthetic'}", "data.imgsz=64", "trainer.max_epochs=3",
         "trainer.log_every_n_steps=50", "callbacks.progress_bar.refresh_rate=3", "callbacks.progress_bar.style=bar",
         "~callbacks.batch_plotter", "plots=false", "logger.tensorboard.log_graph=false"],
        output_dir=tmp / "run",
    )  # fmt: skip
    datamodule, module, trainer = build(cfg)
    calls = []
    running = module.running_losses
    module.running_losses = lambda: calls.append(trainer.global_step) or running()
    trainer.fit(module, datamodule=datamodule)
    return {"tmp": tmp, "trainer": trainer, "calls": calls}


def test_every_csv_row_has_the_epochs_mean_losses(smoke_fit):
    rows = read_metrics_csv(smoke_fit["tmp"] / "run" / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]  # no row holds a 50-step boundary
    for row in rows:
        for key in ("train/loss_box", "train/loss_obj", "train/loss_cls", "train/loss"):
            assert float(row[key]) > 0, (key, row)


def test_the_bar_reads_the_losses_at_refresh_only(smoke_fit):
    trainer = smoke_fit["trainer"]
    bar = next(cb for cb in trainer.callbacks if isinstance(cb, YOLOProgressBar))
    assert bar.refresh_rate == 3
    # 4 batches an epoch, redrawn after batch 3 and 4 and once after validation, and read once for the epoch line:
    # never once per step.
    assert 0 < len(smoke_fit["calls"]) <= 4 * 3
    assert len(smoke_fit["calls"]) < trainer.global_step * 3  # 12 steps


def test_validation_summary_keeps_the_best_and_last_rows(smoke_fit):
    summary = next(cb for cb in smoke_fit["trainer"].callbacks if isinstance(cb, ValidationSummary))
    assert summary.last["epoch"] == 2
    assert summary.best["val/fitness"] >= summary.last["val/fitness"]
    assert {"val/precision", "val/recall", "val/map_50", "val/map"} <= set(summary.last)


class _Timed(BoringModel):
    """BoringModel whose training steps take `step_s` and whose data loads take `train_s` / `val_s` per item."""

    def __init__(self, clock: FakeClock, step_s: float = 0.0, train_s: float = 0.0, val_s: float = 0.0) -> None:
        super().__init__()
        self.clock, self.step_s, self.train_s, self.val_s = clock, step_s, train_s, val_s

    def training_step(self, batch, batch_idx):
        self.clock.advance(self.step_s)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(SlowItems(self.clock, self.train_s, 64), batch_size=2)

    def val_dataloader(self):
        return DataLoader(SlowItems(self.clock, self.val_s, 4), batch_size=2)


def _fit(tmp_path, model, callbacks, epochs=1, **kw):
    from lightning.pytorch import Trainer

    trainer = Trainer(
        max_epochs=epochs, limit_train_batches=16, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, accelerator="cpu", **kw,
    )  # fmt: skip
    trainer.fit(model)
    return trainer


def test_throughput_counts_the_training_batches_only(tmp_path):
    clock = FakeClock()
    mon = ThroughputMonitor(verbose=False, clock=clock)
    _fit(tmp_path, _Timed(clock, step_s=0.05, val_s=0.25), [mon])  # 0.8 s of steps, 1 s of validation
    assert clock.now == pytest.approx(16 * 0.05 + 2 * 4 * 0.25)  # the sanity check's and the epoch's validation
    assert mon.last["images_per_sec"] == pytest.approx(16 * 2 / (16 * 0.05))  # validation is not in the denominator
    assert mon.last["data_wait"] == 0.0


def test_throughput_counts_the_images_of_every_rank():
    """Under DDP images/s is the whole job's: every rank trains an equal shard in step with the others, so this rank's
    images x the world size over its own time, with no collective; one process's figure is unchanged."""
    rates = {}
    for world in (1, 2):
        clock = FakeClock()
        mon = ThroughputMonitor(verbose=False, clock=clock)
        logged = {}
        module = SimpleNamespace(device=torch.device("cpu"), log=lambda key, value, **_: logged.update({key: value}))
        trainer = SimpleNamespace(world_size=world, current_epoch=0, num_training_batches=4, datamodule=None)
        mon.on_train_start(trainer, module)
        mon.on_train_epoch_start(trainer, module)
        for i in range(4):  # 4 batches of 8 images (this rank's), 0.5 s each
            mon.on_train_batch_start(trainer, module, (torch.zeros(8, 3, 4, 4), None), i)
            clock.advance(0.5)
            mon.on_train_batch_end(trainer, module, None, None, i)
        mon.on_train_epoch_end(trainer, module)
        assert logged["train/images_per_sec"] == mon.last["images_per_sec"]  # what metrics.csv and the sweep read
        rates[world] = mon.last["images_per_sec"]
    assert rates == {1: pytest.approx(32 / 2.0), 2: pytest.approx(2 * 32 / 2.0)}


def test_the_data_wait_hint_is_given_once(tmp_path):
    clock = FakeClock()
    mon = ThroughputMonitor(warn_above=0.10, verbose=False, clock=clock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, _Timed(clock, step_s=0.01, train_s=0.01), [mon], epochs=3, limit_val_batches=0)
    hints = [w for w in caught if "waited for data" in str(w.message)]
    assert mon.last["data_wait"] > 0.3  # 0.02 s of data for each 0.01 s step, less the batch fetched ahead
    assert len(hints) == 1  # the share stays the same: no repeat


def test_the_hint_leaves_out_what_the_data_already_does(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    fed = SimpleNamespace(train_workers=lambda: 2, cache="ram", persistent_workers=True)
    assert "already on" in _advice(fed)
    half = SimpleNamespace(train_workers=lambda: 0, cache="ram", persistent_workers=False)
    text = _advice(half)
    assert "num_workers" in text
    assert "data.cache" not in text


def test_the_hint_on_the_cpu_does_not_suggest_workers():
    """On the CPU, `data.num_workers=auto` is 0 by design (the start-up block says so): the hint suggests the cache,
    never workers or persistent workers; with the cache on it says what the time is."""
    cpu = torch.device("cpu")
    auto = SimpleNamespace(train_workers=lambda: 0, num_workers="auto", cache="none", persistent_workers=True,
                           train_device=lambda: cpu)  # fmt: skip
    text = _advice(auto)
    assert "num_workers" not in text
    assert "persistent" not in text
    assert "data.cache=ram" in text
    auto.cache = "ram"
    assert "cache is on" in _advice(auto)
    typed = SimpleNamespace(train_workers=lambda: 0, num_workers=0, cache="ram", persistent_workers=True,
                            train_device=lambda: cpu)  # fmt: skip
    assert "num_workers" in _advice(typed)  # a count typed on the command line may be raised
    gpu = SimpleNamespace(train_workers=lambda: 8, num_workers="auto", cache="ram", persistent_workers=True,
                          train_device=lambda: torch.device("cuda"), input_pipeline="host")  # fmt: skip
    assert "data.pipeline=device" in _advice(gpu)


def test_the_hint_suggests_workers_only_where_cores_are_free(monkeypatch):
    """2 CPU ranks on 2 cores leave no core for a worker (each rank computes on one); the device pipeline on the CPU
    gets the host path suggested, not a cache."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cpu = torch.device("cpu")

    def data(world: int, workers: int = 0, pipeline: str = "host") -> SimpleNamespace:
        return SimpleNamespace(train_workers=lambda: workers, num_workers=workers, cache="ram", persistent_workers=True,
                               train_device=lambda: cpu, input_pipeline=pipeline,
                               trainer=SimpleNamespace(world_size=world))  # fmt: skip

    assert "num_workers" in _advice(data(1))  # one core computes, one is free
    assert "num_workers" not in _advice(data(2))
    assert "num_workers" not in _advice(data(1, workers=1))
    text = _advice(data(1, pipeline="device"))
    assert text.startswith("Try: make the images on the host with data.pipeline=auto (the device path is for CUDA)")


def test_config_of_the_console_callbacks(tmp_path):
    cfg = compose_config(output_dir=tmp_path)
    assert cfg.callbacks.progress_bar._target_ == "yolo5l.callbacks.progress_bar.console_progress"
    assert "val_summary" in cfg.callbacks
    # Lightning refuses a progress-bar callback with the bar off: build() leaves it out then.
    cfg = compose_config(["experiment=smoke", "trainer.enable_progress_bar=false",
                          f"data.synthetic.root={tmp_path / 's'}"], output_dir=tmp_path / "r")  # fmt: skip
    _, _, trainer = build(cfg)
    assert not any(isinstance(cb, YOLOProgressBar) for cb in trainer.callbacks)
