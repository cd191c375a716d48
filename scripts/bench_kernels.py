"""Benchmark the fused kernels of ``yolo5l_kernels`` against their unfused equivalents.

Prints forward+backward medians and speed-ups (unfused time / fused time) for:

- CIoU at N = 1e3, 1e4, 1e5: the reference (a chain of small torch ops with an autograd backward) and
  torchvision's ``complete_box_iou_loss`` vs the fused backends (``cpu``, ``compiled`` on the CPU; ``triton`` on
  CUDA);
- nearest-2x upsample of a (16, 32, 80, 80) tensor (YOLOv5s's first P4->P3 upsample at batch 16, 640 px):
  ``F.interpolate`` vs ``upsample_nearest2x``, contiguous and channels_last.

Usage: ``python scripts/bench_kernels.py [--threads 1] [--repeats 20] [--no-compile]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torchvision.ops import complete_box_iou_loss
from yolo5l_kernels.ciou import ciou_xywh
from yolo5l_kernels.reference import xywh_to_xyxy
from yolo5l_kernels.upsample import upsample_nearest2x


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # timing needs the queued kernels to finish


def _median_us(fn: Callable[[], None], device: str, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _boxes(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    b1 = torch.rand(n, 4, device=device)
    b1[:, 2:] = b1[:, 2:] * 0.5 + 0.02
    b2 = b1 + torch.randn(n, 4, device=device) * 0.1
    b2[:, 2:] = b2[:, 2:].abs() + 0.02
    return b1.requires_grad_(), b2


def bench_ciou(device: str, repeats: int, compile_: bool) -> None:
    fused = ["triton"] if device == "cuda" else ["cpu"] + (["compiled"] if compile_ else [])
    print(f"\nCIoU forward+backward on {device} (median us; speed-up = unfused / fused)")
    cols = " ".join(f"{b:>10} {'x ref':>6} {'x tv':>6}" for b in fused)
    print(f"{'N':>7} {'reference':>10} {'torchvision':>12} {cols}")
    for n in (1_000, 10_000, 100_000):
        b1, b2 = _boxes(n, device)
        t_ref = _median_us(
            lambda b1=b1, b2=b2: ciou_xywh(b1, b2, backend="reference").sum().backward(), device, repeats
        )
        t_tv = _median_us(
            lambda b1=b1, b2=b2: complete_box_iou_loss(xywh_to_xyxy(b1), xywh_to_xyxy(b2), reduction="sum").backward(),
            device,
            repeats,
        )
        row = f"{n:>7} {t_ref:>10.0f} {t_tv:>12.0f} "
        for b in fused:
            t = _median_us(lambda b=b, b1=b1, b2=b2: ciou_xywh(b1, b2, backend=b).sum().backward(), device, repeats)
            row += f"{t:>10.0f} {t_ref / t:>6.2f} {t_tv / t:>6.2f} "
        print(row)


def bench_upsample(device: str, repeats: int) -> None:
    print(f"\nnearest-2x upsample forward+backward, (16, 32, 80, 80) float32 on {device} (median us)")
    print(f"{'layout':>14} {'F.interpolate':>14} {'fused':>10} {'speed-up':>9}")
    for layout in ("contiguous", "channels_last"):
        x = torch.randn(16, 32, 80, 80, device=device)
        if layout == "channels_last":
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        g = torch.randn(16, 32, 160, 160, device=device).contiguous(
            memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format
        )
        t_ref = _median_us(
            lambda x=x, g=g: F.interpolate(x, scale_factor=2, mode="nearest").backward(g),
            device,
            repeats,
        )
        t_f = _median_us(
            lambda x=x, g=g: upsample_nearest2x(x, "torch" if device == "cpu" else "triton").backward(g),
            device,
            repeats,
        )
        print(f"{layout:>14} {t_ref:>14.0f} {t_f:>10.0f} {t_ref / t_f:>9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared machine)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile CIoU backend")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} CPU thread(s), {args.repeats} repeats")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        if not args.no_compile and device == "cpu":
            t0 = time.perf_counter()
            b1, b2 = _boxes(1000, "cpu")
            ciou_xywh(b1, b2, backend="compiled").sum().backward()
            print(f"torch.compile of the CIoU forward+backward (first call): {time.perf_counter() - t0:.1f} s")
        bench_ciou(device, args.repeats, not args.no_compile)
        bench_upsample(device, args.repeats)


if __name__ == "__main__":
    main()
