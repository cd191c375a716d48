"""Images/s of `python -m yolo5l.predict` against ultralytics/yolov5 v7.0's detect.py on the same folder, as a ratio.

Both run the same weights (a yolov5s built and saved by the reference package itself, or ``--weights``) on the same
images (``--images`` of the synthetic dataset's, or ``--source``), at the same image size, confidence threshold and
device, each writing its drawn images as it does by default (no txt files). Each side runs in its own process: one
untimed call on one image (imports, model load, first-call costs), then the timed call on the folder, from the call
to its return (model load included, as a user waits for it). Each side keeps its own torch thread count unless
``--threads`` sets both (v7.0's `utils/general.py` sets OMP_NUM_THREADS to the CPU count - 1 when it is imported,
which torch may read; the table prints the counts the runs had). v7.0 runs image by image with its rectangular letterbox
(``auto=True``); yolo5l in batches of ``--batch`` (square letterbox, a loader thread decoding ahead).

The reference runs offline in ``.refvenv`` (``yolov5==7.0.14``; see scripts/bench_reference.py); a missing one makes
the script print what to install. The machine is shared: record the ratio, taken in one command, not the absolute
rates.

    .venv/bin/python scripts/bench_predict.py --images 64 --imgsz 640 --batch 8 [--json bench_predict.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

REF_WRAPPER = r"""
import json, sys, time
cfg = json.loads(open(sys.argv[1]).read())
import torch
if cfg.get("threads"):
    torch.set_num_threads(cfg["threads"])
if cfg.get("make_weights"):
    import pathlib, yolov5
    from yolov5.models.yolo import Model
    torch.manual_seed(0)
    model = Model(str(pathlib.Path(yolov5.__file__).parent / "models" / "yolov5s.yaml"), ch=3, nc=80).eval()
    torch.save({"epoch": -1, "best_fitness": None, "model": model.half(), "ema": None, "updates": None,
                "optimizer": None}, cfg["make_weights"])
    sys.exit(0)
from yolov5.detect import run
kw = dict(weights=cfg["weights"], imgsz=(cfg["imgsz"], cfg["imgsz"]), conf_thres=cfg["conf"], device=cfg["device"],
          project=cfg["project"], exist_ok=True)
run(source=cfg["warm"], name="warm", **kw)
t0 = time.perf_counter()
run(source=cfg["source"], name="run", **kw)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}))
"""

YOLO5L_WRAPPER = r"""
import json, sys, time
cfg = json.loads(open(sys.argv[1]).read())
import torch
if cfg.get("threads"):
    torch.set_num_threads(cfg["threads"])
from yolo5l.config import compose_config
from yolo5l.predict import predict
common = [f"weights={cfg['weights']}", f"imgsz={cfg['imgsz']}", f"conf_thres={cfg['conf']}", f"device={cfg['device']}",
          "save_txt=false", f"batch_size={cfg['batch']}"]
predict(compose_config([*common, f"source={cfg['warm']}"], "predict", cfg["project"] + "/warm"))
t0 = time.perf_counter()
predict(compose_config([*common, f"source={cfg['source']}"], "predict", cfg["project"] + "/run"))
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}))
"""


def _run(python: str, script: str, cfg: dict[str, Any], work: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    """Run a wrapper; its RESULT line, or exit naming the log."""
    script_path = work / f"bench_{name}.py"  # never `yolo5l.py`: the script's folder comes first on sys.path
    script_path.write_text(script)
    (work / f"bench_{name}.json").write_text(json.dumps(cfg))
    log = work / f"bench_{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([python, str(script_path), str(work / f"bench_{name}.json")], env=env, cwd=work,
                              stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    lines = log.read_text(errors="replace").splitlines()
    result = next((ln for ln in reversed(lines) if ln.startswith("RESULT ")), None)
    if proc.returncode or (result is None and not cfg.get("make_weights")):
        tail = "\n".join(lines[-20:])
        sys.exit(f"bench_predict: the {name} run failed (exit code {proc.returncode}); log {log}:\n{tail}")
    return json.loads(result[7:]) if result else {}


def _images(args: argparse.Namespace, work: Path) -> Path:
    """The folder both sides read: ``--source``, or ``--images`` of the synthetic val images (linked)."""
    if args.source is not None:
        return args.source.resolve()
    from yolo5l.data.synthetic import ensure_synthetic

    root = Path(ensure_synthetic(args.data_root, num_val=max(args.images, 16))).parent
    folder = work / "images"
    folder.mkdir()
    for f in sorted((root / "images" / "val").glob("*.jpg"))[: args.images]:
        (folder / f.name).symlink_to(f)
    return folder


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_reference import DEFAULT_REF_PYTHON, check_reference, ref_env, yolov5_device

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=64, help="synthetic val images to predict on")
    p.add_argument("--source", type=Path, default=None, help="a folder of images instead of the synthetic ones")
    p.add_argument("--data-root", type=Path, default=REPO / "datasets" / "synthetic")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=8, help="yolo5l's batch_size")
    p.add_argument("--conf", type=float, default=0.25)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default)")
    p.add_argument(
        "--weights", type=Path, default=None, help="an ultralytics .pt (default: a yolov5s the reference saves)"
    )
    p.add_argument("--ref-python", default=DEFAULT_REF_PYTHON)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_predict_")))
        work = work.resolve()
        work.mkdir(parents=True, exist_ok=True)
        version = check_reference(args.ref_python, work)
        env = ref_env(work)
        source = _images(args, work)
        warm = work / "warm"
        warm.mkdir(exist_ok=True)
        first = next(f for f in sorted(source.iterdir()) if f.suffix.lower() in (".jpg", ".jpeg", ".png", ".bmp"))
        shutil.copy(first, warm / first.name)
        weights = args.weights.resolve() if args.weights else work / "yolov5s_random.pt"
        if args.weights is None:
            _run(args.ref_python, REF_WRAPPER, {"make_weights": str(weights)}, work, "make_weights", env)
        n = sum(1 for f in source.iterdir() if f.is_file())
        common = {"weights": str(weights), "imgsz": args.imgsz, "conf": args.conf, "threads": args.threads,
                  "source": str(source), "warm": str(warm)}  # fmt: skip
        ref = _run(args.ref_python, REF_WRAPPER, {**common, "device": yolov5_device(args.device),
                   "project": str(work / "ref")}, work, "reference", env)  # fmt: skip
        own_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        ours = _run(sys.executable, YOLO5L_WRAPPER, {**common, "device": args.device, "batch": args.batch,
                    "project": str(work / "yolo5l")}, work, "yolo5l", own_env)  # fmt: skip
        ref_ips, our_ips = n / ref["seconds"], n / ours["seconds"]
        report = {
            "images": n, "imgsz": args.imgsz, "device": args.device, "batch": args.batch, "threads": args.threads,
            "yolov5": version, "reference_img_s": ref_ips, "yolo5l_img_s": our_ips, "ratio": our_ips / ref_ips,
            "reference_threads": ref.get("threads"), "yolo5l_threads": ours.get("threads"),
            "when": time.strftime("%Y-%m-%d %H:%M"),
        }  # fmt: skip
        print(f"| predict, {n} images at {args.imgsz} px, {args.device} | v7.0 detect.py (yolov5 {version}) | "
              f"yolo5l batch_size={args.batch} | x ref |")  # fmt: skip
        print("|---|---|---|---|")
        print(f"| images/s | {ref_ips:.2f} | {our_ips:.2f} | {our_ips / ref_ips:.2f} |")
        print(f"| torch threads | {ref.get('threads')} | {ours.get('threads')} | |")
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
