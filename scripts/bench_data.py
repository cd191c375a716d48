"""Input-pipeline throughput: yolo5l's training loader alone (no model), mosaic on, scratch-low hyp.

Three modes:

- default: images/s and peak memory for cache none/ram/disk x workers 0/1/2 on the synthetic set. Each config
  builds its own YOLODataModule, fills its cache (not timed), skips ``--warmup`` batches (worker start-up) and
  times ``--batches`` batches. Peak memory is the largest PSS sum of this process and its workers, sampled every
  250 ms.
- ``--reference``: per core, side by side with ultralytics/yolov5 v7.0 (PyPI ``yolov5==7.0.14``, its
  ``utils/dataloaders.py::create_dataloader`` / ``LoadImagesAndLabels``, in the reference venv of
  scripts/bench_reference.py). Each measurement is its own process pinned to one CPU core
  (``os.sched_setaffinity``), one torch and one OpenCV thread, loading in the main process (``workers=0`` on both
  sides), batch 16, mosaic and v7.0's augmentation, 640 px, with cache none, ram and disk, on two generated sets:
  the small synthetic images (240-400 px) and camera-sized photos (3000-4000 px JPEGs, ~2.5 MB each, a phone
  camera's size). yolo5l and the reference alternate, ``--rounds`` times each; the table gives images/s (best
  round) and the ratio. The reference's disk cache stores the full decoded image (v7.0's behaviour), yolo5l's
  the resized one.
- ``--ddp-memory``: memory of 2 DDP ranks (gloo) x 2 workers each reading the same cache on one node: the
  largest PSS sum of the ranks and their workers, and how much of the disk cache sits in the page cache
  (``fincore``). Shows that the disk cache is one copy per node, shared through memory maps.

Examples (from the repository root; the machine is shared, so read the ratios of one command):

    python scripts/bench_data.py                       # imgsz 320, batch 16, 12 timed batches per config
    python scripts/bench_data.py --batches 30 --workers 0 2 4
    python scripts/bench_data.py --reference           # ~10 minutes: the per-core table against the reference
    python scripts/bench_data.py --ddp-memory --caches disk ram
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
SETS = ("small", "camera")
# The camera-sized set: 3000-4000 px photos with objects up to 1000 px and a phone photo's JPEG size.
CAMERA = {"min_side": 3000, "max_side": 4000, "max_object_side": 1000, "noise": 10, "num_val": 4}


class PeakRSS:
    """Samples the memory of this process (``include_self``) plus its children in a thread; ``peak`` in bytes.

    Uses PSS (proportional set size: shared pages split between the processes that map them) where the OS
    reports it, since an RSS sum counts the torch libraries and copy-on-write cache pages once per worker.
    """

    def __init__(self, interval: float = 0.25, include_self: bool = True) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self.include_self = include_self
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _mem(proc: psutil.Process) -> int:
        try:
            return proc.memory_full_info().pss
        except (AttributeError, psutil.AccessDenied):
            return proc.memory_info().rss

    def _sample(self) -> int:
        total = self._mem(self._proc) if self.include_self else 0
        for child in self._proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += self._mem(child)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def _datamodule(args: argparse.Namespace, cache: str, workers: int, cache_dir: str, file: str | None = None):
    from yolo5l.data.datamodule import YOLODataModule

    synthetic = None if file else {"root": args.root, "num_train": args.num_train, "seed": 0}  # the training set
    return YOLODataModule(
        file=file, synthetic=synthetic, imgsz=args.imgsz, batch_size=args.batch, num_workers=workers, cache=cache,
        cache_dir=cache_dir, persistent_workers=workers > 0, pin_memory=False, seed=0,
    )  # fmt: skip


def _time_batches(loader_factory, warmup: int, batches: int) -> float:
    """Images/s over ``batches`` batches after ``warmup`` untimed ones (the loader is re-made at its end)."""
    it = iter(loader_factory())
    for _ in range(warmup):
        next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        try:
            images = next(it)[0]
        except StopIteration:
            it = iter(loader_factory())
            images = next(it)[0]
        n += images.shape[0]
    dt = time.perf_counter() - t0
    del it
    return n / dt


def bench(args: argparse.Namespace, cache: str, workers: int, cache_dir: str) -> tuple[float, float, float]:
    dm = _datamodule(args, cache, workers, cache_dir)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        dm.setup("fit")
        fill_s = time.perf_counter() - t0
        ips = _time_batches(dm.train_dataloader, args.warmup, args.batches)
    gc.collect()
    return ips, mem.peak / 2**20, fill_s


def table_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    print(
        f"imgsz {args.imgsz}, batch {args.batch}, mosaic on (scratch-low hyp), {args.batches} timed batches/config, "
        f"{psutil.cpu_count()} CPUs, synthetic dataset {args.num_train} train images at {Path(args.root).absolute()}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="yolo5l-bench-npy-") as cache_dir:
        for cache in args.caches:
            for workers in args.workers:
                ips, peak_mb, fill_s = bench(args, cache, workers, cache_dir)
                rows.append((cache, workers, ips, peak_mb, fill_s))
                print(f"  {cache:>4} workers={workers}: {ips:7.1f} img/s, peak PSS {peak_mb:7.0f} MiB", flush=True)
    print()
    print("| cache | workers | images/s | peak PSS (MiB, process tree) | cache fill (s) |")
    print("|---|---:|---:|---:|---:|")
    for cache, workers, ips, peak_mb, fill_s in rows:
        print(f"| {cache} | {workers} | {ips:.1f} | {peak_mb:.0f} | {fill_s:.1f} |")


# --------------------------------------------------------------------------------------------- --reference
# Runs in the reference's venv: v7.0's own loader, in the main process, on one core.
REF_CHILD = r"""
import json, os, sys, time
cfg = json.loads(open(sys.argv[1]).read())
os.sched_setaffinity(0, {cfg["core"]})
import cv2, torch, yaml
torch.set_num_threads(1)
from yolov5.utils.dataloaders import create_dataloader
import yolov5
cv2.setNumThreads(1)
hyp = yaml.safe_load(open(os.path.join(os.path.dirname(yolov5.__file__), "data", "hyps", "hyp.scratch-low.yaml")))
t0 = time.perf_counter()
loader, dataset = create_dataloader(
    cfg["train"], cfg["imgsz"], cfg["batch"], 32, hyp=hyp, augment=True, cache=cfg["cache"] or False, rect=False,
    workers=0, prefix="", shuffle=True, seed=0,
)
fill_s = time.perf_counter() - t0
it = iter(loader)
for _ in range(cfg["warmup"]):
    next(it)
n, t0 = 0, time.perf_counter()
for _ in range(cfg["batches"]):
    try:
        images = next(it)[0]
    except StopIteration:
        it = iter(loader)
        images = next(it)[0]
    n += images.shape[0]
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"ips": n / dt, "fill_s": fill_s, "cache": getattr(dataset, "cache_images", None)}))
"""


def ours_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """yolo5l's loader on one core (the per-core run of ``--reference``)."""
    os.sched_setaffinity(0, {cfg["core"]})
    torch.set_num_threads(1)
    import cv2

    cv2.setNumThreads(1)
    args = argparse.Namespace(imgsz=cfg["imgsz"], batch=cfg["batch"], root=None, num_train=None)
    dm = _datamodule(args, cfg["cache"], 0, cfg["cache_dir"], file=cfg["yaml"])
    t0 = time.perf_counter()
    dm.setup("fit")
    fill_s = time.perf_counter() - t0
    ips = _time_batches(dm.train_dataloader, cfg["warmup"], cfg["batches"])
    return {"ips": ips, "fill_s": fill_s}


def _run_child(argv: list[str], env: dict[str, str] | None, cwd: Path, log: Path) -> dict[str, Any] | None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}\n")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  failed (rc {proc.returncode}); see {log}", file=sys.stderr)
    return None


def _dataset_yaml(name: str, args: argparse.Namespace) -> Path:
    from yolo5l.data.synthetic import ensure_synthetic

    if name == "small":
        return Path(ensure_synthetic(args.root, num_train=args.num_train))
    print(f"camera-sized set: {args.camera_images} images of 3000-4000 px at {Path(args.camera_root).absolute()} "
          "(generated once, ~1 s an image)", flush=True)  # fmt: skip
    return Path(ensure_synthetic(args.camera_root, num_train=args.camera_images, **CAMERA))


def reference_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_reference import check_reference, prepare, ref_env

    ref_python = str(args.ref_python)
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="yolo5l-bench-data-ref-"))
    log = work / "children.log"
    version = check_reference(ref_python, work)
    report: dict[str, Any] = {"yolov5": version, "core": core, "args": {k: str(v) for k, v in vars(args).items()}}
    results: dict[str, dict[str, list[float]]] = {}
    print(
        f"per core (CPU {core}), imgsz {args.imgsz}, batch {args.batch}, workers 0, mosaic, scratch-low hyp; "
        f"reference yolov5 {version}; load average {os.getloadavg()[0]:.1f}; children's output in {log}",
        flush=True,
    )
    for set_name in args.sets:
        src_yaml = _dataset_yaml(set_name, args)
        ref_yaml = prepare(src_yaml.parent, work / set_name, ref_python, src_yaml=src_yaml)
        import yaml

        ref_train = str(Path(yaml.safe_load(ref_yaml.read_text())["path"]) / "images" / "train")
        batches = args.camera_batches if set_name == "camera" else args.batches
        for cache in args.caches:
            key = f"{set_name}/{cache}"
            results[key] = {"yolo5l": [], "reference": []}
            for r in range(args.rounds):
                with tempfile.TemporaryDirectory(prefix="yolo5l-bench-npy-") as cache_dir:
                    cfg = {
                        "core": core, "imgsz": args.imgsz, "batch": args.batch, "warmup": args.warmup,
                        "batches": batches, "cache": cache, "cache_dir": cache_dir, "yaml": str(src_yaml),
                    }  # fmt: skip
                    (work / "ours.json").write_text(json.dumps(cfg))
                    ours = _run_child([sys.executable, __file__, "--child", str(work / "ours.json")], None, REPO, log)
                ref_cfg = {**cfg, "train": ref_train, "cache": None if cache == "none" else cache}
                (work / "ref.json").write_text(json.dumps(ref_cfg))
                (work / "ref_child.py").write_text(REF_CHILD)
                ref = _run_child(
                    [ref_python, str(work / "ref_child.py"), str(work / "ref.json")], ref_env(work / set_name),
                    work / set_name, log,
                )  # fmt: skip
                for side, res in (("yolo5l", ours), ("reference", ref)):
                    if res is not None:
                        results[key][side].append(res["ips"])
                print(f"  {key:<12} round {r + 1}: yolo5l {_fmt(ours)} img/s, reference {_fmt(ref)} img/s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    report["results"] = results
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print()
    print("| set | cache | yolo5l img/s | reference img/s | ratio |")
    print("|---|---|---:|---:|---:|")
    for key, res in results.items():
        set_name, cache = key.split("/")
        ours_best, ref_best = max(res["yolo5l"], default=0.0), max(res["reference"], default=0.0)
        ratio = f"{ours_best / ref_best:.2f}x" if ours_best and ref_best else "-"
        print(f"| {set_name} | {cache} | {ours_best:.1f} | {ref_best:.1f} | {ratio} |")
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def _fmt(res: dict[str, Any] | None) -> str:
    return "failed" if res is None else f"{res['ips']:.1f}"


# --------------------------------------------------------------------------------------------- --ddp-memory
def _ddp_rank(rank: int, world: int, port: int, cfg: dict[str, Any], queue) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        args = argparse.Namespace(**cfg["args"])
        dm = _datamodule(args, cfg["cache"], cfg["workers"], cfg["cache_dir"])
        if rank == 0:
            dm.prepare_data()
        torch.distributed.barrier()
        dm.setup("fit")
        torch.distributed.barrier()
        if rank == 0:
            queue.put("filled")
        ips = _time_batches(dm.train_dataloader, args.warmup, args.batches)
        del dm
        gc.collect()  # the persistent workers stop here, before the process group goes
        torch.distributed.barrier()
        queue.put(ips)
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _page_cache_bytes(folder: str) -> int | None:
    """Bytes of the files under ``folder`` resident in the page cache (util-linux ``fincore``), None without it."""
    files = [str(p) for p in Path(folder).rglob("*.npy")]
    if not files or shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True,
                         text=True).stdout  # fmt: skip
    return sum(int(v) for v in out.split() if v.isdigit())


def ddp_memory_main(args: argparse.Namespace) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"2 gloo ranks x {args.ddp_workers} workers, imgsz {args.imgsz}, batch {args.batch} in all, "
          f"synthetic set of {args.num_train} train images at {Path(args.root).absolute()}", flush=True)  # fmt: skip
    from yolo5l.data.synthetic import ensure_synthetic

    ensure_synthetic(args.root, num_train=args.num_train)
    rows = []
    for cache in args.caches:
        with tempfile.TemporaryDirectory(prefix="yolo5l-bench-npy-") as cache_dir:
            cfg = {"cache": cache, "workers": args.ddp_workers, "cache_dir": cache_dir,
                   "args": {k: v for k, v in vars(args).items() if k in ("root", "num_train", "imgsz", "batch",
                                                                        "warmup", "batches")}}  # fmt: skip
            queue, port = ctx.Queue(), _free_port()
            procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, cfg, queue)) for r in range(2)]
            for p in procs:
                p.start()
            assert queue.get(timeout=1800) == "filled"
            with PeakRSS(include_self=False) as mem:
                rates = [queue.get(timeout=1800) for _ in range(2)]
                resident = _page_cache_bytes(cache_dir) if cache == "disk" else None
            for p in procs:
                p.join()
            need = sum(f.stat().st_size for f in Path(cache_dir).rglob("*.npy"))
        rows.append((cache, mem.peak / 2**20, sum(rates), need / 2**20, resident))
        print(f"  {cache:>4}: peak PSS {mem.peak / 2**20:7.0f} MiB, {sum(rates):.1f} img/s", flush=True)
    print()
    print(
        "| cache | peak PSS of 2 ranks x workers (MiB) | images/s, both ranks | .npy files (MiB) | page-cached (MiB) |"
    )
    print("|---|---:|---:|---:|---:|")
    for cache, peak, ips, need_mb, resident in rows:
        res = "-" if resident is None else f"{resident / 2**20:.0f}"
        npy = f"{need_mb:.0f}" if cache == "disk" else "-"
        print(f"| {cache} | {peak:.0f} | {ips:.1f} | {npy} | {res} |")


def build_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_reference import DEFAULT_REF_PYTHON

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="datasets/synthetic", help="synthetic dataset folder (generated if missing)")
    p.add_argument("--num-train", type=int, default=512)
    p.add_argument("--imgsz", type=int, default=None, help="default 320, and 640 with --reference / --ddp-memory")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=12, help="timed batches per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first (worker start-up)")
    p.add_argument("--caches", nargs="+", default=["none", "ram", "disk"], choices=("none", "ram", "disk"))
    p.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    ref = p.add_argument_group("--reference: per core against ultralytics/yolov5 v7.0")
    ref.add_argument("--reference", action="store_true")
    ref.add_argument("--ref-python", default=DEFAULT_REF_PYTHON, help="python of the reference's venv")
    ref.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ref.add_argument("--camera-root", default="datasets/camera", help="camera-sized set folder (generated if missing)")
    ref.add_argument("--camera-images", type=int, default=48)
    ref.add_argument("--camera-batches", type=int, default=2, help="timed batches per config on the camera set")
    ref.add_argument("--rounds", type=int, default=2, help="alternating runs of each side per config")
    ref.add_argument("--core", type=int, default=None, help="CPU to pin to (default: the last one allowed)")
    ref.add_argument("--json", type=Path, default=None, help="also write the results here")
    ref.add_argument("--keep", action="store_true", help="keep the work folder (children's logs)")
    ddp = p.add_argument_group("--ddp-memory: 2 gloo ranks x workers on one node")
    ddp.add_argument("--ddp-memory", action="store_true")
    ddp.add_argument("--ddp-workers", type=int, default=2)
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(ours_child(json.loads(args.child.read_text()))), flush=True)
        return
    if args.imgsz is None:
        args.imgsz = 640 if (args.reference or args.ddp_memory) else 320
    if args.reference:
        reference_main(args)
    elif args.ddp_memory:
        ddp_memory_main(args)
    else:
        table_main(args)


if __name__ == "__main__":
    main()
