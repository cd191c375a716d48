"""A run that diverges stops with one line and exit status 65, and leaves no file with non-finite tensors
(`yolo5l.training.divergence`, `YOLOv5Module`'s checks), and `resume=` takes the lower `hyp.lr0` the line suggests.

The end-to-end runs are the issue's: `hyp.lr0=10000 hyp.warmup_epochs=0` on yolov5n, made small (64 px, the smoke
dataset's 32 images). At that size the epoch-0 validation is already NaN; with validation off, the loss stays finite
but grows by four orders of magnitude in epoch 1, which the exploding-loss rule catches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from yolo5l.base.errors import EXIT_DIVERGED, shown_path
from yolo5l.training.divergence import MIN_GROWTH_BATCHES, LossGrowth, TrainingDiverged, diverged, state_problem

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
LR0 = ("hyp.lr0=10000", "hyp.warmup_epochs=0")
SMALL = ("experiment=smoke", "data.imgsz=64", "logger=csv", "~callbacks.batch_plotter", "plots=false")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    from yolo5l.data.synthetic import ensure_synthetic

    root = tmp_path_factory.mktemp("synthetic")
    ensure_synthetic(root=root, num_train=32, num_val=16, seed=0)
    return root


def _train(run: Path, synthetic: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "yolo5l.train", f"hydra.run.dir={run}", f"data.synthetic.root={synthetic}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)


def _non_finite_tensors(obj: Any, where: str = "") -> list[str]:
    """Every floating tensor with a NaN or inf in a loaded file, by path; Lightning's ModelCheckpoint and
    EarlyStopping keep +-inf as their "nothing yet" score (a 0-dim `kth_value`, `best_score`): those are skipped."""
    if isinstance(obj, torch.Tensor):
        sentinel = obj.dim() == 0 and where.rsplit("/", 1)[-1] in ("kth_value", "best_score", "best_model_score")
        bad = obj.is_floating_point() and not bool(torch.isfinite(obj).all()) and not sentinel
        return [where] if bad else []
    if isinstance(obj, dict):
        return [w for k, v in obj.items() for w in _non_finite_tensors(v, f"{where}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [w for i, v in enumerate(obj) for w in _non_finite_tensors(v, f"{where}[{i}]")]
    return []


def _files_with_non_finite_tensors(run: Path) -> dict[str, list[str]]:
    found = {}
    for path in run.rglob("*"):
        if path.is_file() and path.suffix in (".pt", ".ckpt", ".pth", ".tmp"):
            bad = _non_finite_tensors(torch.load(path, map_location="cpu", weights_only=False))
            if bad:
                found[str(path)] = bad[:3]
    return found


# ---- end to end: the lr0 run -------------------------------------------------------------------------------
def test_lr0_run_stops_at_the_first_non_finite_validation(tmp_path, synthetic):
    """Validation after epoch 0 is NaN: the run stops there, before best.pt and last.ckpt, with the line, status 65
    and nothing in the run folder holding NaN or inf (in the issue's run, best.pt did: BatchNorm variances beyond
    fp16's range became inf in the half-precision weights file)."""
    run = tmp_path / "run"
    r = _train(run, synthetic, *SMALL, *LR0, "trainer.max_epochs=2", "trainer.limit_train_batches=2")
    assert r.returncode == EXIT_DIVERGED, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "training diverged at epoch 0: the validation loss and predictions hold NaN or inf; likely cause: the "
        "learning rate (hyp.lr0=10000) is too high; no checkpoint was written before it: start the run again with "
        "hyp.lr0=1000"
    )
    assert not (run / "checkpoints").exists()
    assert not _files_with_non_finite_tensors(run)


@pytest.mark.heavy  # a run until it diverges: CI runs it (make test-ci), `make test` stays light
def test_exploding_loss_stops_the_lr0_run(tmp_path, synthetic):
    """Validation off: the loss stays finite but its epoch-1 mean is thousands of times epoch 0's. The rule stops the
    run at the end of epoch 1 (before its last.ckpt), naming epoch 0's last.ckpt and the resume= command, which is
    accepted with its lower hyp.lr0 (epoch 0 of a rate of 10000 is beyond repair, though: it diverges again). No
    file ever holds NaN or inf."""
    run = tmp_path / "run"
    r = _train(run, synthetic, *SMALL, *LR0, "trainer.max_epochs=2", "trainer.limit_val_batches=0")
    last = run / "checkpoints" / "last.ckpt"
    assert r.returncode == EXIT_DIVERGED, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("training diverged at epoch 1: the training loss exploded: its mean over the epoch so far")
    assert "(module.max_loss_growth); likely cause: the learning rate (hyp.lr0=10000) is too high" in line
    assert line.endswith(f"python -m yolo5l.train resume={shown_path(last)} hyp.lr0=1000")
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 0
    assert not _files_with_non_finite_tensors(run)

    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", f"resume={last}", "hyp.lr0=1000"],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert "resuming with hyp.lr0=1000 (the checkpoint's run had 10000): learning rates x 0.1" in r.stdout + r.stderr
    assert r.returncode == EXIT_DIVERGED, r.stderr[-3000:]
    assert "likely cause: the learning rate (hyp.lr0=1000) is too high" in r.stderr.strip().splitlines()[-1]
    assert not _files_with_non_finite_tensors(run)


# ---- parts -----------------------------------------------------------------------------------------------------------
def test_loss_growth_rule():
    rule = LossGrowth(10)
    assert rule.grew(2.0, 4, epoch_end=True) is None  # an epoch's end counts whatever its length
    assert rule.lowest == 2.0
    assert rule.grew(0.01, MIN_GROWTH_BATCHES - 1, epoch_end=False) is None  # a mean of a few batches: not kept
    assert rule.lowest == 2.0
    assert rule.grew(1.0, MIN_GROWTH_BATCHES, epoch_end=False) is None
    assert rule.grew(9.9, MIN_GROWTH_BATCHES, epoch_end=False) is None  # 9.9 x the lowest: a healthy bump
    assert rule.grew(500.0, MIN_GROWTH_BATCHES - 1, epoch_end=False) is None  # too few batches to judge yet
    assert rule.grew(10.5, MIN_GROWTH_BATCHES, epoch_end=False) == 1.0
    assert rule.grew(float("nan"), 50, epoch_end=True) is None  # non-finite: the skipped-step streak's business
    off = LossGrowth(None)
    assert off.grew(1.0, 50, True) is None
    assert off.grew(1e9, 50, True) is None
    with pytest.raises(ValueError, match="max_loss_growth"):
        LossGrowth(1.0)


def test_state_problem_names_what_went_non_finite(tiny_module):
    module = tiny_module()
    ema = {f"model.{k}": v.clone() for k, v in module.model.state_dict().items()}
    module.trainer = SimpleNamespace(callbacks=[SimpleNamespace(ema_state_dict=ema)])  # as EMACallback keeps it
    assert state_problem(module) == (0, "")
    ema["model.model.0.bn.running_var"][1] = float("inf")
    assert state_problem(module) == (4, "model.model.0.bn.running_var")
    bn = module.model.model[2].cv1.bn
    bn.running_var[0] = float("nan")
    assert state_problem(module) == (2, "model.model.2.cv1.bn.running_var")  # the model before its EMA
    with torch.no_grad():
        module.model.model[0].conv.weight[0, 0, 0, 0] = float("nan")
    assert state_problem(module) == (1, "model.model.0.conv.weight")


def test_non_finite_state_at_an_epoch_end_stops_before_validation_and_last_ckpt(
    tmp_path, tiny_module, tiny_data, make_trainer
):
    """NaN in the BatchNorm statistics at epoch 1's last batch (as a NaN step's forward pass leaves them): the run
    stops there, before that epoch's validation and last.ckpt; epoch 0's last.ckpt stays, and the line names it."""
    from lightning.pytorch.callbacks import Callback

    from yolo5l.callbacks import EMACallback, LastCheckpoint

    class PlantNaN(Callback):
        validations = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.current_epoch == 1 and batch_idx + 1 == trainer.num_training_batches:
                pl_module.model.model[2].cv1.bn.running_var[0] = float("nan")

        def on_validation_start(self, trainer, pl_module) -> None:
            self.validations += 1

    ck = tmp_path / "ck"
    plant = PlantNaN()
    trainer = make_trainer(tmp_path, [EMACallback(tau=2), plant, LastCheckpoint(dirpath=ck)], max_epochs=3)
    with pytest.raises(TrainingDiverged) as stopped:
        trainer.fit(tiny_module(), tiny_data(n=8))
    assert str(stopped.value).startswith(
        "training diverged at epoch 1: the BatchNorm running statistics hold NaN or inf "
        "(model.model.2.cv1.bn.running_var); likely cause: the learning rate (hyp.lr0=0.01) is too high; resume from "
        f"the last checkpoint, all finite, with a lower rate (or start again with it if that diverges too): python -m "
        f"yolo5l.train resume={shown_path(ck / 'last.ckpt')} hyp.lr0=0.001"
    )
    assert plant.validations == 1  # epoch 0's only
    assert torch.load(ck / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] == 0


def test_the_line_names_the_cause_and_the_checkpoint(tmp_path, capsys):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    cb = SimpleNamespace(dirpath=str(ck), last_path=str(ck / "last.ckpt"))

    def trainer(device: str = "cpu", precision: str = "32-true") -> Any:
        strategy = SimpleNamespace(root_device=torch.device(device))
        return SimpleNamespace(current_epoch=3, precision=precision, strategy=strategy, checkpoint_callbacks=[cb],
                               is_global_zero=True)  # fmt: skip

    stop = diverged(trainer(), 0.01, "the weights hold NaN or inf (model.model.0.conv.weight)")
    assert isinstance(stop, TrainingDiverged)
    assert isinstance(stop, SystemExit)
    assert stop.code == EXIT_DIVERGED
    assert str(stop) == (
        "training diverged at epoch 3: the weights hold NaN or inf (model.model.0.conv.weight); likely cause: the "
        "learning rate (hyp.lr0=0.01) is too high; no checkpoint was written before it: start the run again with "
        "hyp.lr0=0.001"
    )
    assert capsys.readouterr().err.strip() == str(stop)  # printed once, on rank 0
    (ck / "last.ckpt").write_bytes(b"x")
    stop = diverged(trainer("cuda", "16-mixed"), 0.01, "the validation loss holds NaN or inf")
    assert "likely cause: fp16 overflow (some GPUs, the GTX 16xx among them, give NaN under fp16" in str(stop)
    assert "trainer.precision=32) or the learning rate (hyp.lr0=0.01) is too high" in str(stop)
    assert str(stop).endswith(
        "resume from the last checkpoint, all finite, with a lower rate (or start again with it if that diverges "
        f"too): python -m yolo5l.train resume={shown_path(ck / 'last.ckpt')} hyp.lr0=0.001"
    )
    quiet = trainer()
    quiet.is_global_zero = False
    capsys.readouterr()
    diverged(quiet, 0.01, "x")
    assert capsys.readouterr().err == ""  # other ranks raise the same exception without printing


def test_resume_with_a_lower_lr0_rescales_the_restored_schedule(tmp_path, tiny_module, tiny_data, make_trainer):
    """resume= with another hyp.lr0: every group's initial_lr and lr and the schedule's base_lrs take the new scale
    (the restored optimizer and scheduler state would otherwise keep the old rate); the same lr0 changes nothing."""
    from functools import partial

    from lightning.pytorch.callbacks import Callback

    from yolo5l.callbacks import LastCheckpoint

    class Rates(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[list[float], list[float], list[float]]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            opt, sched = pl_module.optimizers().optimizer, pl_module.lr_schedulers()
            self.seen.append(([g["initial_lr"] for g in opt.param_groups], list(sched.base_lrs),
                              [g["lr"] for g in opt.param_groups]))  # fmt: skip

    ck = tmp_path / "ck"
    first = make_trainer(tmp_path, [LastCheckpoint(dirpath=ck)], max_epochs=1, limit_val_batches=0)
    first.fit(tiny_module(), tiny_data(n=8))
    runs = {}
    for lr0 in (0.01, 0.001):  # tiny_module's own lr0, then a tenth of it
        module = tiny_module()
        module.optimizer_factory = partial(module.optimizer_factory.func, **{**module.optimizer_factory.keywords,
                                                                             "lr": lr0})  # fmt: skip
        rates = Rates()
        trainer = make_trainer(tmp_path, [rates], max_epochs=2, limit_train_batches=1, limit_val_batches=0)
        trainer.fit(module, tiny_data(n=8), ckpt_path=ck / "last.ckpt", weights_only=True)
        runs[lr0] = rates.seen[0]
    (initial, base, lr), (initial_low, base_low, lr_low) = runs[0.01], runs[0.001]
    assert initial == base == [0.01] * 3
    assert initial_low == base_low == pytest.approx([0.001] * 3)
    assert lr_low[1:] == pytest.approx([x / 10 for x in lr[1:]])  # the bias group's warmup lr is set per batch


def test_weights_file_never_stores_inf_for_values_beyond_half(tmp_path, tiny_module):
    """The issue's leftover file: a BatchNorm variance of 1e6 is finite in float32 but inf in half precision."""
    from yolo5l.models.weights import load_weights, save_weights

    model = tiny_module().model
    model.model[0].bn.running_var.fill_(1e6)
    path = save_weights(model, tmp_path / "w.pt")
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    assert not _non_finite_tensors(state)
    assert state["model.0.bn.running_var"].dtype == torch.float32  # kept whole
    assert state["model.0.bn.running_mean"].dtype == torch.float16  # the rest in half, as YOLOv5 stores it
    loaded, _ = load_weights(path)
    assert torch.equal(loaded.state_dict()["model.0.bn.running_var"], model.model[0].bn.running_var)
    model.model[0].bn.running_var[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        save_weights(model, tmp_path / "nan.pt")
    assert not (tmp_path / "nan.pt").exists()


def test_checkpoint_with_non_finite_optimizer_state_is_not_written(tmp_path):
    from yolo5l.callbacks.checkpoint import AtomicCheckpointIO

    good = {
        "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{"state": {0: {"momentum_buffer": torch.ones(2)}}}],
    }
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(good, path)
    before = path.read_bytes()
    bad = {**good, "optimizer_states": [{"state": {0: {"momentum_buffer": torch.tensor([1.0, float("nan")])}}}]}
    with pytest.warns(UserWarning, match=r"optimizer_states\[0\]\[0\]\['momentum_buffer'\] holds non-finite"):
        AtomicCheckpointIO().save_checkpoint(bad, path)
    assert path.read_bytes() == before  # the previous checkpoint is kept


def test_export_refuses_weights_with_nan(tmp_path, tiny_module):
    from yolo5l.base.errors import UserError
    from yolo5l.exporter import export_model

    model = tiny_module().model
    with torch.no_grad():
        model.model[0].conv.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(UserError, match=r"not exporting .*m\.torchscript: .* holds NaN or inf \(a diverged run\?\)"):
        export_model(model, tmp_path / "m.torchscript", fmt="torchscript", imgsz=64)
    assert not list(tmp_path.iterdir())


@pytest.mark.heavy  # a 2-trial sweep: make test-ci (CI)
def test_a_diverging_trial_does_not_end_the_sweep(tmp_path, synthetic):
    """Under -m a diverged trial is one failed row of the sweep (fitness 0), not the end of the sweep."""
    from yolo5l.callbacks.sweep import read_summary

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "yolo5l.train", "-m", *SMALL, "hyp.warmup_epochs=0", "hyp.lr0=0.01,10000",
           "trainer.limit_train_batches=2", f"hydra.sweep.dir={sweep}", f"data.synthetic.root={synthetic}"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training diverged at epoch 0: the validation loss and predictions hold NaN or inf" in r.stderr
    rows = read_summary(sweep / "summary.csv")
    status = {next(o for o in row["overrides"].split() if o.startswith("hyp.lr0=")): row["status"] for row in rows}
    assert status == {"hyp.lr0=0.01": "finished", "hyp.lr0=10000": "failed: TrainingDiverged"}
