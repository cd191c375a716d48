"""Training speed of yolo5l: each speed-up alone and all together, against "everything off", in one process.

For each configuration a fresh YOLODataModule + YOLOv5Module + Trainer runs a short fit (``--epochs`` epochs of
``--steps`` training batches and ``--val-images`` validation images) on the synthetic dataset and reports:

- steady training images/s (batches after ``--warmup``; each later epoch's first batch is skipped too), the share of
  that time spent waiting for data, and that rate as a share of the machine's matrix-product ceiling
  (training FLOPs per image = 3 x forward FLOPs, counted with ``FlopCounterMode``);
- validation images/s of the last validation (from its first batch to ``on_validation_end``: forward, NMS, the
  mAP computation included; the DataLoader workers' start-up and the first batch's loading left out);
- time to the first training step and whole-run wall time (build + fit, imports excluded), peak memory;
- the loss of the first and last step, to show which options leave the results unchanged.

Configurations (``--configs``, comma separated; ``all`` = every one below):

- ``default``: every speed-up on (bf16-mixed where the CPU has AMX/AVX512-BF16, 16-mixed on CUDA).
- ``default-fp32``: every speed-up except mixed precision.
- ``off``: fp32, channels-first, per-tensor EMA, reference (unfused) CIoU, per-tensor optimizer loop, unfused
  eval model at 2 x batch, TensorBoard defaults (log every step, max_queue 10, flush_secs 120), last + best
  checkpoint and validation every epoch, no image cache.
- ``+<option>``: ``off`` with one option switched to its fast value: ``+amp``, ``+channels_last``, ``+ema_foreach``,
  ``+ciou_fused``, ``+optim_fused``, ``+log_throttle``, ``+ckpt_last``, ``+val_interval``, ``+cache``,
  ``+fuse_eval``, ``+compile``, ``+malloc``, ``+bn_act`` (BatchNorm + SiLU fused, ``model.fused_bn_act``).
- ``default-compile``, ``default-unfused-bn``: the default with torch.compile on, or with BN + SiLU unfused.

Also measured: fp32 / bf16 GEMM GFLOP/s, fwd+bwd of one batch per precision and memory format (the fastest also
with yolo5l's kept host memory, `module.tune_malloc`), and micro-timings of
the EMA update, the optimizer step, gradient clipping and CIoU forward+backward. ``--e2e`` also times
``python -m yolo5l.train`` for one epoch from the command to exit (and the imports alone).

Examples (the machine is shared: compare the ratios printed, measured in the same process):

    python scripts/bench_train.py --configs default,off --steps 8            # a few minutes
    python scripts/bench_train.py --configs all --steps 16 --epochs 2 --e2e  # the full table
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Options:
    """One training configuration; the defaults are the fast choices."""

    amp: bool = True  # bf16-mixed on CPUs with AMX/AVX512-BF16, 16-mixed on CUDA; else 32-true
    channels_last: bool = True
    ema_foreach: bool = True
    ciou: str = "auto"  # "reference" = unfused autograd composition
    optimizer_impl: str = "auto"  # "loop" = torch's per-tensor implementation (its CPU default)
    log_throttle: bool = True  # log_every_n_steps 50, TB max_queue 1000 / flush_secs 30 (off: 1, 10 / 120)
    ckpt_last_only: bool = True  # off: last.ckpt and best.ckpt every epoch (YOLOv5 writes last.pt + best.pt)
    val_interval: bool = True  # validate after the last epoch only (off: every epoch)
    cache: str = "ram"
    fuse_eval: bool = True  # fused Conv+BN copy for validation (off: the training model in eval mode)
    compile: bool = False  # torch.compile the model (compile time counts in the whole-run time)
    fused_bn_act: bool = True  # BatchNorm + SiLU in one CPU kernel each way in training (yolo5l_kernels.bn_silu)
    malloc: bool = True  # glibc keeps freed host memory (yolo5l.base.hostmem); process-wide: use one process per config


OFF = Options(
    amp=False,
    channels_last=False,
    ema_foreach=False,
    ciou="reference",
    optimizer_impl="loop",
    log_throttle=False,
    ckpt_last_only=False,
    val_interval=False,
    cache="none",
    fuse_eval=False,
    malloc=False,
    fused_bn_act=False,
)
FAST = Options()
TOGGLES: dict[str, dict[str, Any]] = {
    "+amp": {"amp": True},
    "+channels_last": {"channels_last": True},
    "+ema_foreach": {"ema_foreach": True},
    "+ciou_fused": {"ciou": "auto"},
    "+optim_fused": {"optimizer_impl": "auto"},
    "+log_throttle": {"log_throttle": True},
    "+ckpt_last": {"ckpt_last_only": True},
    "+val_interval": {"val_interval": True},
    "+cache": {"cache": "ram"},
    "+fuse_eval": {"fuse_eval": True},
    "+compile": {"compile": True},
    "+malloc": {"malloc": True},
    "+bn_act": {"fused_bn_act": True},
}
CONFIGS: dict[str, Options] = {
    "default": FAST,
    "default-fp32": replace(FAST, amp=False),
    "default-compile": replace(FAST, compile=True),
    "default-unfused-bn": replace(FAST, fused_bn_act=False),
    "off": OFF,
    **{name: replace(OFF, **change) for name, change in TOGGLES.items()},
}


# ---------------------------------------------------------------------------------------------- hardware
def cpu_has_bf16() -> bool:
    """AMX or AVX512-BF16 on this CPU: yolo5l.base.hardware's rule for `trainer.precision=auto` (imported lazily)."""
    from yolo5l.base.hardware import cpu_has_bf16 as has_bf16

    return has_bf16()


def amp_precision(device: str) -> str:
    if device == "cuda":
        return "16-mixed"
    return "bf16-mixed" if cpu_has_bf16() else "32-true"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _best_time(fn: Any, device: str, repeat: int, warmup: int = 1) -> float:
    """Smallest wall time of `repeat` calls (the least disturbed by other processes on a shared machine)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(dtype: torch.dtype, device: str, n: int = 2048, repeat: int = 10) -> float:
    """Matrix-product ceiling: 2 n^3 / t of an n x n x n product (best of `repeat`), the faster of two libraries.

    ``a @ b`` goes to the BLAS (MKL on the CPU), a 1x1 convolution of channels_last [1, n, 32, n/32] by [n, n, 1, 1]
    is the same product in oneDNN, which runs the model's convolutions. They differ: on an AMD EPYC of this
    machine class MKL's fp32 GEMM reached 217 GFLOP/s and oneDNN's 463, so a matmul-only ceiling put the fp32
    training step at 150% of it.
    """
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    blas = 2 * n**3 / _best_time(lambda: a @ b, device, repeat) / 1e9
    x, w = gemm_as_conv(a, b)
    conv = 2 * n**3 / _best_time(lambda: torch.nn.functional.conv2d(x, w), device, repeat) / 1e9
    return max(blas, conv)


def gemm_as_conv(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w) with ``conv2d(x, w)[0, o].flatten()[p] == (a @ b)[p, o]``: a's rows are the pixels, b the 1x1 kernel."""
    m, k = a.shape
    x = a.t().reshape(1, k, 32, m // 32).contiguous(memory_format=torch.channels_last)
    w = b.t().reshape(b.shape[1], k, 1, 1).contiguous(memory_format=torch.channels_last)
    return x, w


def forward_flops(model: torch.nn.Module, imgsz: int, device: str) -> float:
    """FLOPs of one forward pass of one image (FlopCounterMode counts a multiply-add as 2 FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(model).to(device).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        m(torch.zeros(1, 3, imgsz, imgsz, device=device))
    return float(counter.get_total_flops())


# ------------------------------------------------------------------------------------------ micro timings
def micro_timings(device: str, num_classes: int, repeat: int) -> dict[str, float]:
    """ms per call: EMA update (loop / foreach), SGD step (loop / foreach / fused), clipping, CIoU fwd+bwd."""
    from yolo5l_kernels import ciou_xywh

    from yolo5l.models.yolo import YOLOv5
    from yolo5l.training.optim import optimizer_impl_kwargs, yolov5_param_groups

    out: dict[str, float] = {}
    torch.manual_seed(0)
    model = YOLOv5.from_name("yolov5s", num_classes=num_classes).to(device)
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    ema = [t.clone() for t in floats]

    def ema_loop() -> None:
        for e, m in zip(ema, floats, strict=True):
            e.lerp_(m, 0.001)

    out["ema_loop_ms"] = 1e3 * _best_time(ema_loop, device, repeat)
    out["ema_foreach_ms"] = 1e3 * _best_time(lambda: torch._foreach_lerp_(ema, floats, 0.001), device, repeat)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    grads = [p.grad.clone() for p in params]
    for impl in ("loop", "foreach", "fused"):
        groups = yolov5_param_groups(model, 5e-4)
        opt = torch.optim.SGD(groups, lr=0.01, momentum=0.937, nesterov=True, **optimizer_impl_kwargs(impl))

        def step(opt: torch.optim.Optimizer = opt) -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad.copy_(g)  # nesterov foreach updates grads in place: restart from the same ones
            opt.step()

        copy_only = _best_time(lambda: [p.grad.copy_(g) for p, g in zip(params, grads, strict=True)], device, repeat)
        out[f"sgd_{impl}_ms"] = 1e3 * max(_best_time(step, device, repeat) - copy_only, 0.0)
    out["clip_ms"] = 1e3 * _best_time(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9), device, repeat)
    g = torch.Generator(device="cpu").manual_seed(0)
    b1 = (torch.rand(1000, 4, generator=g) * 0.5 + 0.25).to(device).requires_grad_()
    b2 = (torch.rand(1000, 4, generator=g) * 0.5 + 0.25).to(device)
    for backend in ("reference", "auto"):

        def ciou(backend: str = backend) -> None:
            (1.0 - ciou_xywh(b1, b2, backend=backend)).sum().backward()

        out[f"ciou_{backend}_ms"] = 1e3 * _best_time(ciou, device, repeat * 4, warmup=3)
    return out


def fwd_bwd_timings(
    model_fn: Any, batch: int, imgsz: int, device: str, repeat: int, flops_img: float, ceil: dict[str, float]
) -> list[dict[str, Any]]:
    """Forward + backward of one batch (random images, sum of heads as the loss) per precision and memory format.

    The variants run with glibc's default malloc first; on the CPU the fastest one then runs again after
    `yolo5l.base.hostmem.tune_malloc()` (yolo5l's default, `module.tune_malloc`), which is process-wide and cannot be
    undone, so it comes last.
    """
    from yolo5l.base.hostmem import tune_malloc

    rows = []
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    amp_ok = device == "cuda" or cpu_has_bf16()
    # (name, channels_last, amp, kept host memory, fused BN+SiLU)
    variants = [("fp32", False, False, False, False), ("fp32", True, False, False, False)]
    variants += [("amp", True, True, False, False)] if amp_ok else []
    if device == "cpu":
        variants += [(variants[-1][0], True, amp_ok, False, True), (variants[-1][0], True, amp_ok, True, True)]
    x = torch.rand(batch, 3, imgsz, imgsz, device=device)
    for name, cl, amp, malloc, bn_act in variants:
        if malloc and not tune_malloc():
            continue  # not glibc: nothing to tune
        model = model_fn(fused_bn_act=bn_act).to(device).train()
        fmt = torch.channels_last if cl else torch.contiguous_format
        model.to(memory_format=fmt)
        xx = x.contiguous(memory_format=fmt)

        def step(model: torch.nn.Module = model, xx: torch.Tensor = xx, amp: bool = amp) -> None:
            with torch.autocast(device, dtype=amp_dtype, enabled=amp):
                heads = model(xx)
            sum(h.float().sum() for h in heads).backward()

        t = _best_time(step, device, repeat)
        ips = batch / t
        ceiling = ceil["amp"] if amp else ceil["fp32"]
        rows.append(
            {
                "variant": f"{name}{' + channels_last' if cl else ''}{' + fused BN+SiLU' if bn_act else ''}"
                f"{' + kept host memory' if malloc else ''}",
                "s_per_batch": t,
                "img_s": ips,
                "ceiling_share": ips * 3 * flops_img / (ceiling * 1e9),
            }
        )
        del model
    return rows


# --------------------------------------------------------------------------------------------- the runs
class PeakMemory:
    """Peak memory of this process (RSS) plus its DataLoader workers (PSS where available), sampled in a thread every
    second; on CUDA also the peak allocated GPU memory.

    Only the workers' PSS is read: reading a process's smaps takes that process's memory-map lock, which would
    stall the training process's page faults (allocations) while the sampler walks its pages. The RAM cache
    shared copy-on-write with the workers is therefore counted in full in this process and in part in theirs.
    """

    def __init__(self, device: str, interval: float = 1.0) -> None:
        self.device, self.interval, self.peak = device, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _pss(proc: Any) -> int:
        try:
            return proc.memory_full_info().pss
        except Exception:
            return proc.memory_info().rss

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = me.memory_info().rss
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += self._pss(child)
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.gpu_peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else 0


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where getrusage is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timer_callback(profile_at: int = 0, profile_steps: int = 0) -> Any:
    from lightning.pytorch.callbacks import Callback

    class BenchTimer(Callback):
        """Host clocks at batch boundaries (no device syncs inside an epoch, one at the end of each)."""

        def __init__(self, profile_at: int = 0, profile_steps: int = 0) -> None:
            self.profile_at, self.profile_steps, self.profiler = profile_at, profile_steps, None
            self.batches: list[tuple[int, int, float, float, float]] = []  # (epoch, idx, prev_end, start, end)
            self.faults: list[int] = []  # the main process's minor page faults during each batch (same order)
            self._faults0 = 0
            self.losses: list[torch.Tensor] = []
            self.val: list[tuple[int, float]] = []
            self.first_step: float | None = None
            self._prev_end = time.perf_counter()
            self._start = 0.0
            self._val_t0 = 0.0
            self._val_images = 0

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._prev_end = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.profile_steps and trainer.current_epoch == 0 and batch_idx == self.profile_at:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                self.profiler = profile(activities=acts, record_shapes=False)
                self.profiler.__enter__()
            self._faults0 = _minor_faults()
            self._start = time.perf_counter()
            if self.first_step is None:
                self.first_step = self._start

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % 8 == 7 or batch_idx == 0:
                _sync(pl_module.device.type)  # bounds the host's run-ahead on CUDA; a no-op on the CPU
            end = time.perf_counter()
            self.batches.append((trainer.current_epoch, batch_idx, self._prev_end, self._start, end))
            self.faults.append(_minor_faults() - self._faults0)
            self._prev_end = end
            if self.profiler is not None and batch_idx == self.profile_at + self.profile_steps - 1:
                self._print_profile()
            if isinstance(outputs, torch.Tensor):
                self.losses.append(outputs.detach())
            elif isinstance(outputs, dict) and "loss" in outputs:
                self.losses.append(outputs["loss"].detach())

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if self.profiler is not None:  # the epoch ended inside the window (--profile > steps - warm-up)
                print(f"[profile] the epoch ended first: {len(self.batches)} steps profiled", flush=True)
                self._print_profile()

        def _print_profile(self) -> None:
            """Stop the profiler and print its top ops (a profiler left running past fit crashes the process)."""
            self.profiler.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            print(self.profiler.key_averages().table(sort_by=sort, row_limit=30), flush=True)
            self.profiler = None
            self.profile_steps = 0

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            _sync(pl_module.device.type)
            self._val_t0, self._val_images = time.perf_counter(), 0

        def on_validation_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
        ) -> None:
            if batch_idx == 0:  # the clock starts at the first batch: worker start-up is not validation speed
                self._val_t0 = time.perf_counter()
            self._val_images += int(batch[0].shape[0])

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            _sync(pl_module.device.type)
            self.val.append((self._val_images, time.perf_counter() - self._val_t0))

    return BenchTimer(profile_at, profile_steps)


@dataclass
class Result:
    name: str
    options: dict[str, Any]
    precision: str = ""
    train_img_s: float = float("nan")
    data_wait: float = float("nan")
    ceiling_share: float = float("nan")
    val_img_s: float = float("nan")
    first_step_s: float = float("nan")
    wall_s: float = float("nan")
    peak_mem_mb: float = float("nan")
    loss_first: float = float("nan")
    loss_last: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)


def run_config(name: str, opts: Options, args: argparse.Namespace, hyp: dict[str, Any]) -> Result:
    """Build and fit one configuration; everything from building the DataModule to the end of fit is timed."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import TensorBoardLogger

    from yolo5l.base.hostmem import tune_malloc
    from yolo5l.callbacks import EMACallback, LastCheckpoint, ValEveryNEpochs
    from yolo5l.callbacks.checkpoint import AtomicCheckpointIO
    from yolo5l.config import compose_config
    from yolo5l.data.datamodule import YOLODataModule
    from yolo5l.models.yolo import YOLOv5

    device = args.device
    precision = amp_precision(device) if opts.amp else "32-true"
    res = Result(name, asdict(opts), precision=precision)
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp, PeakMemory(device) as mem:
        t0 = time.perf_counter()
        pl.seed_everything(0, verbose=False)
        val_batch = 2 * args.batch  # yolo5l's default (data.val_batch_size: null) and the reference's
        dm = YOLODataModule(
            synthetic=dict(root=args.data_root, num_train=512, num_val=128, seed=0),
            imgsz=args.imgsz,
            batch_size=args.batch,
            num_workers=args.workers,
            cache=opts.cache,
            hyp=hyp,
            val_batch_size=val_batch,
            channels_last=opts.channels_last,
        )
        model = YOLOv5.from_name(
            args.model, num_classes=dm.num_classes, fused_upsample=True, fused_bn_act=opts.fused_bn_act
        )
        cfg = compose_config(
            [
                f"data.imgsz={args.imgsz}",
                f"module.compile={opts.compile}",
                f"module.channels_last={opts.channels_last}",
                f"module.optimizer_impl={opts.optimizer_impl}",
                f"module.fuse_eval={opts.fuse_eval}",
                f"module.loss.ciou_backend={opts.ciou}",
            ],
            output_dir=f"{tmp}/cfg",
        )
        module = instantiate(cfg.module, model=model, names=dm.names, _convert_="all")
        if opts.malloc:
            tune_malloc()
        timer = _timer_callback(args.warmup, args.profile)
        callbacks = [
            EMACallback(foreach=opts.ema_foreach),
            ValEveryNEpochs(n=args.epochs if opts.val_interval else 1),
            LastCheckpoint(every_n_epochs=1, save_best=not opts.ckpt_last_only, dirpath=f"{tmp}/ckpt"),
            timer,
        ]
        tb = {"max_queue": 1000, "flush_secs": 30} if opts.log_throttle else {"max_queue": 10, "flush_secs": 120}
        logger = TensorBoardLogger(tmp, name="", version="", default_hp_metric=False, **tb)
        trainer = pl.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=1,
            precision=precision,
            max_epochs=args.epochs,
            limit_train_batches=args.steps,
            limit_val_batches=max(1, math.ceil(args.val_images / val_batch)),
            num_sanity_val_steps=0,
            log_every_n_steps=50 if opts.log_throttle else 1,
            logger=logger,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
            enable_progress_bar=False,
            enable_model_summary=False,
            benchmark=device == "cuda",
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule=dm)
        _sync(device)
        res.wall_s = time.perf_counter() - t0
    res.peak_mem_mb = (mem.gpu_peak if device == "cuda" else mem.peak) / 2**20
    res.first_step_s = (timer.first_step or math.nan) - t0
    # Steady state: batches after the warm-up, without the first batch of later epochs (it follows validation).
    is_steady = [(e == 0 and i >= args.warmup) or (e > 0 and i > 0) for e, i, *_ in timer.batches]
    steady = [b for b, keep in zip(timer.batches, is_steady, strict=True) if keep]
    faults = [f for f, keep in zip(timer.faults, is_steady, strict=True) if keep]
    if faults:
        res.extra["faults_per_step"] = sum(faults) / len(faults)
    if steady:
        span = sum(end - prev for _, _, prev, _, end in steady)
        wait = sum(start - prev for _, _, prev, start, _ in steady)
        res.train_img_s = len(steady) * args.batch / span
        res.data_wait = wait / span
    if timer.val:
        images, seconds = timer.val[-1]
        res.val_img_s = images / seconds
    if timer.losses:
        res.loss_first, res.loss_last = float(timer.losses[0]), float(timer.losses[-1])  # after the run: no sync cost
    del trainer, module, model, dm
    return res


def run_isolated(name: str, args: argparse.Namespace, argv: list[str] | None) -> Result:
    """`run_config` in a fresh interpreter: no memory or thread state carried over between configurations."""
    with tempfile.TemporaryDirectory(prefix="bench_cfg_") as tmp:
        out = Path(tmp) / "result.json"
        passthrough = list(argv if argv is not None else sys.argv[1:])  # the child's --configs comes last: it wins
        cmd = [sys.executable, str(Path(__file__).resolve()), *passthrough, "--configs", name, "--child-out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO)
        if proc.returncode or not out.is_file():
            print(f"[{name}] failed (exit code {proc.returncode})", file=sys.stderr, flush=True)
            return Result(name, asdict(CONFIGS[name]))
        return Result(**json.loads(out.read_text()))


def e2e_timings(args: argparse.Namespace) -> dict[str, float]:
    """Wall time of `python -m yolo5l.train` (1 epoch, the default config) from the command to exit, and of its
    imports alone."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import yolo5l.train, yolo5l.training.module, yolo5l.data.datamodule"],
        check=True,
        env=env,
        cwd=REPO,
    )
    imports = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "yolo5l.train",
            "trainer.max_epochs=1",
            f"hydra.run.dir={tmp}",
            f"data.synthetic.root={args.data_root}",
            f"data.imgsz={args.imgsz}",
            f"data.batch_size={args.batch}",
            f"data.num_workers={args.workers}",
            *args.e2e_args,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode:
        print(f"e2e run failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        return {"imports_s": imports}
    return {"imports_s": imports, "one_epoch_run_s": wall}


# ------------------------------------------------------------------------------------------------ report
def reference_timings(args: argparse.Namespace) -> dict[str, Any]:
    """ultralytics/yolov5 v7.0 on the same data, batch, size and workers (`scripts/bench_reference.py`); {} if it
    could not run (its message says what to install)."""
    with tempfile.TemporaryDirectory(prefix="bench_ref_") as tmp:
        out = Path(tmp) / "reference.json"
        cmd = [sys.executable, str(REPO / "scripts" / "bench_reference.py"), "--data-root", str(args.data_root)]
        ref_workers = 2 if args.workers == "auto" else args.workers
        cmd += ["--imgsz", str(args.imgsz), "--batch", str(args.batch), "--workers", str(ref_workers)]
        cmd += ["--threads", str(args.threads), "--device", args.device, "--no-fwd-bwd", "--json", str(out)]
        cmd += ["--ref-python", args.ref_python] if args.ref_python else []
        print(f"\n[reference] {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, cwd=REPO)
        if proc.returncode or not out.is_file():
            print(f"[reference] failed (exit code {proc.returncode}): no comparison", file=sys.stderr, flush=True)
            return {}
        return json.loads(out.read_text())


def print_reference_table(ref: dict[str, Any], results: list[Result], e2e: dict[str, float]) -> None:
    """yolo5l's configurations against the reference measured in the same command."""
    run = ref["runs"][0]
    in_training = [v for v in run.get("vals", []) if v.get("in_training")]
    ref_val = in_training[0]["images"] / in_training[0]["from_first_batch_s"] if in_training else math.nan
    print(
        f"\nagainst ultralytics/yolov5 {ref.get('yolov5', '?')} measured in this command "
        f"(train {run['train_img_s']:.1f} img/s, validation in training {ref_val:.1f} img/s, "
        f"one-epoch run {run['wall_s']:.1f} s command to exit, validating twice)"
    )
    ref_torch, our_torch = str(run.get("torch") or "?"), torch.__version__
    same = ref_torch.split("+")[0] == our_torch.split("+")[0]
    note = "" if same else " (they differ: install yolo5l's torch in the reference's venv)"
    print(f"torch: yolo5l {our_torch}, reference {ref_torch}{note}")
    print("| config          | train img/s | x ref | val img/s | x ref |")
    print("|-----------------|-------------|-------|-----------|-------|")
    for r in results:
        print(
            f"| {r.name:<15} | {_fmt(r.train_img_s, '11.1f')} | {r.train_img_s / run['train_img_s']:5.2f} "
            f"| {_fmt(r.val_img_s, '9.1f')} | {r.val_img_s / ref_val:5.2f} |"
        )
    one_epoch = e2e.get("one_epoch_run_s", math.nan)
    print(
        f"one-epoch run, command to exit: yolo5l default {one_epoch:.1f} s = {100 * one_epoch / run['wall_s']:.0f}% "
        f"of the reference's {run['wall_s']:.1f} s",
        flush=True,
    )


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(results: list[Result]) -> None:
    base = next((r for r in results if r.name == "off"), None)
    head = (
        f"| {'config':<15} | {'precision':<10} | train img/s | x off | data wait | % ceiling | val img/s | x off "
        f"| 1st step s | wall s | x off | peak MB | loss@1 | loss@last |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in results:

        def ratio(a: float, b: float | None, inverse: bool = False) -> str:
            if b is None or not b or math.isnan(a) or math.isnan(b):
                return "-"
            return f"{(b / a if inverse else a / b):.2f}"

        print(
            f"| {r.name:<15} | {r.precision:<10} | {_fmt(r.train_img_s, '11.1f')} "
            f"| {ratio(r.train_img_s, base and base.train_img_s):>5} | {_fmt(100 * r.data_wait, '8.1f')}% "
            f"| {_fmt(100 * r.ceiling_share, '8.1f')}% | {_fmt(r.val_img_s, '9.1f')} "
            f"| {ratio(r.val_img_s, base and base.val_img_s):>5} | {_fmt(r.first_step_s, '10.1f')} "
            f"| {_fmt(r.wall_s, '6.1f')} | {ratio(r.wall_s, base and base.wall_s, inverse=True):>5} "
            f"| {_fmt(r.peak_mem_mb, '7.0f')} | {_fmt(r.loss_first, '6.3f')} | {_fmt(r.loss_last, '9.3f')} |"
        )
    print("x off: speed-up against 'off' (for wall time: off's time / this time).", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        default="default,default-fp32,off," + ",".join(TOGGLES),
        help=f"comma-separated subset of {list(CONFIGS)} or 'all'",
    )
    parser.add_argument("--steps", type=int, default=16, help="training batches per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="first training batches left out of the steady rate")
    parser.add_argument("--val-images", type=int, default=128)
    parser.add_argument("--model", default="yolov5s")
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--workers",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="DataLoader workers (auto: yolo5l's default, 0 on the CPU; the reference gets 2 then, as in issue 5)",
    )
    parser.add_argument("--data-root", default="datasets/synthetic")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each micro-timing (best is kept)")
    parser.add_argument("--no-micro", action="store_true", help="skip GEMM, fwd+bwd and micro-timings")
    parser.add_argument("--e2e", action="store_true", help="also time `python -m yolo5l.train` for one epoch")
    parser.add_argument("--e2e-args", nargs="*", default=[], help="extra Hydra overrides for the --e2e run")
    parser.add_argument(
        "--profile", type=int, default=0, help="torch.profiler over this many steady steps of each config (top ops)"
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="first run ultralytics/yolov5 v7.0 itself (scripts/bench_reference.py, its own venv) on the same data "
        "and print yolo5l against it; implies --e2e",
    )
    parser.add_argument("--ref-python", default=None, help="the reference venv's python (bench_reference's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--in-process", action="store_true", help="run every config in this process (default: one process each)"
    )
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = list(CONFIGS) if args.configs == "all" else [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    os.chdir(REPO)

    import warnings

    import yaml

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")
    from yolo5l.models.yolo import YOLOv5

    hyp = yaml.safe_load((REPO / "conf/hyp/scratch-low.yaml").read_text())
    if args.child_out is not None:  # one configuration for run_isolated
        r = run_config(names[0], CONFIGS[names[0]], args, hyp)
        args.child_out.write_text(json.dumps(asdict(r), default=str))
        return
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}; {args.model} imgsz {args.imgsz} batch {args.batch}, "
        f"{args.workers} workers, {args.epochs} epochs x {args.steps} steps, {args.val_images} val images",
        flush=True,
    )

    amp_dtype = torch.float16 if args.device == "cuda" else torch.bfloat16
    ceil = {"fp32": gemm_gflops(torch.float32, args.device)}
    ceil["amp"] = gemm_gflops(amp_dtype, args.device) if (args.device == "cuda" or cpu_has_bf16()) else ceil["fp32"]
    model_fn = functools.partial(YOLOv5.from_name, args.model, num_classes=3, fused_upsample=True)
    flops_img = forward_flops(model_fn(), args.imgsz, args.device)
    report: dict[str, Any] = {"gemm_gflops": ceil, "forward_gflops_per_image": flops_img / 1e9}
    print(
        f"GEMM ceiling: fp32 {ceil['fp32']:.0f} GFLOP/s, {amp_dtype} {ceil['amp']:.0f} GFLOP/s; "
        f"{args.model} forward {flops_img / 1e9:.2f} GFLOP/image at {args.imgsz} (training ~3x)",
        flush=True,
    )
    if not args.no_micro:
        rows = fwd_bwd_timings(model_fn, args.batch, args.imgsz, args.device, args.repeat, flops_img, ceil)
        report["fwd_bwd"] = rows
        print("\nforward + backward of one batch (no data, no optimizer):")
        for r in rows:
            print(
                f"  {r['variant']:<44} {r['s_per_batch']:.3f} s  {r['img_s']:6.1f} img/s  "
                f"{100 * r['ceiling_share']:5.1f}% of its GEMM ceiling  "
                f"x{rows[0]['s_per_batch'] / r['s_per_batch']:.2f}"
            )
        micro = micro_timings(args.device, 3, args.repeat * 3)
        report["micro_ms"] = micro
        print(
            "\nmicro-timings (ms): " + ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in micro.items()),
            flush=True,
        )

    if args.reference:
        args.e2e = True
        report["reference"] = reference_timings(args)

    results = []
    for name in names:
        print(f"\n[{name}] {CONFIGS[name]}", flush=True)
        r = run_isolated(name, args, argv) if not args.in_process else run_config(name, CONFIGS[name], args, hyp)
        results.append(r)
        print(
            f"[{name}] train {r.train_img_s:.1f} img/s (data wait {100 * r.data_wait:.1f}%), "
            f"val {r.val_img_s:.1f} img/s, first step {r.first_step_s:.1f} s, wall {r.wall_s:.1f} s, "
            f"peak {r.peak_mem_mb:.0f} MB, page faults/step {r.extra.get('faults_per_step', math.nan):.0f}, "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    # The ceiling is a maximum: measure it again now and keep the larger (a busy neighbour during the first
    # measurement would otherwise inflate every share).
    again = {"fp32": gemm_gflops(torch.float32, args.device)}
    amp_ok = args.device == "cuda" or cpu_has_bf16()
    again["amp"] = gemm_gflops(amp_dtype, args.device) if amp_ok else again["fp32"]
    ceil = {k: max(v, again[k]) for k, v in ceil.items()}
    report["gemm_gflops"] = ceil
    print(f"\nGEMM ceiling (best of start and end): fp32 {ceil['fp32']:.0f}, {amp_dtype} {ceil['amp']:.0f} GFLOP/s")
    for r in results:
        if not math.isnan(r.train_img_s):
            r.ceiling_share = r.train_img_s * 3 * flops_img / (ceil["amp" if CONFIGS[r.name].amp else "fp32"] * 1e9)
    print()
    print_table(results)
    report["runs"] = [asdict(r) for r in results]
    if args.e2e:
        report["e2e"] = e2e_timings(args)
        print(
            f"\nstart-up: imports {report['e2e'].get('imports_s', math.nan):.1f} s; one-epoch run (command to exit) "
            f"{report['e2e'].get('one_epoch_run_s', math.nan):.1f} s",
            flush=True,
        )
    if args.reference and report["reference"]:
        print_reference_table(report["reference"], results, report.get("e2e", {}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
