"""Training speed on a shared machine: yolo5l and ultralytics/yolov5 v7.0, each alone and each beside a neighbour.

Every run is the one-epoch training command of scripts/bench_train.py's ``--reference`` comparison (yolov5s, 320 px,
batch 16, the synthetic dataset; yolo5l ``python -m yolo5l.train trainer.max_epochs=1`` with its defaults, the
reference through scripts/bench_reference.py with 2 workers), timed from the command to its exit. Each subject runs
alone and beside each neighbour, in alternation, ``--rounds`` times; the best time of each (subject, condition) is
kept, so a pause of the host hurts neither side. The neighbours, started before the subject and stopped after it:

- ``spin``: one core of pure-Python busy loop (a compile, a data-preparation job);
- ``torch``: an unrelated PyTorch job, a small CNN trained in a loop with torch's default threads (all cores);
- ``yolo5l``: a second ``python -m yolo5l.train`` (the issue's Hydra-multirun / two-users case).

Reported per subject and condition: the wall time, the steady training images/s, the CPU seconds the run used (user
+ system, its loader workers included) and the scheduler's run delay of its main process (seconds its threads were
runnable but waited for a core, read from /proc while it runs); the slowdown against the subject alone; and yolo5l's
lead (reference time / yolo5l time) in each condition. ``--variant NAME=OVERRIDES`` adds yolo5l configurations to
compare in the same command, e.g. ``--variant fixed=callbacks.cpu_threads.adaptive=false`` (the thread count fixed,
as before the adaptive callback).

    python scripts/bench_contention.py --rounds 2 --variant fixed=callbacks.cpu_threads.adaptive=false

``--pairs`` measures instead two yolo5l trainings on one host against the same two one after the other: two
commands started together, a Hydra multirun of two jobs on the joblib launcher (``hydra/launcher=joblib
hydra.launcher.n_jobs=2``), and one epoch as 2 DDP ranks over gloo against one process.

    python scripts/bench_contention.py --pairs --rounds 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reference import DEFAULT_REF_PYTHON, INSTALL_HINT  # noqa: E402

TORCH_JOB = r"""
import torch, torch.nn as nn
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x, y = torch.randn(16, 3, 96, 96), torch.randint(0, 10, (16,))
while True:
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
"""


def _run_delay(pid: int) -> float | None:
    """Run delay (s) summed over the live threads of `pid` (None once it is gone)."""
    total, seen = 0, False
    for f in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(f.read_text().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if seen else None


def timed(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> dict[str, float]:
    """Run `cmd` to its end: wall time, CPU seconds of it and its children, run delay of its main process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        delay = [0.0]

        def poll() -> None:  # threads that have ended take their counts with them: keep the largest sum seen
            while proc.poll() is None:
                d = _run_delay(proc.pid)
                if d is not None:
                    delay[0] = max(delay[0], d)
                time.sleep(0.5)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        code = proc.wait()
        poller.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"code": code, "wall_s": wall, "cpu_s": cpu, "run_delay_s": delay[0]}


def yolo5l_run(args: argparse.Namespace, overrides: list[str], work: Path, tag: str) -> dict[str, Any]:
    run_dir = work / f"yolo5l_{tag}"
    cmd = [sys.executable, "-m", "yolo5l.train", "trainer.max_epochs=1", f"hydra.run.dir={run_dir}"]
    cmd += [f"data.synthetic.root={args.data_root}", *args.yolo5l_args, *overrides]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    rec = timed(cmd, env, REPO, work / f"yolo5l_{tag}.log")
    csv = run_dir / "metrics.csv"
    if csv.is_file():
        import csv as csvlib

        rows = [r for r in csvlib.DictReader(csv.open()) if r.get("train/images_per_sec")]
        if rows:
            rec["train_img_s"] = float(rows[-1]["train/images_per_sec"])
    log = (work / f"yolo5l_{tag}.log").read_text(errors="replace")
    rec["thread_changes"] = log.count("intra-op threads:")
    return rec


def reference_run(args: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    out = work / f"ref_{tag}.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_reference.py"), "--ref-python", args.ref_python]
    cmd += ["--data-root", str(args.data_root), "--workers", "2", "--no-val", "--no-fwd-bwd", "--json", str(out)]
    rec = timed(cmd, dict(os.environ), REPO, work / f"ref_{tag}.log")
    if out.is_file():
        run = (json.loads(out.read_text()).get("runs") or [{}])[0]
        rec["wall_s"] = run.get("wall_s", math.nan)  # the training command alone, not the wrapper's set-up
        rec["train_img_s"] = run.get("train_img_s", math.nan)
    else:
        rec["wall_s"] = math.nan
    return rec


def start_neighbour(kind: str, args: argparse.Namespace, work: Path) -> subprocess.Popen | None:
    if kind == "alone":
        return None
    if kind == "spin":
        cmd = [sys.executable, "-c", "while True: pass"]
    elif kind == "torch":
        cmd = [sys.executable, "-c", TORCH_JOB]
    elif kind == "yolo5l":
        cmd = [sys.executable, "-m", "yolo5l.train", "trainer.max_epochs=1000", f"hydra.run.dir={work / 'neighbour'}"]
        cmd += [f"data.synthetic.root={args.data_root}"]
    else:
        raise SystemExit(f"unknown neighbour {kind!r}: use spin, torch or yolo5l")
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    time.sleep(args.settle if kind == "yolo5l" else 2.0)  # a training neighbour is past its start-up
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _yolo5l_cmd(args: argparse.Namespace, run_dir: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "yolo5l.train", "trainer.max_epochs=1", f"data.synthetic.root={args.data_root}"]
    return [*cmd, *args.yolo5l_args, *extra, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}"]


def pairs(args: argparse.Namespace, work: Path) -> None:
    """Two trainings on one host against the same two one after the other (see the module docstring)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        for seed in (0, 1):
            timed(_yolo5l_cmd(args, work / f"seq{r}{seed}", f"seed={seed}"), env, REPO, work / "seq.log")
        rows.setdefault("two runs one after the other", []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(_yolo5l_cmd(args, work / f"par{r}{seed}", f"seed={seed}"), env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for seed in (0, 1)
        ]  # fmt: skip
        codes = [p.wait() for p in procs]
        rows.setdefault("two runs started together", []).append(
            time.perf_counter() - t0 if not any(codes) else math.nan
        )
        cmd = _yolo5l_cmd(args, work / f"joblib{r}", "seed=0,1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
        cmd.insert(3, "--multirun")  # before the overrides: Hydra's parser takes no option between them
        rec = timed(cmd, env, REPO, work / "joblib.log")
        rows.setdefault("a multirun of two jobs (joblib, n_jobs=2)", []).append(
            rec["wall_s"] if not rec["code"] else math.nan
        )
        one = timed(_yolo5l_cmd(args, work / f"one{r}"), env, REPO, work / "one.log")
        rows.setdefault("one epoch, one process", []).append(one["wall_s"] if not one["code"] else math.nan)
        ddp = timed(_yolo5l_cmd(args, work / f"ddp{r}", "trainer.accelerator=cpu", "trainer.devices=2"), env, REPO,
                    work / "ddp.log")  # fmt: skip
        rows.setdefault("one epoch, 2 DDP ranks (gloo)", []).append(ddp["wall_s"] if not ddp["code"] else math.nan)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in rows.items()), flush=True)
    print("\n| two trainings on one host | best wall s |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {min(v):.1f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--neighbours", default="spin,yolo5l", help="comma-separated: spin, torch, yolo5l")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDE[,OVERRIDE...]: another yolo5l")
    p.add_argument("--no-reference", action="store_true", help="yolo5l only")
    p.add_argument("--ref-python", default=DEFAULT_REF_PYTHON)
    p.add_argument("--data-root", type=Path, default=REPO / "datasets" / "synthetic")
    p.add_argument("--yolo5l-args", nargs="*", default=[], help="overrides for every yolo5l run")
    p.add_argument("--settle", type=float, default=25.0, help="seconds a training neighbour runs before a subject")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--pairs", action="store_true", help="two yolo5l trainings on one host (see the docstring)")
    args = p.parse_args(argv)
    unknown = [n for n in args.neighbours.split(",") if n and n not in ("spin", "torch", "yolo5l")]
    if unknown:  # before any run, not after the first one
        p.error(f"unknown neighbour(s) {', '.join(unknown)}: use spin, torch or yolo5l")
    if args.pairs:
        with tempfile.TemporaryDirectory(prefix="bench_pairs_") as tmp:
            pairs(args, Path(tmp))
        return

    subjects: list[tuple[str, list[str] | None]] = [("yolo5l", [])]
    for v in args.variant:
        name, _, over = v.partition("=")
        subjects.append((f"yolo5l:{name}", [o for o in over.split(",") if o]))
    if not args.no_reference:
        if not Path(args.ref_python).exists():
            raise SystemExit(f"the reference's venv is missing ({args.ref_python}); create it with:\n  {INSTALL_HINT}")
        subjects.append(("reference", None))
    conditions = ["alone", *[n for n in args.neighbours.split(",") if n]]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_contention_") as tmp:
        work = Path(tmp)
        # The dataset and its caches exist before anything is timed.
        subprocess.run(
            [sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"hydra.run.dir={work / 'warm'}",
             f"data.synthetic.root={args.data_root}"], cwd=REPO, capture_output=True, check=False,
        )  # fmt: skip
        for r in range(args.rounds):
            for cond in conditions:
                for name, over in subjects:
                    neighbour = start_neighbour(cond, args, work)
                    try:
                        tag = f"{name.replace(':', '_')}_{cond}_{r}"
                        rec = reference_run(args, work, tag) if over is None else yolo5l_run(args, over, work, tag)
                    finally:
                        stop(neighbour)
                    results.setdefault((name, cond), []).append(rec)
                    print(
                        f"round {r} {cond:>7} {name:<16} wall {rec['wall_s']:6.1f} s, train "
                        f"{rec.get('train_img_s', math.nan):5.1f} img/s, cpu {rec['cpu_s']:6.1f} s, run delay "
                        f"{rec['run_delay_s']:6.1f} s" + (f", exit {rec['code']}" if rec["code"] else ""),
                        flush=True,
                    )
    report(results, subjects, conditions)
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in results.items()}, indent=1))


def report(results: dict, subjects: list, conditions: list[str]) -> None:
    def best(name: str, cond: str) -> dict[str, Any]:
        runs = [r for r in results.get((name, cond), []) if not math.isnan(r["wall_s"]) and not r["code"]]
        return min(runs, key=lambda r: r["wall_s"]) if runs else {"wall_s": math.nan}

    print("\n| subject | neighbour | wall s | x alone | train img/s | CPU s | run delay s | lead over reference |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, _ in subjects:
        alone = best(name, "alone")["wall_s"]
        for cond in conditions:
            b = best(name, cond)
            ref = best("reference", cond)["wall_s"] if ("reference", cond) in results else math.nan
            lead = f"{ref / b['wall_s']:.2f}x" if name != "reference" and not math.isnan(ref) else ""
            print(
                f"| {name} | {cond} | {b['wall_s']:.1f} | {b['wall_s'] / alone:.2f} | "
                f"{b.get('train_img_s', math.nan):.1f} | {b.get('cpu_s', math.nan):.1f} | "
                f"{b.get('run_delay_s', math.nan):.1f} | {lead} |"
            )


if __name__ == "__main__":
    main()
