"""Speed of the real ultralytics/yolov5 v7.0 (PyPI ``yolov5==7.0.14``) on this machine: the same-machine baseline.

The reference runs in its own virtual environment (never in yolo5l's), offline, on yolo5l's synthetic dataset,
through a small wrapper that calls its public entry points (``yolov5.train.parse_opt`` / ``main`` and
``yolov5.val.run``) with a ``Callbacks`` object whose actions record host clocks. Measured:

- the wall time of a one-epoch training run (``--epochs``) from the command to the exit of the process, the time
  to the first training step, the imports alone (``import yolov5.train``) and the peak RSS of the main process;
- steady training images/s (batches after ``--warmup``; each later epoch's first batch is skipped too, as in
  scripts/bench_train.py) and the share of that time spent waiting for data; the mean compute per batch
  (forward, loss, backward and, every ``accumulate`` batches, the optimizer step and EMA);
- every validation the trainer runs: after each epoch (the EMA model) and, at the end, again with ``best.pt``
  (fused, loaded from disk); images/s from the first batch to the return of ``val.run`` (mAP included);
- a stand-alone ``val.run`` of ``last.pt`` (``--val-batch`` 32), as ``yolov5 val`` would: whole process, the call
  alone, from its first batch, and the per-image split it prints (pre-process / inference / NMS);
- forward + backward of one batch of random images (no data, no loss, no optimizer; sum of heads as the loss),
  comparable with bench_train.py's "fp32" row;
- with ``--cache-ram``, the training run again with ``--cache ram``.

Create the reference environment once, in ``.refvenv/`` at the repository root (ignored by git; about 2-3
minutes; PyPI only), from the repository root:

    python3.11 -m venv .refvenv
    .refvenv/bin/pip install torch==X torchvision==Y  # X, Y: the versions in yolo5l's venv (same kernels)
    .refvenv/bin/pip install yolov5==7.0.14 'setuptools<81' 'numpy<2.4'  # pkg_resources; np.trapz
    .refvenv/bin/pip install onnxruntime 'openvino<2026' ai-edge-litert  # only for tests/test_deploy_dropin.py

(a missing environment makes the script print these lines with X and Y filled in; ``--ref-python`` points at a
reference venv elsewhere).

Offline operation (no edits to the installed package): ``ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS=1`` (its
``check_requirements`` comes from the ``ultralytics`` package and would pip-install), ``YOLO_AUTOINSTALL=false``,
``YOLO_OFFLINE=1``, ``YOLO_CONFIG_DIR`` / ``YOLOV5_CONFIG_DIR`` pointing into the work folder, where a copy of
matplotlib's DejaVuSans.ttf is placed as ``Arial.ttf`` (``check_dataset`` always "downloads" that font),
``WANDB_MODE=disabled`` / ``COMET_MODE=disabled``, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (its checkpoints
hold numpy objects that torch >= 2.6's default ``weights_only`` load refuses); training flags ``--weights ''
--cfg yolov5s.yaml --noplots``.
The dataset is seen through a folder of symbolic links with an absolute ``path:`` in its yaml (the reference
resolves a relative ``path:`` against its package folder), so its label caches stay out of yolo5l's dataset.

Example (the machine is shared: run it once, take ratios against bench_train.py runs made at the same time):

    .venv/bin/python scripts/bench_reference.py --cache-ram --json ref.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The reference venv lives inside the repository, in a folder .gitignore ignores.
REF_VENV = REPO / ".refvenv"
DEFAULT_REF_PYTHON = str(REF_VENV / "bin" / "python")


def _version(package: str, default: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package).split("+")[0]
    except PackageNotFoundError:
        return default


# The same torch as yolo5l's venv: the comparison is then between the two programs, not two torch builds.
INSTALL_HINT = (
    f"cd {REPO} && python3.11 -m venv .refvenv && .refvenv/bin/pip install torch=={_version('torch', '2.14.1')} "
    f"torchvision=={_version('torchvision', '0.29.1')} && "
    ".refvenv/bin/pip install yolov5==7.0.14 'setuptools<81' 'numpy<2.4' && "
    ".refvenv/bin/pip install onnxruntime 'openvino<2026' ai-edge-litert"  # for tests/test_deploy_dropin.py
)

# Runs inside the reference's venv. Argument: a JSON file {"out", "start", "threads"} plus any of "argv" (train.py
# arguments), "val" (val.run keyword arguments), "fwdbwd" ([batch, imgsz, classes, repeat]), run in that order.
WRAPPER = r"""
import json, resource, sys, time
T0, W0 = time.perf_counter(), time.time()
cfg = json.loads(open(sys.argv[1]).read())
import torch
if cfg.get("threads"):
    torch.set_num_threads(cfg["threads"])
import yolov5
import yolov5.train as yt
import yolov5.val as yv
from yolov5.utils.callbacks import Callbacks
rec = {"t0": T0, "imports_s": time.perf_counter() - T0, "wrapper_start_after_command_s": W0 - cfg["start"],
       "torch": torch.__version__, "yolov5": getattr(yolov5, "__version__", "?"), "batches": [], "vals": []}
now = time.perf_counter
state = {"epoch": -1, "prev": now(), "start": 0.0, "val_batches": [], "val_images": 0}

def epoch_start():
    state["epoch"] += 1
    state["prev"] = now()

def batch_start():
    state["start"] = now()
    if "first_step" not in rec:
        rec["first_step"] = state["start"]
        rec["threads"] = torch.get_num_threads()

def batch_end(model, ni, imgs, targets, paths, mloss):
    end = now()
    rec["batches"].append([state["epoch"], len(rec["batches"]), state["prev"], state["start"], end, int(imgs.shape[0])])
    rec.setdefault("mloss_first", [float(x) for x in mloss])
    rec["mloss_last"] = [float(x) for x in mloss]
    state["prev"] = end

def val_start():
    state["val_batches"], state["val_images"] = [], 0

def val_batch_start():
    state["val_batches"].append(now())

def val_batch_end(batch_i, im, *args):
    state["val_images"] += int(im.shape[0])

cb = Callbacks()
for hook, fn in [("on_train_epoch_start", epoch_start), ("on_train_batch_start", batch_start),
                 ("on_train_batch_end", batch_end), ("on_val_start", val_start),
                 ("on_val_batch_start", val_batch_start), ("on_val_batch_end", val_batch_end)]:
    cb.register_action(hook, name="bench", callback=fn)

_val_run = yv.run

def timed_val_run(*args, **kwargs):
    t0 = now()
    out = _val_run(*args, **kwargs)
    t1 = now()
    vb = state["val_batches"]
    rec["vals"].append({"call_s": t1 - t0, "from_first_batch_s": t1 - vb[0] if vb else float("nan"),
                        "images": state["val_images"], "batches": len(vb), "epoch": state["epoch"],
                        "in_training": kwargs.get("model") is not None,
                        "ms_per_image": [float(x) for x in out[-1]], "map50": float(out[0][2]),
                        "map": float(out[0][3])})
    return out

yv.run = timed_val_run  # train.py calls it as validate.run
_check_amp = yt.check_amp

def recorded_check_amp(model):  # False on the CPU; on CUDA fp16 AMP if YOLOv5's own check passes
    rec["amp"] = bool(_check_amp(model))
    return rec["amp"]

yt.check_amp = recorded_check_amp
if cfg.get("argv") is not None:  # training, parsed exactly as train.py parses its command line
    sys.argv = ["train.py", *cfg["argv"]]
    opt = yt.parse_opt()
    rec["t_main"] = now()
    yt.main(opt, callbacks=cb)
    rec["save_dir"] = str(opt.save_dir)
if cfg.get("val") is not None:  # as `yolov5 val` runs it
    state["epoch"] = -1
    yv.run(**cfg["val"], callbacks=cb)
if cfg.get("fwdbwd") is not None:
    from yolov5.models.yolo import Model
    from yolov5.utils.general import check_yaml
    b, s, nc, repeat = cfg["fwdbwd"]
    dev = torch.device(cfg.get("device", "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = Model(check_yaml("yolov5s.yaml"), ch=3, nc=nc).to(dev).train()
    x = torch.rand(b, 3, s, s, device=dev)
    def step():
        heads = model(x)
        sum(h.sum() for h in heads).backward()
        sync()
    step()
    best = float("inf")
    for _ in range(repeat):
        t0 = now(); step(); best = min(best, now() - t0)
    rec["fwd_bwd_s"] = best
rec["t_end"] = now()
rec["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with open(cfg["out"], "w") as f:
    json.dump(rec, f)
"""


def ref_env(work: Path) -> dict[str, str]:
    """Environment that keeps the reference offline and its settings inside ``work``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("VIRTUAL_ENV")}
    env.update(
        ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS="1",
        YOLO_AUTOINSTALL="false",
        YOLO_OFFLINE="1",
        YOLO_CONFIG_DIR=str(work / "cfg"),
        YOLOV5_CONFIG_DIR=str(work / "cfg"),
        WANDB_MODE="disabled",
        COMET_MODE="disabled",
        PYTHONWARNINGS="ignore",
        MPLBACKEND="Agg",
        # v7.0 saves numpy objects in its checkpoints and loads them with torch.load's default, weights_only since
        # torch 2.6: without this, strip_optimizer(last.pt) and the final validation of best.pt fail.
        TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1",
    )
    return env


def check_reference(ref_python: str, work: Path) -> str:
    """Exit with what to install unless ``ref_python`` imports ``yolov5.train``; return the yolov5 version."""
    if not Path(ref_python).exists():
        sys.exit(f"bench_reference: {ref_python} not found. Create the reference environment:\n  {INSTALL_HINT}")
    probe = "import yolov5, yolov5.train; print(yolov5.__version__)"
    proc = subprocess.run([ref_python, "-c", probe], env=ref_env(work), capture_output=True, text=True, cwd=work)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        hint = "'setuptools<81' (yolov5 imports pkg_resources)" if "pkg_resources" in tail else "yolov5==7.0.14"
        sys.exit(
            f"bench_reference: {ref_python} cannot import yolov5.train:\n{tail}\n"
            f"Install {hint}: {Path(ref_python).parent / 'pip'} install yolov5==7.0.14 'setuptools<81' 'numpy<2.4'\n"
            f"(whole environment: {INSTALL_HINT})"
        )
    lines = proc.stdout.strip().splitlines()  # the first import may print Ultralytics' settings banner first
    return lines[-1] if lines else "?"


def prepare(data_root: Path, work: Path, ref_python: str, src_yaml: Path | None = None) -> Path:
    """Generate the synthetic dataset if absent (or take the dataset yaml ``src_yaml``), link it under ``work`` and
    write the reference's data yaml; put a font named Arial.ttf where the reference looks for it."""
    import yaml

    from yolo5l.data.synthetic import ensure_synthetic

    src_yaml = Path(src_yaml) if src_yaml is not None else Path(ensure_synthetic(data_root))
    src = yaml.safe_load(src_yaml.read_text())
    base = (src_yaml.parent / (src.get("path") or ".")).resolve()
    data = work / "data"
    for kind in ("images", "labels"):
        for split in ("train", "val"):
            d = data / kind / split
            d.mkdir(parents=True, exist_ok=True)
            folder = base / (src[split].replace("images", kind, 1) if kind == "labels" else src[split])
            for f in sorted(folder.iterdir()):
                if f.suffix != ".cache" and not (d / f.name).exists():
                    (d / f.name).symlink_to(f)
    names = src["names"] if isinstance(src["names"], dict) else dict(enumerate(src["names"]))
    out = work / "data.yaml"
    out.write_text(yaml.safe_dump({"path": str(data), "train": "images/train", "val": "images/val", "names": names}))
    (work / "cfg").mkdir(exist_ok=True)
    font = work / "cfg" / "Arial.ttf"
    if not font.exists():
        probe = "import matplotlib, pathlib; print(pathlib.Path(matplotlib.get_data_path(), 'fonts/ttf'))"
        ttf = subprocess.run([ref_python, "-c", probe], capture_output=True, text=True, env=ref_env(work), cwd=work)
        dejavu = Path(ttf.stdout.strip()) / "DejaVuSans.ttf"
        if ttf.returncode == 0 and dejavu.exists():
            shutil.copyfile(dejavu, font)
        else:  # any TrueType font will do: it is only drawn into plots, which --noplots turns off
            font.write_bytes(b"")
    return out


def run_wrapper(name: str, cfg: dict[str, Any], ref_python: str, work: Path) -> dict[str, Any] | None:
    """Run the wrapper in the reference's venv; return its record plus the command-to-exit wall time."""
    script = work / "bench_wrapper.py"
    script.write_text(WRAPPER)
    out, log = work / f"{name}.json", work / f"{name}.log"
    start = time.time()
    cfg = {**cfg, "out": str(out), "start": start}
    (work / f"{name}.cfg.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(
            [ref_python, str(script), str(work / f"{name}.cfg.json")], env=ref_env(work), cwd=work, stdout=f, stderr=f
        )
    wall = time.perf_counter() - t0
    if proc.returncode or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        print(f"[{name}] reference run failed (exit code {proc.returncode}), log {log}:\n{tail}", file=sys.stderr)
        return None
    rec = json.loads(out.read_text())
    rec["wall_s"] = wall
    rec["log"] = str(log)
    return rec


def summarise_train(rec: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Steady images/s, data wait, compute per batch, first step and validations of one training record."""
    seen: dict[int, int] = {}
    steady = []
    for ep, _, prev, start, end, n in rec["batches"]:  # (epoch, index, previous end, start, end, images)
        i = seen.get(ep, 0)  # index within the epoch
        seen[ep] = i + 1
        if (ep == 0 and i >= warmup) or (ep > 0 and i > 0):
            steady.append((prev, start, end, n))
    out: dict[str, Any] = {"batches": len(rec["batches"]), "steady_batches": len(steady), "threads": rec.get("threads")}
    if steady:
        span = sum(end - prev for prev, _, end, _ in steady)
        out["train_img_s"] = sum(n for *_, n in steady) / span
        out["data_wait"] = sum(start - prev for prev, start, _, _ in steady) / span
        out["s_per_batch"] = span / len(steady)
        out["compute_s_per_batch"] = sum(end - start for _, start, end, _ in steady) / len(steady)
    if "first_step" in rec:  # wrapper clocks are perf_counter values from t0, which came this long after the command
        out["first_step_s"] = rec["first_step"] - rec["t0"] + rec["wrapper_start_after_command_s"]
    for k in ("wall_s", "imports_s", "peak_rss_mb", "mloss_first", "mloss_last", "vals", "log", "torch", "amp"):
        out[k] = rec.get(k)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref-python", default=DEFAULT_REF_PYTHON, help="python of the reference's venv")
    parser.add_argument("--data-root", type=Path, default=REPO / "datasets" / "synthetic")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3, help="first training batches left out of the steady rate")
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--val-batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N (YOLOv5 itself picks fp16 AMP on CUDA if its check passes)"
    )
    parser.add_argument("--cache-ram", action="store_true", help="also run the training with --cache ram")
    parser.add_argument("--no-val", action="store_true", help="skip the stand-alone validation")
    parser.add_argument("--no-fwd-bwd", action="store_true", help="skip the forward + backward timing")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep runs and logs here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    ref_python = str(args.ref_python)
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_reference_")))
        else:
            work = args.work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        report = run_all(args, ref_python, work)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


def yolov5_device(device: str) -> str:
    """yolo5l's `cpu` / `cuda` / `cuda:1` as YOLOv5's `--device` spells it (`cpu`, `0`, `1`)."""
    if device == "cpu":
        return "cpu"
    index = device.partition(":")[2]
    return index or "0"


def train_argv(args: argparse.Namespace, data_yaml: Path, work: Path) -> list[str]:
    """`yolov5 train`'s arguments: yolov5s from scratch on the same data, size, batch, workers and device."""
    argv = ["--data", str(data_yaml), "--cfg", "yolov5s.yaml", "--weights", "", "--img", str(args.imgsz)]
    argv += ["--batch-size", str(args.batch), "--workers", str(args.workers), "--epochs", str(args.epochs)]
    argv += ["--device", yolov5_device(args.device), "--project", str(work / "runs"), "--exist-ok", "--noplots"]
    return argv


def run_all(args: argparse.Namespace, ref_python: str, work: Path) -> dict[str, Any]:
    """Every reference measurement of one invocation; prints as it goes, returns the JSON report."""
    version = check_reference(ref_python, work)
    data_yaml = prepare(args.data_root, work, ref_python)
    nc = len(__import__("yaml").safe_load(data_yaml.read_text())["names"])
    print(
        f"reference yolov5 {version} ({ref_python}), load average {os.getloadavg()[0]:.1f}; yolov5s imgsz "
        f"{args.imgsz} batch {args.batch}, {args.workers} workers, {args.epochs} epoch(s), data {args.data_root}",
        flush=True,
    )
    report: dict[str, Any] = {"yolov5": version, "ref_python": ref_python, "args": vars(args), "runs": []}
    t0 = time.perf_counter()
    proc = subprocess.run([ref_python, "-c", "import yolov5.train"], env=ref_env(work), cwd=work)
    report["imports_s"] = time.perf_counter() - t0 if proc.returncode == 0 else math.nan
    print(f"imports (import yolov5.train, command to exit): {report['imports_s']:.1f} s", flush=True)

    base = train_argv(args, data_yaml, work)
    configs = [("reference", [])] + ([("reference+cache", ["--cache", "ram"])] if args.cache_ram else [])
    last_pt = None
    for name, extra in configs:
        argv = [*base, "--name", name, *extra]
        print(f"\n[{name}] yolov5 train {' '.join(repr(a) if a == '' else a for a in argv)}", flush=True)
        rec = run_wrapper(name, {"argv": argv, "threads": args.threads}, ref_python, work)
        if rec is None:
            continue
        s = summarise_train(rec, args.warmup)
        s["name"], s["argv"], s["epochs"] = name, argv, args.epochs
        report["runs"].append(s)
        if last_pt is None and (Path(rec["save_dir"]) / "weights" / "last.pt").exists():
            last_pt = Path(rec["save_dir"]) / "weights" / "last.pt"
        print(
            f"[{name}] train {s.get('train_img_s', math.nan):.1f} img/s (data wait "
            f"{100 * s.get('data_wait', math.nan):.1f}%, compute {s.get('compute_s_per_batch', math.nan):.2f} s/batch, "
            f"{s['threads']} threads), first step {s.get('first_step_s', math.nan):.1f} s, wall {s['wall_s']:.1f} s, "
            f"peak RSS {s['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        for i, v in enumerate(s["vals"]):
            kind = f"after epoch {i} (EMA model)" if i < args.epochs else "at the end (best.pt, fused)"
            print(f"  val {kind}: {_val_line(v)}", flush=True)

    extra_cfg: dict[str, Any] = {"threads": args.threads, "device": args.device}
    if not args.no_val and last_pt is not None:
        extra_cfg["val"] = dict(
            data=str(data_yaml),
            weights=str(last_pt),
            batch_size=args.val_batch,
            imgsz=args.imgsz,
            device=yolov5_device(args.device),
            workers=args.workers,
            project=str(work / "runs"),
            name="val",
            exist_ok=True,
            plots=False,
            half=False,
        )
    if not args.no_fwd_bwd:
        extra_cfg["fwdbwd"] = [args.batch, args.imgsz, nc, 3]
    if "val" in extra_cfg or "fwdbwd" in extra_cfg:
        print(f"\n[val] stand-alone val.run of {last_pt} (batch {args.val_batch}); fwd+bwd of one batch", flush=True)
        rec = run_wrapper("val", extra_cfg, ref_python, work)
        if rec is not None:
            if rec["vals"]:
                report["val"] = rec["vals"][-1]
                print(f"  val last.pt: {_val_line(report['val'])}", flush=True)
            if "fwd_bwd_s" in rec:
                report["fwd_bwd"] = {"s_per_batch": rec["fwd_bwd_s"], "img_s": args.batch / rec["fwd_bwd_s"]}
                print(
                    f"  forward + backward of one batch (fp32, no data, no optimizer): {rec['fwd_bwd_s']:.3f} s "
                    f"{args.batch / rec['fwd_bwd_s']:.1f} img/s",
                    flush=True,
                )
    print()
    print_table(report)
    return report


def _val_line(v: dict[str, Any]) -> str:
    ips = v["images"] / v["from_first_batch_s"] if v["from_first_batch_s"] else math.nan
    pre, inf, nms = v["ms_per_image"]
    return (
        f"{v['images']} images, {ips:.1f} img/s from the first batch ({v['from_first_batch_s']:.1f} s; whole call "
        f"{v['call_s']:.1f} s), per image {pre:.1f} ms pre-process / {inf:.1f} ms inference / {nms:.1f} ms NMS, "
        f"mAP50 {v['map50']:.3f}"
    )


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(report: dict[str, Any]) -> None:
    """The training runs in scripts/bench_train.py's columns (val img/s: the validation after the last epoch, with
    the EMA model, as yolo5l validates; the reference's extra validation of best.pt is printed above)."""
    head = (
        f"| {'config':<15} | {'precision':<10} | train img/s | data wait | s/batch | compute s | val img/s "
        f"| 1st step s | wall s | peak MB |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in report["runs"]:
        v = r["vals"][min(len(r["vals"]), r["epochs"]) - 1] if r["vals"] else None
        val_ips = v["images"] / v["from_first_batch_s"] if v and v["from_first_batch_s"] else math.nan
        precision = "16-mixed" if r.get("amp") else "32-true"
        print(
            f"| {r['name']:<15} | {precision:<10} | {_fmt(r.get('train_img_s'), '11.1f')} "
            f"| {_fmt(100 * r.get('data_wait', math.nan), '8.1f')}% | {_fmt(r.get('s_per_batch'), '7.2f')} "
            f"| {_fmt(r.get('compute_s_per_batch'), '9.2f')} | {_fmt(val_ips, '9.1f')} "
            f"| {_fmt(r.get('first_step_s'), '10.1f')} | {_fmt(r['wall_s'], '6.1f')} "
            f"| {_fmt(r['peak_rss_mb'], '7.0f')} |"
        )
    print("wall s: one training run from the command to the exit of the process; peak MB: main process RSS.")


if __name__ == "__main__":
    main()
