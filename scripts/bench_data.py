"""Training-pipeline throughput: images/s and peak memory for cache none/ram/disk x workers 0/1/2.

Mosaic on, default (scratch-low) hyp, on the synthetic dataset. Each config builds its own YOLODataModule,
fills its cache (not timed), skips ``--warmup`` batches (worker start-up) and times ``--batches`` batches.
Peak memory is the largest PSS sum of this process and its worker processes, sampled every 250 ms.

    python scripts/bench_data.py                       # imgsz 320, batch 16, 12 timed batches per config
    python scripts/bench_data.py --batches 30 --workers 0 2 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from yolo5l.data.datamodule import YOLODataModule


class PeakRSS:
    """Samples the memory of this process plus its children in a thread; ``peak`` in bytes.

    Uses PSS (proportional set size: shared pages split between the processes that map them) where the OS
    reports it, since an RSS sum counts the torch libraries and copy-on-write cache pages once per worker.
    """

    def __init__(self, interval: float = 0.25) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _mem(proc: psutil.Process) -> int:
        try:
            return proc.memory_full_info().pss
        except (AttributeError, psutil.AccessDenied):
            return proc.memory_info().rss

    def _sample(self) -> int:
        total = self._mem(self._proc)
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


def bench(args: argparse.Namespace, cache: str, workers: int, cache_dir: str) -> tuple[float, float, float]:
    dm = YOLODataModule(
        synthetic={"root": args.root, "num_train": args.num_train, "num_val": 16, "seed": 0},
        imgsz=args.imgsz, batch_size=args.batch, num_workers=workers, cache=cache, cache_dir=cache_dir,
        persistent_workers=workers > 0, pin_memory=False, seed=0,
    )  # fmt: skip
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        dm.setup("fit")
        fill_s = time.perf_counter() - t0
        it = iter(dm.train_dataloader())
        for _ in range(args.warmup):
            next(it)
        n = 0
        t0 = time.perf_counter()
        for _ in range(args.batches):
            try:
                images = next(it)[0]
            except StopIteration:
                it = iter(dm.train_dataloader())
                images = next(it)[0]
            n += images.shape[0]
        dt = time.perf_counter() - t0
        del it
    gc.collect()
    return n / dt, mem.peak / 2**20, fill_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="datasets/synthetic", help="synthetic dataset folder (generated if missing)")
    p.add_argument("--num-train", type=int, default=512)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=12, help="timed batches per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first (worker start-up)")
    p.add_argument("--caches", nargs="+", default=["none", "ram", "disk"])
    p.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"imgsz {args.imgsz}, batch {args.batch}, mosaic on (scratch-low hyp), {args.batches} timed batches/config, "
          f"{psutil.cpu_count()} CPUs, synthetic dataset {args.num_train} train images at {Path(args.root).absolute()}")
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


if __name__ == "__main__":
    main()
