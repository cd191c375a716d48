"""Preemption: a signal ends the run at a step it resumes from exactly (`yolo5l.callbacks.preemption`).

The end-to-end tests run `python -m yolo5l.train` as a scheduler would: a test-only callback (`SignalAt`, loaded from
this module with tests/ on PYTHONPATH) sends the signal to the process itself at a chosen batch, deterministically.
With `module.nbs=400` and 8 images a batch, YOLOv5's warmup ramps the accumulation fast: the optimizer steps after
batches 0, 1 and 3 of epoch 0 and after batch 3 of epoch 1, so a signal during batch 2 lands on a micro-batch whose
gradients no checkpoint would hold, followed by the epoch's last batch.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from yolo5l.base.errors import shown_path

TESTS = Path(__file__).parent
ENV = {
    **os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p),
}  # fmt: skip
COMMON = (
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=1",
    "data.num_workers=0",
    "module.nbs=400",
    "~callbacks.batch_plotter",
    "logger=csv",
)


class SignalAt(Callback):
    """Test aid: send `name` to this process at the start of batch `batch` of epoch `epoch` (on rank `rank` only),
    or with `group` to its whole process group, DataLoader workers included, as SLURM signals a job step.

    The handler runs before the batch's training step, as a scheduler's signal arriving during that step would.
    A resumed run that starts past that batch never sends it again.
    """

    def __init__(
        self, epoch: int = 0, batch: int = 1, name: str = "SIGTERM", rank: int | None = None, group: bool = False,
        times: int = 1,
    ) -> None:  # fmt: skip
        self.epoch, self.batch, self.signum, self.rank = int(epoch), int(batch), getattr(signal, name), rank
        self.group, self.times = bool(group), int(times)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch):
            for _ in range(self.times - 1):  # a user who presses Ctrl-C again
                os.kill(os.getpid(), self.signum)
            if self.group:
                os.killpg(os.getpgid(0), self.signum)  # the test starts the run in a session of its own
            elif self.rank is None or trainer.global_rank == self.rank:
                os.kill(os.getpid(), self.signum)


def _signal_args(epoch: int, batch: int, name: str) -> list[str]:
    return [
        "+callbacks.signal._target_=test_preemption.SignalAt",
        f"+callbacks.signal.epoch={epoch}",
        f"+callbacks.signal.batch={batch}",
        f"+callbacks.signal.name={name}",
    ]


def _train(run: Path, synthetic: Path, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"hydra.run.dir={run}",
        f"data.synthetic.root={synthetic}", *args,
    ]  # fmt: skip
    # A session (and process group) of its own: a signal SignalAt sends to its group never reaches pytest.
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
    )


def _resume(ckpt: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "yolo5l.train", f"resume={ckpt}", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _wait(proc: subprocess.Popen, timeout: int = 600) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k, v in a.items():
        assert torch.equal(b[k], v), f"{what}: {k} differs by {(b[k].float() - v.float()).abs().max()}"


def _assert_same_training_state(a: dict, b: dict) -> None:
    """EMA and raw weights, optimizer and scheduler state, the module's accumulation counter, the EMA's updates."""
    assert a["epoch"] == b["epoch"]
    assert a["global_step"] == b["global_step"] > 0
    _assert_same_tensors(a["state_dict"], b["state_dict"], "EMA weights")
    _assert_same_tensors(a["current_model_state"], b["current_model_state"], "raw weights")
    (oa,), (ob,) = a["optimizer_states"], b["optimizer_states"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        _assert_same_tensors(oa["state"][k], ob["state"][k], f"optimizer state {k}")
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["yolo5l_last_opt_step"] == b["yolo5l_last_opt_step"]
    ema_a = next(v for k, v in a["callbacks"].items() if k.startswith("EMACallback"))
    ema_b = next(v for k, v in b["callbacks"].items() if k.startswith("EMACallback"))
    assert ema_a == ema_b


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """The smoke dataset, made once before any run starts (runs in parallel would race to write it)."""
    from yolo5l.data.synthetic import ensure_synthetic

    root = tmp_path_factory.mktemp("synthetic")
    ensure_synthetic(root=root, num_train=32, num_val=16, seed=0)
    return root


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, synthetic):
    """The run never interrupted, started at once and read when a test needs it (it overlaps the first test's)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = _train(run, synthetic, *COMMON)
    done: dict[str, Any] = {}

    def result() -> dict[str, Any]:
        if not done:
            rc, _, err = _wait(proc)
            assert rc == 0, err[-3000:]
            done.update(_load(run / "checkpoints" / "last.ckpt"))
        return done

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.heavy  # three runs: CI runs it (make test-ci), `make test` stays light
def test_preempted_twice_and_resumed_ends_as_the_uninterrupted_run(tmp_path, synthetic, uninterrupted):
    """SIGTERM during batch 1 of epoch 0 (it steps): last.ckpt at that batch's end, exit 143 and the resume line. The
    resumed run gets SIGUSR1 during batch 2 (an accumulation micro-batch, and batch 3 ends the epoch with its
    validation): it finishes the epoch, with its metrics row and LastCheckpoint's last.ckpt, and exits 138 at the
    start of epoch 1. Resumed again, it ends bit-identical to the run never interrupted."""
    from yolo5l.resume import read_resume_state
    from yolo5l.tracking.loggers import read_metrics_csv

    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    rc, out, err = _wait(_train(run, synthetic, *COMMON, *_signal_args(0, 1, "SIGTERM")))
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"preempted (SIGTERM) at epoch 0, batch 2 of 4: resume with python -m yolo5l.train resume={shown_path(last)}"
    )
    ckpt = _load(last)  # written at the end of batch 1; nothing after it replaced it
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["yolo5l_last_opt_step"]) == (0, 2, 1)
    assert ckpt["YOLODataModule"] == {"train_epoch": 0, "train_batches_done": 2}
    state = read_resume_state(last)
    assert (state.epochs_done, state.batches_done) == (0, 2)
    assert not (run / "checkpoints" / "weights.pt").exists()  # the run is not finished

    # The resumed run may change its callbacks: this time the signal comes during batch 2 of epoch 0.
    rc, out, err = _wait(_resume(last, "+callbacks.signal.batch=2", "+callbacks.signal.name=SIGUSR1"))
    assert rc == 128 + signal.SIGUSR1, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"preempted (SIGUSR1) after epoch 0: resume with python -m yolo5l.train resume={shown_path(last)}"
    )
    ckpt = _load(last)
    assert (ckpt["epoch"], ckpt["global_step"]) == (0, 3)
    assert read_resume_state(last).epochs_done == 1
    assert [row["epoch"] for row in read_metrics_csv(run / "metrics.csv")] == ["0"]  # the epoch's row was logged

    rc, out, err = _wait(_resume(last))
    assert rc == 0, err[-3000:]
    assert "Training done" in out
    _assert_same_training_state(uninterrupted(), _load(last))


@pytest.mark.heavy  # two runs: CI runs it (make test-ci), `make test` stays light
@pytest.mark.parametrize(("name", "stopped"), [("SIGUSR1", "preempted (SIGUSR1)"), ("SIGINT", "stopped (Ctrl-C)")])
def test_signal_to_the_process_group_spares_persistent_workers(tmp_path, synthetic, uninterrupted, name, stopped):
    """SLURM signals every process of the job step, and Ctrl-C every process of the terminal's foreground group: the
    signal to the whole group, 2 persistent DataLoader workers included (SIGUSR1's default action would kill them,
    SIGINT's KeyboardInterrupt end them, and the run with them). The run stops at the step as a lone signal would,
    and resumed (with its workers) it ends bit-identical to the uninterrupted run without workers (augmentation
    depends on neither)."""
    run = tmp_path / "run"
    workers = ("data.num_workers=2", "data.persistent_workers=true")
    rc, _, err = _wait(
        _train(run, synthetic, *COMMON, *workers, *_signal_args(0, 1, name), "+callbacks.signal.group=true")
    )
    last = run / "checkpoints" / "last.ckpt"
    assert rc == 128 + getattr(signal, name), err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"{stopped} at epoch 0, batch 2 of 4: resume with python -m yolo5l.train resume={shown_path(last)}"
    )
    assert ("Ctrl-C: stopping at the next step a checkpoint resumes exactly" in err) == (name == "SIGINT")
    rc, out, err = _wait(_resume(last))
    assert rc == 0, err[-3000:]
    assert "dataloader is not resumable" not in out + err  # Lightning's warning: this one resumes at the batch
    _assert_same_training_state(uninterrupted(), _load(last))


@pytest.mark.heavy  # a run: CI runs it (make test-ci), `make test` stays light
def test_ctrl_c_twice_stops_at_once_and_names_the_last_save(tmp_path, synthetic):
    """A second Ctrl-C before the step ends stops the run at once, through Lightning's KeyboardInterrupt handling
    (exit 1), with a line naming last.ckpt (written at the end of epoch 0) to resume from."""
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    rc, _, err = _wait(_train(run, synthetic, *COMMON, *_signal_args(1, 1, "SIGINT"), "+callbacks.signal.times=2"))
    assert rc == 1, err[-3000:]
    assert "Ctrl-C: stopping at the next step" in err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"stopped (Ctrl-C) in epoch 1: resume with python -m yolo5l.train resume={shown_path(last)} (its last save: "
        "the epoch it was in starts again)"
    )
    assert _load(last)["epoch"] == 0


@pytest.mark.heavy  # three runs: CI runs it (make test-ci), `make test` stays light
def test_device_pipeline_preempted_and_resumed_ends_as_its_uninterrupted_run(tmp_path, synthetic):
    """The device input path makes each batch one ahead of the step: a run stopped by SIGTERM inside an epoch (the
    batch made ahead never trained) and resumed with its 2 workers ends bit-identical to the same run never stopped."""
    device = ("data.pipeline=device", "data.num_workers=2", "data.persistent_workers=true")
    straight = _train(tmp_path / "straight", synthetic, *COMMON, *device)
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    rc, _, err = _wait(_train(run, synthetic, *COMMON, *device, *_signal_args(0, 1, "SIGTERM")))
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert _load(last)["YOLODataModule"] == {"train_epoch": 0, "train_batches_done": 2}
    rc, _, err = _wait(_resume(last))
    assert rc == 0, err[-3000:]
    rc, _, err = _wait(straight)
    assert rc == 0, err[-3000:]
    _assert_same_training_state(_load(tmp_path / "straight" / "checkpoints" / "last.ckpt"), _load(last))


# ---- parts ---------------------------------------------------------------------------------------------------------
def test_shard_sampler_resumes_inside_an_epoch():
    from yolo5l.data.datamodule import ShardSampler

    full = ShardSampler(20, rank=1, world_size=2, seed=3)
    full.set_epoch(4)
    items = list(full)
    resumed = ShardSampler(20, rank=1, world_size=2, seed=3)
    resumed.resume_at(4, 6)
    resumed.set_epoch(4)
    assert list(resumed) == items[6:]  # the same order and augmentation keys, nothing twice
    assert list(resumed) == items[6:]  # any number of iterators over that epoch
    assert len(resumed) == len(full)  # Lightning's count of the epoch's batches is unchanged
    resumed.set_epoch(5)
    full.set_epoch(5)
    assert list(resumed) == list(full)  # later epochs are whole
    resumed.resume_at(2, 6)  # an epoch-end checkpoint's position: the next epoch is another one
    resumed.set_epoch(3)
    assert len(list(resumed)) == len(full)


def test_checkpoint_position():
    from yolo5l.callbacks.checkpoint import checkpoint_position

    def ckpt(epoch: int, epochs_processed: int, batches: int) -> dict[str, Any]:
        progress = {"current": {"processed": batches}}
        loops = {"fit_loop": {"epoch_progress": {"current": {"processed": epochs_processed}},
                              "epoch_loop.batch_progress": progress}}  # fmt: skip
        return {"epoch": epoch, "loops": loops}

    assert checkpoint_position(ckpt(3, 4, 40)) == (4, 0)  # LastCheckpoint at the end of epoch 3
    assert checkpoint_position(ckpt(3, 3, 17)) == (3, 17)  # preempted inside epoch 3
    assert checkpoint_position({"epoch": 3}) == (4, 0)  # no loop state: an epoch end


def test_in_process_fit_stops_with_preempted_and_gives_the_signals_back(tmp_path, tiny_module, tiny_data, make_trainer):
    """trainer.fit in a notebook: Preempted (a SystemExit with code 128 + signal) after last.ckpt, and afterwards
    the signal reaches the handler that was installed before fit."""
    from yolo5l.callbacks.checkpoint import LastCheckpoint, checkpoint_position
    from yolo5l.callbacks.preemption import Preempted, PreemptionCheckpoint

    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        ck = tmp_path / "ck"
        callbacks = [SignalAt(0, 1, "SIGUSR1"), LastCheckpoint(dirpath=ck), PreemptionCheckpoint()]
        trainer = make_trainer(tmp_path, callbacks, max_epochs=1)
        with pytest.raises(Preempted) as stopped:
            trainer.fit(tiny_module(), tiny_data(n=16, batch_size=2))
        assert stopped.value.code == 128 + signal.SIGUSR1
        assert checkpoint_position(torch.load(ck / "last.ckpt", weights_only=True)) == (0, 2)
        assert not seen
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]

        trainer = make_trainer(tmp_path, [LastCheckpoint(dirpath=ck), PreemptionCheckpoint()], max_epochs=1)
        trainer.fit(tiny_module(), tiny_data(n=16, batch_size=2))  # no signal: an ordinary fit
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_bad_arguments_are_refused():
    from yolo5l.callbacks.preemption import PreemptionCheckpoint

    with pytest.raises(ValueError, match="SIGNOPE"):
        PreemptionCheckpoint(signals=["SIGNOPE"])
    with pytest.raises(ValueError, match="check_every_n_steps"):
        PreemptionCheckpoint(check_every_n_steps=0)


def test_a_forked_process_still_ends_on_sigterm():
    # A process forked while the handler is installed (a multiprocessing pool started during a fit, or after one
    # that ended in an exception) and then terminated with SIGTERM must end, not defer the signal as the training
    # process does: Pool.terminate() would wait for it forever.
    import multiprocessing as mp
    import time
    import types

    from yolo5l.callbacks.preemption import PreemptionCheckpoint

    # The handler found at install time defers the signal, as Lightning's own SIGTERM handler does.
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    cb = PreemptionCheckpoint()
    cb._install(types.SimpleNamespace(strategy=types.SimpleNamespace(launcher=None)))
    try:
        child = mp.get_context("fork").Process(target=time.sleep, args=(120,))
        child.start()
        time.sleep(0.5)
        child.terminate()
        child.join(timeout=30)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        assert not alive
        assert child.exitcode == -signal.SIGTERM
    finally:
        cb._uninstall()
        signal.signal(signal.SIGTERM, before)


def test_slurm_requeue_after_the_checkpoint(tmp_path, monkeypatch):
    """Lightning's SLURM environment with auto-requeue: the requeue signal requeues the job (scontrol, here a stub
    that records its arguments); SIGTERM or auto_requeue=False does not."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from yolo5l.callbacks.preemption import _requeue

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    log = tmp_path / "scontrol.log"
    stub = tmp_path / "bin" / "scontrol"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{stub.parent}{os.pathsep}{os.environ['PATH']}")

    def trainer(env: Any) -> Any:
        return SimpleNamespace(strategy=SimpleNamespace(cluster_environment=env))

    slurm = SLURMEnvironment(auto_requeue=True)
    assert _requeue(trainer(slurm), int(signal.SIGUSR1)) == "requeued SLURM job 4242"
    assert log.read_text().split() == ["requeue", "4242"]
    assert _requeue(trainer(slurm), int(signal.SIGTERM)) == ""  # SLURM requeues preempted jobs itself
    assert _requeue(trainer(SLURMEnvironment(auto_requeue=False)), int(signal.SIGUSR1)) == ""
    assert _requeue(trainer(None), int(signal.SIGUSR1)) == ""  # not on SLURM
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert _requeue(trainer(slurm), int(signal.SIGUSR1)) == "requeued SLURM job 77_3"


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_step(tmp_path, synthetic):
    """2 gloo ranks, the signal sent to rank 1 only (no launcher forwards it from there): the ranks agree through the
    all-reduce every check_every_n_steps=2 optimizer steps, stop at the same batch, and the resumed run ends as the
    uninterrupted one."""
    ddp = ("trainer.devices=2", "trainer.strategy=ddp", "callbacks.preemption.check_every_n_steps=2")
    straight = _train(tmp_path / "straight", synthetic, *COMMON, *ddp)
    run = tmp_path / "run"
    signal_rank1 = [*_signal_args(0, 0, "SIGTERM"), "+callbacks.signal.rank=1"]
    rc, _, err = _wait(_train(run, synthetic, *COMMON, *ddp, *signal_rank1), timeout=900)
    last = run / "checkpoints" / "last.ckpt"
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    # Signalled during batch 0; the first agreement is at global step 2, the end of batch 1.
    resume = f"resume with python -m yolo5l.train resume={shown_path(last)}"
    assert f"preempted (SIGTERM) at epoch 0, batch 2 of 4: {resume}" in err
    assert _load(last)["global_step"] == 2
    rc, _, err = _wait(_resume(last), timeout=900)
    assert rc == 0, err[-3000:]
    rc, _, err = _wait(straight, timeout=900)
    assert rc == 0, err[-3000:]
    _assert_same_training_state(_load(tmp_path / "straight" / "checkpoints" / "last.ckpt"), _load(last))
