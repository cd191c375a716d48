"""Training input throughput of each input path alone (no model), and its DataLoader workers' CPU seconds per image.

At ``--imgsz`` 640, ``--batch`` 64, mosaic on, scratch-low hyp, no image cache, on generated JPEGs of COCO size
(sides of 480-800 px, ``--num-train`` of them in ``--root``, generated once), ``--workers`` DataLoader workers for
every row:

- ``v7.0 loader``: ultralytics/yolov5 v7.0's own ``create_dataloader`` (PyPI ``yolov5==7.0.14``, run in the reference
  venv ``.refvenv`` of scripts/bench_reference.py, as ``scripts/bench_data.py --reference`` runs it, here with
  workers); the row is skipped, with a line saying how to make the venv, when it is missing;
- ``host``: yolo5l's host pipeline (``data.pipeline=host``): the workers decode, resize, warp, jitter and flip, and
  the pixels travel;
- ``device: workers``: the device pipeline's loader alone (``data.pipeline=device`` without the device step): the
  workers read the files' bytes, draw the augmentation and do the box maths, and send ``PlanBatch`` es;
- ``device: pixels on <device>``: ``DeviceInput`` alone, making the (B, 3, H, W) uint8 images on ``--device`` from
  PlanBatches the workers made beforehand;
- ``device: end to end``: the datamodule's ``train_dataloader`` with ``pipeline="device"`` (a ``DeviceInputLoader``):
  batches with their images on the device.

The last two rows make pixels on ``--device`` at batch ``--device-batch``: ``--batch`` on CUDA; on the CPU, which
stands in for a GPU there (torch's CPU kernels, beside the workers: about 1.5 CPU seconds an image at 640 px), 4, so
that a round takes a minute or two; the images/s of those rows on the CPU say nothing of a GPU's.

Each measurement makes its loader afresh, skips ``--warmup`` batches (worker start-up, the label scan) and times
``--batches`` batches (an epoch that ends before is started again, on the same workers). The workers' CPU time is the
sum of user + system ``cpu_times`` (psutil) of the loader's worker processes (the children of the process that came
with the loader) before and after the timed batches; with ``--workers 0`` the process's own CPU time. The main
process's CPU time over the same batches is the last column (the device step on the CPU, the pin-memory thread,
receiving batches); the CPU time of the main process is what makes the images in the pixels row, which has no
workers. The rows alternate over ``--rounds`` rounds; the table gives each row's best round (highest
images/s, and that round's CPU figures), then the ratio of the device path's workers' CPU seconds per image to the
host path's (the device path's workers only read bytes and draw parameters).

Examples (from the repository root; the machine is shared, so read the ratios of one command):

    .venv/bin/python scripts/bench_input.py                      # 2 rounds, ~5 minutes on 2 CPU cores
    .venv/bin/python scripts/bench_input.py --rounds 3 --batches 8 --workers 4 --json bench_input.json
    .venv/bin/python scripts/bench_input.py --device cuda        # the device rows on the GPU, at batch 64
    .venv/bin/python scripts/bench_input.py --no-reference --workers 0 --batches 2   # the process's CPU time
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import _run_child
from bench_reference import DEFAULT_REF_PYTHON, INSTALL_HINT, check_reference, prepare, ref_env

REF, HOST, WORKERS, PIXELS = "v7.0 loader", "host", "device: workers", "device: pixels"  # the rows' names
END_TO_END = "device: end to end"
# The CPU makes the device path's pixels in about 1.5 CPU seconds an image at 640 px: its rows take this batch there.
CPU_DEVICE_BATCH = 4
ISSUE_BOUND = 0.1  # the issue's bound on device / host workers' CPU seconds per image

# Runs in the reference's venv: v7.0's own loader with `workers` workers; the same clocks as LoaderClock below.
REF_CHILD = r"""
import json, os, sys, time
cfg = json.loads(open(sys.argv[1]).read())
import psutil, torch, yaml
from yolov5.utils.dataloaders import create_dataloader
import yolov5
hyp = yaml.safe_load(open(os.path.join(os.path.dirname(yolov5.__file__), "data", "hyps", "hyp.scratch-low.yaml")))
me = psutil.Process()

def cpu(p):
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0

loader, dataset = create_dataloader(
    cfg["train"], cfg["imgsz"], cfg["batch"], 32, hyp=hyp, augment=True, cache=False, rect=False,
    workers=cfg["workers"], prefix="", shuffle=True, seed=0,
)
it = iter(loader)
for _ in range(cfg["warmup"]):
    next(it)
workers = me.children(recursive=True) if loader.num_workers else [me]
w0, m0 = [cpu(p) for p in workers], cpu(me)
n, t0 = 0, time.perf_counter()
for _ in range(cfg["batches"]):
    try:
        images = next(it)[0]
    except StopIteration:
        it = iter(loader)
        images = next(it)[0]
    n += images.shape[0]
dt = time.perf_counter() - t0
worker_s = sum(cpu(p) - c for p, c in zip(workers, w0))
print("RESULT " + json.dumps({"img_s": n / dt, "images": n, "seconds": dt, "worker_cpu_s": worker_s,
                              "main_cpu_s": cpu(me) - m0, "workers": loader.num_workers}))
"""


# --------------------------------------------------------------------------------------------- clocks
def _cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` (its own threads, not its children); 0 once it is gone."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


class LoaderClock:
    """Wall time, images, and the CPU seconds of a loader's workers and of this process between :meth:`start` and
    :meth:`stop`. Make it before the loader: the workers are the child processes that were not there then."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.before = {p.pid for p in self.me.children(recursive=True)}

    def start(self) -> None:
        self.workers = [p for p in self.me.children(recursive=True) if p.pid not in self.before] or [self.me]
        self.w0, self.m0 = [_cpu_s(p) for p in self.workers], _cpu_s(self.me)
        self.t0 = time.perf_counter()

    def stop(self, images: int, device: torch.device) -> dict[str, Any]:
        """The figures of ``images`` images made since :meth:`start` (after the device finished them)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - self.t0
        worker_s = sum(_cpu_s(p) - c for p, c in zip(self.workers, self.w0, strict=True))
        return {"img_s": images / dt, "images": images, "seconds": dt, "worker_cpu_s": worker_s,
                "main_cpu_s": _cpu_s(self.me) - self.m0, "workers": 0 if self.workers == [self.me] else
                len(self.workers)}  # fmt: skip


def _wait_for_workers_to_exit(timeout: float = 30.0) -> None:
    """Collect the last loader and wait until its worker processes are gone, so that the next row has the cores."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.05)


def time_batches(
    make_loader: Callable[[], Iterable], images_of: Callable[[Any], int], args: argparse.Namespace, warmup: int
) -> dict[str, Any]:
    """Make the loader, skip ``warmup`` batches, time ``args.batches``."""
    clock = LoaderClock()
    loader = make_loader()
    it: Iterator = iter(loader)
    for _ in range(warmup):
        next(it)
    clock.start()
    n = 0
    for _ in range(args.batches):
        try:
            batch = next(it)
        except StopIteration:  # the epoch ended: the next one, on the same (persistent) workers
            it = iter(loader)
            batch = next(it)
        n += images_of(batch)
    result = clock.stop(n, args.device)
    del it, loader, batch
    _wait_for_workers_to_exit()
    return result


# --------------------------------------------------------------------------------------------- rows
class PlanBatches:
    """The batches of a ``DeviceInputLoader`` before its device step: the iterator of the ``DataLoader`` under it,
    ``(PlanBatch, targets, paths, shapes)``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator:
        from torch.utils.data import DataLoader

        return DataLoader.__iter__(self.loader)


def _datamodule(args: argparse.Namespace, pipeline: str, batch: int):
    """A fresh ``YOLODataModule`` of the set, set up for fit (its summary lines are not printed)."""
    from yolo5l.data.datamodule import YOLODataModule

    dm = YOLODataModule(
        file=str(args.yaml), imgsz=args.imgsz, batch_size=batch, num_workers=args.workers, cache="none",
        persistent_workers=args.workers > 0, pin_memory=args.device.type == "cuda", seed=0, pipeline=pipeline,
    )  # fmt: skip
    # Without a Trainer the datamodule would pick CUDA whenever there is one; here --device decides.
    dm.train_device = lambda: args.device
    with contextlib.redirect_stdout(io.StringIO()):
        dm.setup("fit")
    return dm


def host_row(args: argparse.Namespace) -> dict[str, Any]:
    """yolo5l's host pipeline: batches of images made by the workers."""
    return time_batches(
        _datamodule(args, "host", args.batch).train_dataloader, lambda b: b[0].shape[0], args, args.warmup
    )


def workers_row(args: argparse.Namespace) -> dict[str, Any]:
    """The device pipeline's workers alone: the ``DeviceInputLoader``'s batches before the device step (the plain
    ``DataLoader`` iterator under it)."""
    dm = _datamodule(args, "device", args.batch)
    return time_batches(lambda: PlanBatches(dm.train_dataloader()), lambda b: len(b[0]), args, args.warmup)


def pixels_row(args: argparse.Namespace) -> dict[str, Any]:
    """``DeviceInput`` alone on ``args.device`` (batch ``args.device_batch``), on PlanBatches the workers made before
    (the first ``args.warmup`` untimed, at least one: first-call costs such as nvjpeg's start)."""
    from yolo5l.data.device_input import DeviceInput

    warm = max(1, args.warmup)
    loader, plans = PlanBatches(_datamodule(args, "device", args.device_batch).train_dataloader()), []
    while len(plans) < warm + args.batches:  # epoch after epoch, as many as needed
        plans.extend(b[0] for b in itertools.islice(loader, warm + args.batches - len(plans)))
    del loader
    _wait_for_workers_to_exit()
    if args.device.type == "cuda":
        plans = [p.pin_memory() for p in plans]  # as the DataLoader's pin-memory thread sends them
    device_input = DeviceInput(args.device)
    for plan in plans[:warm]:
        device_input(plan)
    timed = plans[warm:]
    clock = LoaderClock()
    clock.start()
    for plan in timed:
        device_input(plan)
    result = clock.stop(sum(len(p) for p in timed), args.device)
    result["worker_cpu_s"] = None  # no workers: the main process's CPU is the device step's (on the CPU)
    return result


def end_to_end_row(args: argparse.Namespace) -> dict[str, Any]:
    """The datamodule's training loader with ``pipeline="device"``: images on the device. The loader makes batch
    k + 1's images before it hands out batch k: after at least one untimed batch, the timed batches are as many as
    the images made in their time."""
    dm = _datamodule(args, "device", args.device_batch)
    return time_batches(dm.train_dataloader, lambda b: b[0].shape[0], args, max(1, args.warmup))


def ref_row(args: argparse.Namespace, ref: dict[str, Any]) -> dict[str, Any] | None:
    """v7.0's loader in the reference venv (None when its process failed; the log says why)."""
    cfg = {"train": ref["train"], "imgsz": args.imgsz, "batch": args.batch, "workers": args.workers,
           "warmup": args.warmup, "batches": args.batches}  # fmt: skip
    work = ref["work"]
    (work / "ref.json").write_text(json.dumps(cfg))
    (work / "ref_child.py").write_text(REF_CHILD)
    argv = [args.ref_python, str(work / "ref_child.py"), str(work / "ref.json")]
    return _run_child(argv, ref_env(work / "ref"), work / "ref", work / "children.log")


def setup_reference(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any] | None, str]:
    """The reference's view of the set (``{"train", "work", "version"}``) and "", or None and the one-line reason
    the ``v7.0 loader`` row is skipped."""
    if args.no_reference:
        return None, "skipped (--no-reference)"
    if not Path(args.ref_python).exists():
        return None, f"skipped: {args.ref_python} not found; make it with: {INSTALL_HINT}"
    (work / "ref").mkdir(parents=True, exist_ok=True)
    try:
        version = check_reference(str(args.ref_python), work / "ref")
    except SystemExit as e:  # it cannot import yolov5.train: the first line of what bench_reference says
        return None, f"skipped: {str(e.code).splitlines()[0]}; make it with: {INSTALL_HINT}"
    import yaml

    ref_yaml = prepare(args.yaml.parent, work / "ref", str(args.ref_python), src_yaml=args.yaml)
    train = str(Path(yaml.safe_load(ref_yaml.read_text())["path"]) / "images" / "train")
    return {"train": train, "work": work, "version": version}, ""


# --------------------------------------------------------------------------------------------- report
def _per_image(seconds: float | None, images: int) -> float | None:
    return None if seconds is None else seconds / images


def best_rounds(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each row's round with the highest images/s, with its CPU seconds per image."""
    best = {}
    for name, rounds in results.items():
        if rounds:
            r = max(rounds, key=lambda x: x["img_s"])
            best[name] = {**r, "worker_cpu_s_per_img": _per_image(r["worker_cpu_s"], r["images"]),
                          "main_cpu_s_per_img": _per_image(r["main_cpu_s"], r["images"])}  # fmt: skip
    return best


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(best: dict[str, dict[str, Any]], names: dict[str, str], workers: int) -> None:
    cpu_col = "worker CPU s/img" if workers else "process CPU s/img (workers 0)"
    print(f"| input path | images/s | {cpu_col} | main process CPU s/img |")
    print("|---|---:|---:|---:|")
    for key, label in names.items():
        if key in best:
            b = best[key]
            print(f"| {label} | {b['img_s']:.1f} | {_fmt(b['worker_cpu_s_per_img'], '.4f')} | "
                  f"{_fmt(b['main_cpu_s_per_img'], '.4f')} |")  # fmt: skip


def cpu_ratio(best: dict[str, dict[str, Any]]) -> float | None:
    """The device path's workers' CPU seconds per image over the host path's."""
    if WORKERS not in best or HOST not in best:
        return None
    host = best[HOST]["worker_cpu_s_per_img"]
    return best[WORKERS]["worker_cpu_s_per_img"] / host if host else None


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup is None:  # each worker's first batch carries its start-up (and its first reads of the headers)
        args.warmup = max(1, args.workers)
    if args.batches < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--batches and --rounds must be at least 1, --warmup at least 0")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    from yolo5l.data.synthetic import ensure_synthetic

    args.yaml = Path(ensure_synthetic(args.root, num_train=args.num_train, num_val=4, min_side=args.min_side,
                                      max_side=args.max_side))  # fmt: skip
    on_cpu = args.device.type == "cpu"
    if args.device_batch is None:
        args.device_batch = min(CPU_DEVICE_BATCH, args.batch) if on_cpu else args.batch
    at = f" (batch {args.device_batch})" if args.device_batch != args.batch else ""
    names = {REF: REF, HOST: HOST, WORKERS: WORKERS, PIXELS: f"{PIXELS} on {args.device}{at}",
             END_TO_END: f"{END_TO_END}{at}"}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="yolo5l-bench-input-"))
    ref, skip = setup_reference(args, work)
    print(
        f"imgsz {args.imgsz}, batch {args.batch}, mosaic on (scratch-low hyp), no cache, workers {args.workers}, "
        f"{args.warmup} + {args.batches} timed batches per row, {args.rounds} rounds; {psutil.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads, device {args.device}; {args.num_train} JPEGs of "
        f"{args.min_side}-{args.max_side} px at {args.yaml.parent}; reference: "
        f"{'yolov5 ' + ref['version'] if ref else 'skipped (see the end)'}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if on_cpu:
        print(f"'{names[PIXELS]}' and '{names[END_TO_END]}': the CPU stands in for a GPU here (torch ops on "
              f"{torch.get_num_threads()} threads, beside the workers), at batch {args.device_batch} "
              "(--device-batch): about 1.5 CPU seconds an image at 640 px", flush=True)  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    width = max(len(v) for v in names.values())
    for r in range(args.rounds):
        measures: list[tuple[str, Callable[[], dict[str, Any] | None]]] = [
            (HOST, lambda: host_row(args)),
            (WORKERS, lambda: workers_row(args)),
            (PIXELS, lambda: pixels_row(args)),
            (END_TO_END, lambda: end_to_end_row(args)),
        ]
        if ref is not None:
            measures.insert(0, (REF, lambda: ref_row(args, ref)))
        for key, measure in measures:
            res = measure()
            line = "failed" if res is None else f"{res['img_s']:7.1f} img/s"
            if res is not None:
                results[key].append(res)
                if res["worker_cpu_s"] is not None:
                    line += f", workers {res['worker_cpu_s'] / res['images']:.4f} CPU s/img"
                    if res["workers"] != args.workers:  # v7.0 caps them at the CPU count and the batch
                        line += f" (ran with {res['workers']} workers, not {args.workers})"
            print(f"  round {r + 1} {names[key]:<{width}} {line}; load {os.getloadavg()[0]:.1f}", flush=True)
    best = best_rounds(results)
    ratio = cpu_ratio(best)
    print()
    print_table(best, names, args.workers)
    if ratio is not None:
        verdict = "within" if ratio <= ISSUE_BOUND else "over"
        print(f"device workers' CPU s/img / host workers' CPU s/img = {ratio:.3f} ({verdict} the issue's bound of "
              f"{ISSUE_BOUND})")  # fmt: skip
    if ref is None:
        print(f"{REF}: {skip}")
    elif not results[REF]:
        print(f"{REF}: failed; see {work / 'children.log'}")
    if args.json:
        report = {
            "settings": {k: str(v) for k, v in vars(args).items()}, "cpus": psutil.cpu_count(),
            "torch_threads": torch.get_num_threads(), "reference": ref["version"] if ref else skip,
            "rows": {names[k]: {"rounds": results[k], "best": best.get(k)} for k in names},
            "device_over_host_worker_cpu": ratio,
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="datasets/coco-size", help="the generated set's folder (made if missing)")
    p.add_argument("--num-train", type=int, default=320, help="training JPEGs in the set")
    p.add_argument("--min-side", type=int, default=480, help="smallest image side of the set (px)")
    p.add_argument("--max-side", type=int, default=800, help="largest image side of the set (px)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of every row")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed batches first (each worker's start-up; default: one per worker, at least 1)",
    )
    p.add_argument("--batches", type=int, default=8, help="timed batches per row and round")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of the rows; the best one is reported")
    p.add_argument("--device", default=None, help="the device rows' device (default: cuda if available, else cpu)")
    p.add_argument("--device-batch", type=int, default=None,
                   help=f"batch of the rows that make pixels on --device (default: --batch; {CPU_DEVICE_BATCH} on "
                   "the CPU)")  # fmt: skip
    p.add_argument("--ref-python", default=DEFAULT_REF_PYTHON, help="python of the reference's venv")
    p.add_argument("--no-reference", action="store_true", help="leave the v7.0 loader row out")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the work folder (the reference's log)")
    return p


if __name__ == "__main__":
    main()
