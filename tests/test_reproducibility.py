"""Reproducible training on the CPU: the same seed and config give bit-identical weights, with one process or with
DDP over 2 gloo processes, with or without loader workers; another seed gives other weights.

ultralytics' maintainers say DDP trainings are not reproducible. Here every source of randomness is a function of
the seed: the model's initialisation (`seed_everything` before it is built), the shard split and the per-epoch
shuffles (`ShardSampler`, keyed by (seed, epoch, rank)) and each sample's augmentation (its own generator, keyed by
(seed, epoch, rank, index), so the worker that loads it does not matter). On the CPU `trainer.deterministic: null`
resolves to True (yolo5l/base/hardware.py), and a 2-rank gloo all-reduce sums the gradients in a fixed order.

Each comparison is `torch.equal` on every tensor of last.ckpt: the EMA weights (`state_dict`), the raw weights
(`current_model_state`), the optimizer's momentum buffers; the plain values (lr schedule, EMA update count, validation
metrics) compare with `==`. The subprocess runs are slow (`-m slow`); one in-process check runs in the default suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yolo5l.tracking.loggers import read_metrics_csv

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}

# What must match between two runs besides the tensors: callbacks whose state is a function of the training alone
# (ThroughputMonitor keeps timings, LastCheckpoint the run's own paths).
_SAME_CALLBACK_STATE = ("EMACallback", "ValidationSummary")


# ---- comparisons ---------------------------------------------------------------------------------------------------
def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    assert a, what  # something was compared
    for k, v in a.items():
        assert b[k].dtype == v.dtype, f"{what}: {k} is {v.dtype} and {b[k].dtype}"
        assert torch.equal(b[k], v), f"{what}: {k} differs by {(b[k].double() - v.double()).abs().max()}"


def _callback_state(ckpt: dict, name: str) -> dict:
    (state,) = (v for k, v in ckpt["callbacks"].items() if k.startswith(name))
    return state


def assert_same_training_state(a: dict, b: dict) -> None:
    """Two last.ckpt dicts hold the same training state, bit for bit."""
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])
    assert a["global_step"] > 0  # the optimizer stepped: the weights moved away from the initialisation
    _assert_same_tensors(a["state_dict"], b["state_dict"], "EMA weights")
    _assert_same_tensors(a["current_model_state"], b["current_model_state"], "raw weights")
    (oa,), (ob,) = a["optimizer_states"], b["optimizer_states"]
    assert oa["param_groups"] == ob["param_groups"]  # lr, momentum: plain floats
    assert oa["state"].keys() == ob["state"].keys()
    assert oa["state"]  # SGD's momentum buffers exist
    for k in oa["state"]:
        _assert_same_tensors(oa["state"][k], ob["state"][k], f"optimizer state {k}")
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["yolo5l_last_opt_step"] == b["yolo5l_last_opt_step"]
    for name in _SAME_CALLBACK_STATE:
        assert _callback_state(a, name) == _callback_state(b, name), name


def assert_different_weights(a: dict, b: dict) -> None:
    """Every convolution weight differs (EMA and raw): the comparison above can fail."""
    for key in ("state_dict", "current_model_state"):
        convs = [k for k in a[key] if k.endswith(".conv.weight")]
        assert len(convs) > 10
        same = [k for k in convs if torch.equal(a[key][k], b[key][k])]
        assert same == [], (key, same)


def _load_last(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


# ---- in process (the default suite) --------------------------------------------------------------------------------
@pytest.fixture
def _restore_process_state():
    """`build` seeds every generator and Lightning turns deterministic algorithms on; put both back afterwards."""
    env = dict(os.environ)
    det, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    os.environ.clear()
    os.environ.update(env)


def _fit_in_process(out: Path, root: Path, seed: int) -> dict:
    from yolo5l.config import compose_config
    from yolo5l.train import build

    cfg = compose_config(
        [
            "experiment=smoke", f"seed={seed}", f"data.synthetic.root={root}", "data.synthetic.num_train=8",
            "data.synthetic.num_val=4", "data.imgsz=64", "data.batch_size=4", "trainer.max_epochs=1",
            "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "tune_malloc=false",
        ],
        output_dir=out,
    )  # fmt: skip
    datamodule, module, trainer = build(cfg)
    # The callbacks that only draw (batch mosaics, validation curves) take most of the time of so short a run.
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not type(cb).__name__.endswith(("Plotter", "Plots"))]
    assert torch.are_deterministic_algorithms_enabled()  # `trainer.deterministic: null` on the CPU
    trainer.fit(module, datamodule=datamodule)
    return _load_last(out)


@pytest.mark.usefixtures("_restore_process_state", "one_thread")
def test_same_seed_same_weights_in_process(tmp_path):
    """Two 1-epoch in-process runs of the smoke experiment (2 batches of 4 at 64 px, full default augmentation: mosaic,
    perspective, HSV, flips, albumentations) with seed 0 end bit-identical; a run with seed 1 differs in every
    convolution weight."""
    root = tmp_path / "synthetic"
    a = _fit_in_process(tmp_path / "a", root, seed=0)
    b = _fit_in_process(tmp_path / "b", root, seed=0)
    assert_same_training_state(a, b)
    c = _fit_in_process(tmp_path / "c", root, seed=1)
    assert_different_weights(a, c)


# ---- subprocess runs (slow) ----------------------------------------------------------------------------------------
def _train(run: Path, *args: str, timeout: int = 600) -> dict:
    r = subprocess.run(
        [
            sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"hydra.run.dir={run}", "logger=csv",
            "trainer.max_epochs=2", "trainer.limit_val_batches=1", "~callbacks.batch_plotter",
            "trainer.enable_progress_bar=false", *args,
        ],
        capture_output=True, text=True, timeout=timeout, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return _load_last(run)


def _logged(run: Path) -> list[dict[str, str]]:
    """metrics.csv without the timing columns: losses, learning rates and validation metrics of every epoch."""
    rows = read_metrics_csv(run / "metrics.csv")
    assert len(rows) == 2
    return [{k: v for k, v in row.items() if k not in ("train/images_per_sec", "train/data_wait")} for row in rows]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """Four runs of 2 epochs x 3 batches of 8 at 128 px on one CPU process: seed 0 twice with `data.num_workers=0`,
    seed 0 with 2 persistent workers, seed 1."""
    tmp = tmp_path_factory.mktemp("repro_single")
    data = [f"data.synthetic.root={tmp / 'synthetic'}", "trainer.limit_train_batches=3"]
    workers = ["data.num_workers=2", "data.persistent_workers=true"]
    runs = {"a": ["seed=0"], "b": ["seed=0"], "workers": ["seed=0", *workers], "seed1": ["seed=1"]}
    return {name: (tmp / name, _train(tmp / name, *data, *args)) for name, args in runs.items()}


@pytest.mark.slow
def test_same_seed_same_weights_one_device(single_device):
    """Two runs with the same seed and config: identical last.ckpt tensors and identical logged losses and mAPs."""
    (run_a, a), (run_b, b) = single_device["a"], single_device["b"]
    assert_same_training_state(a, b)
    assert _logged(run_a) == _logged(run_b)


@pytest.mark.slow
def test_loader_workers_do_not_change_the_weights(single_device):
    """`data.num_workers=2` (persistent workers) trains bit-identically to `data.num_workers=0`."""
    (run_a, a), (run_w, w) = single_device["a"], single_device["workers"]
    assert_same_training_state(a, w)
    assert _logged(run_a) == _logged(run_w)


@pytest.mark.slow
def test_another_seed_gives_other_weights(single_device):
    """seed=1 against seed=0, same config: every convolution weight differs, and so do the logged losses."""
    (run_a, a), (run_s, s) = single_device["a"], single_device["seed1"]
    assert_different_weights(a, s)
    assert _logged(run_a)[0]["train/loss"] != _logged(run_s)[0]["train/loss"]


@pytest.mark.slow
def test_same_seed_same_weights_ddp_two_gloo_processes(tmp_path):
    """Two DDP runs over 2 gloo processes (4 images a rank a batch, 2 epochs of 2 batches at 64 px) with the same seed
    end bit-identical: weights, momentum buffers, EMA, the synced validation metrics."""
    data = [
        f"data.synthetic.root={tmp_path / 'synthetic'}", "data.synthetic.num_train=15", "data.synthetic.num_val=16",
        "data.imgsz=64", "data.batch_size=8", "trainer.limit_train_batches=null",
        "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu",
    ]  # fmt: skip
    runs = [tmp_path / "a", tmp_path / "b"]
    a, b = (_train(run, *data, timeout=900) for run in runs)
    for run in runs:
        assert (run / "train_ddp_process_1.log").is_file()  # a second rank ran
    assert a["global_step"] == 2 * 2  # ceil(15 / 2) = 8 images a rank: 2 batches of 4 an epoch
    assert_same_training_state(a, b)
    assert _logged(runs[0]) == _logged(runs[1])
