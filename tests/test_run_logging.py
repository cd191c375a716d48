"""What a run's loggers record: the fit only (a `trainer.validate` or `trainer.test` of the same trainer adds no
metrics.csv / results.csv row, no TensorBoard point and no second event file), one TensorBoard series per tag (the
epoch means as `train/loss*`, the per-step values as `train/loss*_step`), and the first batches drawn at the start of
a new run only (a resumed run draws none)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.trainer.states import TrainerFn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from yolo5l.callbacks import BatchPlotter
from yolo5l.config import compose_config
from yolo5l.tracking.loggers import EpochCSVLogger, read_metrics_csv
from yolo5l.tracking.tensorboard import TensorBoardLogger

LOSSES = ("train/loss_box", "train/loss_obj", "train/loss_cls", "train/loss")
#: metrics.csv's columns for the smoke run (CORE_COLUMNS, then the others sorted).
METRICS_COLUMNS = [
    "epoch", "train/loss_box", "train/loss_obj", "train/loss_cls", "val/precision", "val/recall", "val/map_50",
    "val/map", "train/images_per_sec", "train/data_wait", "train/loss", "train/lr0", "train/lr1", "train/lr2",
    "val/fitness", "val/loss_box", "val/loss_cls", "val/loss_obj",
]  # fmt: skip


def _module(fn: TrainerFn) -> SimpleNamespace:
    """What the loggers read of the LightningModule Lightning passes to `log_graph` as a fit, validate or test
    starts: its trainer's `state.fn`."""
    return SimpleNamespace(trainer=SimpleNamespace(state=SimpleNamespace(fn=fn)))


def _events(folder: Path) -> EventAccumulator:
    """Every event of the folder's event files, as written (nothing purged when a step goes back)."""
    return EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0}, purge_orphaned_data=False).Reload()


def _steps(events: EventAccumulator, tag: str) -> list[int]:
    return [e.step for e in events.Scalars(tag)]


# ---- the loggers alone -----------------------------------------------------------------------------------------------
def test_metrics_of_a_validate_outside_fit_make_no_csv_row(tmp_path):
    lg = EpochCSVLogger(tmp_path, results_filename="results.csv")
    lg.log_graph(_module(TrainerFn.FITTING))
    for epoch in (0, 1):
        lg.log_metrics({"train/loss_box": 0.1, "val/map": 0.2, "epoch": epoch}, step=2 * epoch + 1)
    lg.finalize("success")
    tables = {name: (tmp_path / name).read_text() for name in ("metrics.csv", "results.csv")}
    lg.log_graph(_module(TrainerFn.VALIDATING))  # trainer.validate after the fit: Lightning says epoch 2
    lg.log_metrics({"val/map": 0.3, "epoch": 2}, step=4)
    lg.save()
    lg.finalize("success")
    assert {name: (tmp_path / name).read_text() for name in tables} == tables
    assert lg.history["val/map"] == [0.2, 0.2]
    lg.log_graph(_module(TrainerFn.FITTING))  # a fit of the same trainer records again
    lg.log_metrics({"train/loss_box": 0.1, "epoch": 2}, step=5)
    lg.save()
    assert [r["epoch"] for r in read_metrics_csv(tmp_path / "metrics.csv")] == ["0", "1", "2"]


def test_per_step_values_stay_out_of_the_csv_rows(tmp_path):
    lg = EpochCSVLogger(tmp_path)
    lg.log_metrics({"train/loss_box_step": 0.5, "epoch": 0}, step=0)
    lg.save()
    assert read_metrics_csv(tmp_path / "metrics.csv") == []  # no row before the epoch has a value of its own
    lg.log_metrics({"train/loss_box_step": 0.3, "epoch": 0}, step=1)
    lg.log_metrics({"train/loss_box": 0.4, "epoch": 0}, step=1)  # the epoch's mean
    lg.log_metrics({"train/loss_box_step": 0.2, "epoch": 1}, step=2)
    lg.finalize("success")
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["0"]
    assert float(rows[0]["train/loss_box"]) == 0.4
    assert not [k for k in rows[0] if k.endswith("_step")]
    assert lg.history["train/loss_box_step"] == [0.5, 0.3, 0.2]


def test_tensorboard_writes_no_scalar_outside_fit(tmp_path):
    lg = TensorBoardLogger(tmp_path, name="", version="", log_graph=False)
    lg.log_graph(_module(TrainerFn.FITTING))
    lg.log_metrics({"val/map": 0.2, "epoch": 1}, step=3)
    lg.finalize("success")  # the end of the fit closes the writer
    lg.log_graph(_module(TrainerFn.VALIDATING))
    lg.log_metrics({"val/map": 0.3, "epoch": 2}, step=4)
    lg.save()
    lg.finalize("success")
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # the writer was not opened again
    assert _steps(_events(tmp_path), "val/map") == [3]


class _Writer:
    """A TensorBoard writer that records what `add_image` gets."""

    def __init__(self):
        self.images = []

    def add_image(self, tag, image, step, dataformats="CHW"):
        self.images.append((tag, step))


def test_a_resumed_run_draws_no_batch(tmp_path, tiny_data):
    batch = next(iter(tiny_data(n=2, batch_size=2).train_dataloader()))
    for ckpt_path, out in ((None, tmp_path / "new"), ("last.ckpt", tmp_path / "resumed")):
        writer = _Writer()
        trainer = SimpleNamespace(ckpt_path=ckpt_path, loggers=[SimpleNamespace(experiment=writer)], global_step=10)
        plotter = BatchPlotter(num_batches=1, out_dir=str(out))
        for i in range(2):
            plotter.on_train_batch_start(trainer, SimpleNamespace(names=["a", "b"]), batch, i)
        drawn = (writer.images, sorted(p.name for p in out.glob("*.jpg")))
        assert drawn == (([("train/batch0", 10)], ["train_batch0.jpg"]) if ckpt_path is None else ([], [])), drawn


# ---- a run as a notebook makes it: fit, validate, then a resume to one more epoch ----------------------------------
#: The smoke experiment, 2 training batches and 1 validation batch an epoch, losses logged at every step.
TINY = [
    "experiment=smoke", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks.batch_plotter.num_batches=1",
    "logger.tensorboard.log_graph=false",
]  # fmt: skip


def _tables(run: Path) -> dict[str, str]:
    return {name: (run / name).read_text() for name in ("metrics.csv", "results.csv")}


def _folder(run: Path) -> dict[str, object]:
    """The run folder's tables (as text and as rows), event files, scalars ({tag: [(step, value)]}) and images
    ({tag: [step]}) as they are now."""
    events = _events(run)
    return {
        "tables": _tables(run),
        "rows": read_metrics_csv(run / "metrics.csv"),
        "event_files": sorted(run.glob("events.out.tfevents.*")),
        "scalars": {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]},
        "images": {t: [e.step for e in events.Images(t)] for t in events.Tags()["images"]},
    }


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """Fit 2 epochs (with the plots: ValidationPlots writes TensorBoard images), validate with the same trainer, then
    resume the run to 3 epochs; what the run folder held after each."""
    import torch

    from yolo5l.train import build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("run_logging")
    run = tmp / "run"
    seen = {}
    try:
        for stage, epochs in (("fit", 2), ("resume", 3)):
            overrides = [*TINY, f"data.synthetic.root={tmp / 'syn'}", f"trainer.max_epochs={epochs}"]
            datamodule, module, trainer = build(compose_config(overrides, output_dir=run))
            ckpt = str(run / "checkpoints" / "last.ckpt") if stage == "resume" else None
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
            seen[stage] = _folder(run)
            if stage == "fit":
                seen["returned"] = trainer.validate(module, datamodule=datamodule, verbose=False)
                seen["validate"] = _folder(run)
    finally:
        torch.set_num_threads(threads)
    return seen


@pytest.mark.heavy  # three runs of a scenario: CI runs it (make test-ci)
def test_a_validate_after_fit_adds_no_epoch_and_no_event_file(scenario):
    seen = scenario
    assert {"val/map", "val/map_50", "val/fitness"} <= set(seen["returned"][0])  # the call returns its metrics
    after = seen["validate"]
    assert after["tables"] == seen["fit"]["tables"]
    assert [r["epoch"] for r in after["rows"]] == ["0", "1"]
    results = after["tables"]["results.csv"].splitlines()
    assert [float(line.split(",")[0]) for line in results[1:]] == [0, 1]  # one row per trained epoch
    assert len(seen["fit"]["event_files"]) == 1
    assert after["event_files"] == seen["fit"]["event_files"]
    assert after["scalars"] == seen["fit"]["scalars"]  # no point after the fit's last
    assert after["images"] == seen["fit"]["images"]


@pytest.mark.heavy
def test_each_tensorboard_tag_is_one_series(scenario):
    seen = scenario
    scalars, rows = seen["fit"]["scalars"], seen["fit"]["rows"]
    for tag, points in scalars.items():
        steps = [step for step, _ in points]
        if tag != "epoch":  # Lightning's own: the epoch number, with every call that logs
            assert steps == sorted(set(steps)), (tag, steps)  # one value a step
    for tag in LOSSES:
        # each epoch's end: the epoch's mean, as in metrics.csv (and results.csv)
        assert [step for step, _ in scalars[tag]] == [1, 3]
        assert [value for _, value in scalars[tag]] == pytest.approx([float(r[tag]) for r in rows], rel=1e-5)
        assert [step for step, _ in scalars[f"{tag}_step"]] == [0, 1, 2, 3]  # every step (log_every_n_steps=1)
    assert list(rows[0]) == METRICS_COLUMNS  # metrics.csv keeps its columns: no per-step one


@pytest.mark.heavy
def test_a_resumed_run_draws_the_first_batches_no_more(scenario):
    seen = scenario
    resumed = seen["resume"]
    assert [r["epoch"] for r in resumed["rows"]] == ["0", "1", "2"]
    assert resumed["images"]["train/batch0"] == [0]  # the new run's start only
    assert len(resumed["event_files"]) == 2  # the fit's, and the resumed run's own writer's
    for tag in (*LOSSES, "val/map"):
        steps = [step for step, _ in resumed["scalars"][tag]]
        assert steps == [1, 3, 5], (tag, steps)  # the resumed run goes on after the fit's steps
