"""A DDP rank that dies is explained: one line naming it, its signal or exit code, the last complete checkpoint and
the `resume=` command, exit status 75 (`yolo5l.callbacks.lost_rank`), and no rank waits long for one that is gone.

The fast tests run the parts in subprocesses where they end a process (the observer's `os._exit`) or need a second
rank (gloo on 127.0.0.1); the slow ones run `python -m yolo5l.train` under DDP on the CPU: a rank SIGKILLed mid-epoch
with Lightning's launcher, and a "node" that stops answering with none (as under torchrun on several nodes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from yolo5l.base.errors import EXIT_RANK_LOST, shown_path
from yolo5l.callbacks.lost_rank import LostRankWatch, RankLost, collective_failure, raise_if_rank_lost

TESTS = Path(__file__).parent
ENV = {
    **os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p),
}  # fmt: skip
# What gloo raised in torch 2.14 when the peer's process was SIGKILLed, and when it was stopped (SIGSTOP).
GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:41371. This "
    "is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error."
)
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def _trainer(tmp_path: Path, **kw) -> SimpleNamespace:
    ck = tmp_path / "checkpoints"
    cb = SimpleNamespace(dirpath=str(ck), last_path=str(ck / "last.ckpt"))
    args = {"world_size": 2, "global_rank": 1, "current_epoch": 2, "checkpoint_callbacks": [cb], "callbacks": []}
    return SimpleNamespace(**{**args, **kw})


# ---- the message and the exit status -------------------------------------------------------------------------------
def test_collective_failures_are_told_apart():
    assert collective_failure(RuntimeError(GLOO_CLOSED)) == "closed"
    assert collective_failure(RuntimeError(GLOO_TIMEOUT)) == "timeout"
    outer = ValueError("a step failed")
    outer.__cause__ = RuntimeError(GLOO_CLOSED)
    assert collective_failure(outer) == "closed"  # found through the exception it was raised from
    assert collective_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    assert collective_failure(ValueError("Timed out")) is None


def test_a_failed_collective_becomes_rank_lost(tmp_path, capsys):
    """on_exception prints the line on the surviving rank; the command line then raises RankLost (exit 75) from the
    collective's error. Other errors, and stops that are SystemExits with their own line, are left alone."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    watch = LostRankWatch(collective_timeout_s=20)
    trainer = _trainer(tmp_path, callbacks=[watch])
    error = RuntimeError(GLOO_TIMEOUT)
    watch.on_exception(trainer, None, error)
    line = (
        "DDP rank lost at epoch 2: rank 1 waited 20 s (callbacks.lost_rank.collective_timeout_s) for another rank in "
        "a collective: that rank died, hangs or lost its node; the job stops; resume from the last complete "
        f"checkpoint: python -m yolo5l.train resume={shown_path(tmp_path / 'checkpoints' / 'last.ckpt')}"
    )
    assert capsys.readouterr().err.strip() == line
    with pytest.raises(RankLost) as stopped:
        raise_if_rank_lost(trainer, error)
    assert stopped.value.code == EXIT_RANK_LOST
    assert str(stopped.value) == line
    assert stopped.value.__cause__ is error

    for other in (RuntimeError("CUDA out of memory"), RankLost("already said"), SystemExit(65)):
        watch = LostRankWatch()
        trainer = _trainer(tmp_path, callbacks=[watch])
        watch.on_exception(trainer, None, other)
        raise_if_rank_lost(trainer, other)  # nothing raised
        assert watch.lost is None
    watch = LostRankWatch(collective_timeout_s=None)  # the backend's timeout kept
    watch.on_exception(_trainer(tmp_path), None, error)
    assert "rank 1 waited the process group's timeout for another rank in a collective" in str(watch.lost)
    capsys.readouterr()
    watch = LostRankWatch()
    watch.on_exception(_trainer(tmp_path, world_size=1), None, RuntimeError(GLOO_CLOSED))  # one process: no ranks
    assert watch.lost is None
    assert capsys.readouterr().err == ""


def test_a_ddp_spawn_process_that_died_becomes_rank_lost(tmp_path, capsys):
    """ddp_spawn's launcher waits in the parent process, outside any hook: torch's ProcessExitedException there."""
    from torch.multiprocessing import ProcessExitedException

    died = ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 4242, -9, "SIGKILL")
    with pytest.raises(RankLost) as stopped:
        raise_if_rank_lost(_trainer(tmp_path), died)
    line = (
        "DDP rank lost: rank 1 (pid 4242) was killed by SIGKILL (the kernel's out-of-memory killer sends SIGKILL: see "
        "dmesg); the job stops; no checkpoint was written yet: start the run again"
    )
    assert str(stopped.value) == line
    assert stopped.value.code == EXIT_RANK_LOST
    assert capsys.readouterr().err.strip() == line
    with pytest.raises(RankLost, match=r"rank 0 \(pid 7\) exited with status 3; the job stops"):
        raise_if_rank_lost(_trainer(tmp_path), ProcessExitedException("process 0 exited", 0, 7, 3))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="collective_timeout_s"):
        LostRankWatch(collective_timeout_s=0)
    with pytest.raises(ValueError, match="poll_s"):
        LostRankWatch(poll_s=0)


# ---- the observer that replaces Lightning's --------------------------------------------------------------------------
OBSERVER = """
    import os, signal, subprocess, sys, time
    from types import SimpleNamespace
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from yolo5l.callbacks.lost_rank import LostRankWatch, _stop_lightning_observer

    folder, ends = sys.argv[1], sys.argv[2:]  # how ranks 2, 3, ... end: "kill" (SIGKILLed), else an exit status
    child = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"]
    procs = [subprocess.Popen([*child, *(("60", "0") if end == "kill" else ("0.3", end))]) for end in ends]
    procs.insert(0, subprocess.Popen([*child, "60", "0"]))  # rank 1: runs on
    print(*(p.pid for p in procs), flush=True)
    lightning = _ChildProcessObserver(os.getpid(), procs, sleep_period=0.2)  # would SIGKILL this process
    lightning.start()
    _stop_lightning_observer(procs)
    cb = SimpleNamespace(dirpath=folder, last_path=os.path.join(folder, "last.ckpt"))
    trainer = SimpleNamespace(node_rank=0, num_devices=len(procs) + 1, current_epoch=1, checkpoint_callbacks=[cb])
    open(os.path.join(folder, ".last.ckpt.abc123.tmp"), "wb").close()  # a write cut short
    watch = LostRankWatch(poll_s=0.1)
    seen = {}  # pid -> polls that found the process ended: proof the watcher looked at it
    for p in procs:
        def counted(p=p, poll=p.poll):
            code = poll()
            if code is not None:
                seen[p.pid] = seen.get(p.pid, 0) + 1
            return code
        p.poll = counted
    watch._observer = __import__("threading").Thread(target=watch._watch, args=(trainer, procs), daemon=True)
    watch._observer.start()
    for p, end in zip(procs[1:], ends):
        if end == "kill":
            os.kill(p.pid, signal.SIGKILL)
    time.sleep(2)
    watch._stop.set()
    procs[0].kill()
    print("still running", *(seen.get(p.pid, 0) for p in procs[1:]), flush=True)
"""


def test_observer_names_the_killed_rank_and_ends_the_job_with_75(tmp_path):
    """Rank 2 SIGKILLed: one line naming it and its signal; the other rank is killed, the half-written checkpoint's
    temporary file removed, and rank 0 ends with 75 (Lightning's observer, stopped, would have SIGKILLed it)."""
    r = _script(OBSERVER, str(tmp_path), "kill")
    assert r.returncode == EXIT_RANK_LOST, r.stderr[-3000:]
    pid0, pid1 = map(int, r.stdout.split()[:2])
    assert "still running" not in r.stdout
    assert r.stderr.strip().splitlines()[-1] == (
        f"DDP rank lost at epoch 1: rank 2 (pid {pid1}) was killed by SIGKILL (the kernel's out-of-memory killer "
        "sends SIGKILL: see dmesg); the job stops; no checkpoint was written yet: start the run again"
    )
    assert not _alive(pid0)  # killed (and reaped by init once its parent is gone)
    assert not list(tmp_path.glob(".last.ckpt.*.tmp"))


def _alive(pid: int) -> bool:
    """Whether `pid` still runs after 5 s (a zombie that nobody reaped has ended: init may not reap in a container)."""
    for _ in range(50):
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_observer_leaves_an_orderly_stop_alone(tmp_path):
    """A rank that ends on its own with a status all ranks stop with (done, diverged, preempted) is no lost rank."""
    r = _script(OBSERVER, str(tmp_path), "0", "65", "143")
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("still running"))
    polls = [int(n) for n in line.split()[2:]]
    assert len(polls) == 3
    assert min(polls) >= 3  # the watcher saw each of the 3 ranks ended, every 0.1 s, and let them be
    assert "DDP rank lost" not in r.stderr


def test_observer_reports_an_unexpected_exit_status(tmp_path):
    r = _script(OBSERVER, str(tmp_path), "1")
    assert r.returncode == EXIT_RANK_LOST, r.stderr[-3000:]
    assert "rank 2 (pid " in r.stderr
    assert ") exited with status 1; the job stops" in r.stderr


# ---- two gloo ranks: the collective timeout and the preemption agreement ------------------------------------------
RANKS = """
    import datetime, os, signal, sys, time
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from yolo5l.callbacks.lost_rank import LostRankWatch, RankLost, collective_failure
    from yolo5l.callbacks.preemption import PreemptionCheckpoint

    rank, port, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(minutes=30))
    dist.barrier()
    if rank == 1:
        time.sleep(60)  # alive, its sockets open, but never in the next collective: a hung rank or a lost node
    trainer = SimpleNamespace(world_size=2, global_rank=0, current_epoch=0, checkpoint_callbacks=[], callbacks=[],
                              strategy=SimpleNamespace(root_device=torch.device("cpu"), launcher=None))
    t0 = time.monotonic()
    try:
        if what == "timeout":
            LostRankWatch(collective_timeout_s=2).on_fit_start(trainer, None)
            dist.all_reduce(torch.ones(1))
        else:
            pre = PreemptionCheckpoint(agree_timeout_s=2)
            pre._received = int(signal.SIGTERM)
            pre._agree(trainer)
    except RankLost as e:
        print("RankLost", e.code, round(time.monotonic() - t0), flush=True)
        os._exit(0)
    except RuntimeError as e:
        print("RuntimeError", collective_failure(e), round(time.monotonic() - t0), flush=True)
        os._exit(0)
    print("no error", flush=True)
    os._exit(1)
"""


def _two_ranks(what: str) -> subprocess.CompletedProcess:
    port = str(_free_port())
    code = textwrap.dedent(RANKS)
    other = subprocess.Popen([sys.executable, "-c", code, "1", port, what], env=ENV, stderr=subprocess.DEVNULL)
    try:
        return _script(RANKS, "0", port, what)
    finally:
        other.kill()
        other.wait()


def test_collective_timeout_is_set_deliberately():
    """LostRankWatch sets the process group's timeout (2 s here, instead of the 30 minutes the group was made with):
    a collective waiting for a rank that never comes fails after it, as a "timeout"."""
    r = _two_ranks("timeout")
    assert r.returncode == 0, r.stderr[-3000:]
    kind, seconds = r.stdout.split()[1:]
    assert kind == "timeout"
    assert int(seconds) < 60  # long before the group's 30 minutes, and before the other rank ends


def test_preemption_agreement_does_not_wait_for_a_lost_rank(capsys):
    """A signalled rank whose peer never joins the agreement stops after agree_timeout_s with the lost-rank line and
    status, instead of waiting for the process group's timeout (here 30 minutes)."""
    r = _two_ranks("agree")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:2] == ["RankLost", str(EXIT_RANK_LOST)]
    assert r.stderr.strip().splitlines()[-1] == (
        "DDP rank lost at epoch 0: rank 0 received SIGTERM and the other ranks did not agree within 2 s "
        "(callbacks.preemption.agree_timeout_s): one of them died or hangs; the job stops; no checkpoint was written "
        "yet: start the run again"
    )


# ---- end to end ------------------------------------------------------------------------------------------------------
SMOKE = ("experiment=smoke", "data.imgsz=64", "logger=csv", "~callbacks.batch_plotter", "trainer.max_epochs=2")


def _signal_args(name: str) -> list[str]:  # tests/test_preemption.py's SignalAt, on rank 1 during epoch 1, batch 1
    return ["+callbacks.signal._target_=test_preemption.SignalAt", "+callbacks.signal.epoch=1",
            "+callbacks.signal.batch=1", f"+callbacks.signal.name={name}", "+callbacks.signal.rank=1"]  # fmt: skip


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    from yolo5l.data.synthetic import ensure_synthetic

    root = tmp_path_factory.mktemp("synthetic")
    ensure_synthetic(root=root, num_train=32, num_val=16, seed=0)
    return root


@pytest.mark.slow
def test_ddp_rank_killed_mid_epoch_is_named_and_resumes(tmp_path, synthetic):
    """`trainer.accelerator=cpu trainer.devices=2`: rank 1 SIGKILLed during epoch 1 (as the OOM killer would). The
    job ends with status 75 and the line naming rank 1, SIGKILL and epoch 0's last.ckpt; the resume= it gives
    finishes the run, with every epoch in metrics.csv."""
    from yolo5l.tracking.loggers import read_metrics_csv

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "yolo5l.train", *SMOKE, "trainer.accelerator=cpu", "trainer.devices=2",
           f"hydra.run.dir={run}", f"data.synthetic.root={synthetic}", *_signal_args("SIGKILL")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
    last = run / "checkpoints" / "last.ckpt"
    assert r.returncode == EXIT_RANK_LOST, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("DDP rank lost at epoch 1: rank 1 (pid ")
    assert line.endswith(
        ") was killed by SIGKILL (the kernel's out-of-memory killer sends SIGKILL: see dmesg); the job stops; resume "
        f"from the last complete checkpoint: python -m yolo5l.train resume={shown_path(last)}"
    )
    assert not list((run / "checkpoints").glob(".*.tmp"))

    resume = [sys.executable, "-m", "yolo5l.train", f"resume={last}", "+callbacks.signal.epoch=99"]  # no kill now
    r = subprocess.run(resume, capture_output=True, text=True, timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics_csv(run / "metrics.csv")
    assert [row["epoch"] for row in rows] == ["0", "1"]
    assert all(row["val/map"] != "" for row in rows)  # each epoch whole: trained and validated


@pytest.mark.slow
def test_rank_lost_without_an_observer(tmp_path, synthetic):
    """Two "nodes" started as torchrun would start them (LOCAL_RANK, NODE_RANK, MASTER_ADDR set: no Lightning
    launcher, no observer). Node 1 stops answering during epoch 1 (SIGSTOP: alive, sockets open, as a hung node);
    node 0 waits collective_timeout_s=10 in its next collective, then stops with the line and status 75."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    args = [*SMOKE, "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=2", "trainer.strategy=ddp",
            f"data.synthetic.root={synthetic}", "callbacks.lost_rank.collective_timeout_s=10",
            *_signal_args("SIGSTOP")]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "yolo5l.train", *args, f"hydra.run.dir={tmp_path / f'node{n}'}"],
            env={**env, "NODE_RANK": str(n), "RANK": str(n)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for n in (1, 0)
    ]  # fmt: skip
    try:
        _, err = nodes[1].communicate(timeout=900)
    finally:
        nodes[0].send_signal(signal.SIGKILL)
        nodes[0].communicate()
    last = tmp_path / "node0" / "checkpoints" / "last.ckpt"
    assert nodes[1].returncode == EXIT_RANK_LOST, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "DDP rank lost at epoch 1: rank 0 waited 10 s (callbacks.lost_rank.collective_timeout_s) for another rank in "
        "a collective: that rank died, hangs or lost its node; the job stops; resume from the last complete "
        f"checkpoint: python -m yolo5l.train resume={shown_path(last)}"
    )
