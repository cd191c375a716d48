"""Benchmark the fused kernels of ``yolo5l_kernels`` against their unfused equivalents.

Prints forward+backward medians and speed-ups (unfused time / fused time) for:

- CIoU at N = 1e3, 1e4, 1e5: the reference (a chain of small torch ops with an autograd backward) and
  torchvision's ``complete_box_iou_loss`` vs the fused backends (``cpu``, ``compiled`` on the CPU; ``triton`` on
  CUDA);
- nearest-2x upsample of a (16, 32, 80, 80) tensor (YOLOv5s's first P4->P3 upsample at batch 16, 640 px):
  ``F.interpolate`` vs ``upsample_nearest2x``, contiguous and channels_last;
- BatchNorm (training) + SiLU over the 57 Conv blocks of yolov5s at 320 px, batch 16, channels_last, bf16 and
  fp32: ``F.silu(bn(x))`` (under autocast for bf16) vs ``yolo5l_kernels.bn_silu`` (CPU only), alternating;
- one yolov5s-like ``Conv`` block (3x3 conv, BatchNorm, SiLU; batch 16, 64 channels, 80x80, channels_last) in
  training, bf16 autocast and fp32, eager vs ``torch.compile`` (inductor), each with PyTorch's BatchNorm + SiLU and
  with the fused op (``fused_bn_act``), then the block without its conv (CPU only, skipped by ``--no-compile``).

Usage: ``python scripts/bench_kernels.py [--threads 1] [--repeats 20] [--no-compile] [--only bn_silu|conv_compile]
[--clock thread]``.
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

from yolo5l.models.common import Conv


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # timing needs the queued kernels to finish


# What the medians measure: wall time, or with --clock thread the CPU time of this thread (one torch thread only),
# which a busy neighbour on a shared machine does not inflate by descheduling it.
_clock: Callable[[], float] = time.perf_counter


def _median_us(fn: Callable[[], None], device: str, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = _clock()
        fn()
        _sync(device)
        times.append(_clock() - t0)
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


def _yolov5s_bn_inputs(imgsz: int = 320, batch: int = 16) -> list[tuple[int, ...]]:
    """Shapes of the BatchNorm inputs of yolov5s at this size (one forward with hooks)."""
    from yolo5l.models.yolo import YOLOv5

    model = YOLOv5.from_name("yolov5s", num_classes=80).to(memory_format=torch.channels_last).train()
    shapes: list[tuple[int, ...]] = []
    hooks = [
        m.bn.register_forward_hook(lambda mod, inp, out: shapes.append(tuple(inp[0].shape)))
        for m in model.modules()
        if isinstance(m, Conv) and m.bn is not None
    ]
    with torch.no_grad():
        model(torch.zeros(batch, 3, imgsz, imgsz).contiguous(memory_format=torch.channels_last))
    for h in hooks:
        h.remove()
    return shapes


def bench_bn_silu(repeats: int, imgsz: int = 320, batch: int = 16) -> None:
    from yolo5l_kernels.bn_silu import bn_silu, fused_available

    if not fused_available():
        print("\nBatchNorm + SiLU: fused kernel unavailable (no C compiler), skipped")
        return
    shapes = _yolov5s_bn_inputs(imgsz, batch)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"\nBatchNorm (train) + SiLU forward+backward over yolov5s's {len(shapes)} Conv blocks at {imgsz} px,")
    nt = torch.get_num_threads()
    print(f"batch {batch} ({n / 1e6:.1f} M activations), channels_last, {nt} thread(s) (median ms)")
    print(f"{'dtype':>10} {'unfused':>9} {'fused':>9} {'speed-up':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        xs = [torch.randn(s).to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_() for s in shapes]
        gs = [torch.randn(s).to(dtype).contiguous(memory_format=torch.channels_last) for s in shapes]
        bns = [torch.nn.BatchNorm2d(s[1], eps=1e-3, momentum=0.03) for s in shapes]

        def unfused(xs=xs, gs=gs, bns=bns, dtype=dtype) -> None:
            for x, g, bn in zip(xs, gs, bns, strict=True):
                with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
                    z = F.silu(bn(x))
                z.backward(g)

        def fused(xs=xs, gs=gs, bns=bns) -> None:
            for x, g, bn in zip(xs, gs, bns, strict=True):
                bn_silu(x, bn).backward(g)

        t_u, t_f = [], []
        for _ in range(3):  # alternate, so that a busy neighbour slows both
            t_u.append(_median_us(unfused, "cpu", max(repeats // 4, 2), warmup=1))
            t_f.append(_median_us(fused, "cpu", max(repeats // 4, 2), warmup=1))
        u, f = statistics.median(t_u) / 1e3, statistics.median(t_f) / 1e3
        print(f"{str(dtype).removeprefix('torch.'):>10} {u:>9.1f} {f:>9.1f} {u / f:>9.2f}")


def bench_conv_compile(repeats: int, batch: int = 16, channels: int = 64, size: int = 80) -> None:
    """One Conv block forward+backward: eager vs torch.compile, with and without the fused BatchNorm + SiLU op.

    Then the same block without its conv (BatchNorm + SiLU alone), where the conv does not hide the difference.
    """
    from yolo5l_kernels.bn_silu import fused_available

    fused_modes = (False, True) if fused_available() else (False,)
    shape = (batch, channels, size, size)
    nt = torch.get_num_threads()
    header = "".join(
        f" {'eager ' + n:>14} {'compiled ' + n:>15} {'speed-up':>9} {'compile':>8}" for n in ("unfused", "fused")
    )
    for with_conv in (True, False):
        what = "Conv block (3x3 conv, BatchNorm, SiLU)" if with_conv else "The block without its conv (BatchNorm, SiLU)"
        print(f"\n{what} forward+backward in training, {shape} channels_last,")
        print(f"{nt} thread(s) (median ms; speed-up = eager / compiled; compile = first compiled call, s)")
        print(f"{'dtype':>10}{header}")
        for dtype in (torch.bfloat16, torch.float32):
            bf16 = dtype == torch.bfloat16
            # The block's input is the previous block's output: bf16 under autocast.
            x = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
            g = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
            row = f"{str(dtype).removeprefix('torch.'):>10}"
            for fused in fused_modes:
                torch.manual_seed(0)
                block = Conv(channels, channels, 3).to(memory_format=torch.channels_last).train()
                if not with_conv:
                    block.conv = torch.nn.Identity()
                block.fused_bn_act = fused
                torch._dynamo.reset()  # a fresh compile per variant, timed
                compiled = torch.compile(block)

                def step(f: Callable[[torch.Tensor], torch.Tensor], x=x, g=g, bf16=bf16) -> None:
                    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                        z = f(x)
                    x.grad = None  # a fresh input gradient each step, as in a network
                    z.backward(g)

                t0 = time.perf_counter()
                step(compiled)
                t_compile = time.perf_counter() - t0
                t_e, t_c = [], []
                n = max(repeats // 4, 2)
                for _ in range(3):  # alternate, so that a busy neighbour slows both
                    t_e.append(_median_us(lambda block=block, step=step: step(block), "cpu", n, 1))
                    t_c.append(_median_us(lambda c=compiled, step=step: step(c), "cpu", n, 1))
                e, c = statistics.median(t_e) / 1e3, statistics.median(t_c) / 1e3
                row += f" {e:>14.1f} {c:>15.1f} {e / c:>9.2f} {t_compile:>8.1f}"
            print(row)
    if len(fused_modes) == 1:
        print("(fused op unavailable: no C compiler)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared machine)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (CIoU backend, Conv block)")
    p.add_argument("--only", choices=("all", "ciou", "upsample", "bn_silu", "conv_compile"), default="all")
    p.add_argument("--imgsz", type=int, default=320, help="BatchNorm + SiLU: yolov5s's shapes at this image size")
    p.add_argument("--batch", type=int, default=16, help="BatchNorm + SiLU, Conv block: this batch")
    p.add_argument("--conv-channels", type=int, default=64, help="Conv block: channels in and out")
    p.add_argument("--conv-size", type=int, default=80, help="Conv block: height and width")
    p.add_argument(
        "--clock", choices=("wall", "thread"), default="wall", help="thread: this thread's CPU time (needs --threads 1)"
    )
    args = p.parse_args()
    if args.clock == "thread":
        if args.threads != 1:
            p.error("--clock thread counts this thread only: use it with --threads 1")
        global _clock
        _clock = time.thread_time
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} CPU thread(s), {args.repeats} repeats, {args.clock} clock")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        if args.only in ("all", "ciou"):
            if not args.no_compile and device == "cpu":
                t0 = time.perf_counter()
                b1, b2 = _boxes(1000, "cpu")
                ciou_xywh(b1, b2, backend="compiled").sum().backward()
                print(f"torch.compile of the CIoU forward+backward (first call): {time.perf_counter() - t0:.1f} s")
            bench_ciou(device, args.repeats, not args.no_compile)
        if args.only in ("all", "upsample"):
            bench_upsample(device, args.repeats)
        if args.only in ("all", "bn_silu") and device == "cpu":
            bench_bn_silu(args.repeats, args.imgsz, args.batch)
        if args.only in ("all", "conv_compile") and device == "cpu" and not args.no_compile:
            bench_conv_compile(args.repeats, args.batch, args.conv_channels, args.conv_size)


if __name__ == "__main__":
    main()
