"""Where validation time goes: forward, val loss, decode + NMS, mAP update and compute, per map backend.

Runs ``Trainer.validate`` of ``YOLOv5Module`` on the synthetic dataset's validation split (default: yolov5s, 320,
batch 32 = 2 x the training batch, bf16-mixed where the CPU has it, channels_last, the Conv+BN-fused copy, as
validation inside training) and wraps the stages with clocks. An untrained model is the worst case for NMS: at
conf 0.001 every image has thousands of candidates, as in the first epochs of a training run. ``--weights`` takes a
yolo5l weights file instead. Each backend is validated ``--repeat`` times in one process; the last pass is shown.

    python scripts/bench_val.py                      # yolov5 and coco backends, 128 images
    python scripts/bench_val.py --batch 64 --backends yolov5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def _clock(obj: Any, name: str, key: str, totals: dict[str, float]) -> None:
    """Replace ``obj.name`` by a wrapper that adds its wall time to ``totals[key]``."""
    inner = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t

    object.__setattr__(obj, name, timed)


def validate_once(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    import tempfile

    import lightning.pytorch as pl
    import yaml
    from hydra.utils import instantiate

    from yolo5l.base.hardware import resolve_precision
    from yolo5l.config import compose_config
    from yolo5l.data.datamodule import YOLODataModule
    from yolo5l.models.weights import load_pretrained
    from yolo5l.models.yolo import YOLOv5

    hyp = yaml.safe_load((REPO / "conf/hyp/scratch-low.yaml").read_text())
    dm = YOLODataModule(
        synthetic=dict(root=args.data_root, num_train=512, num_val=args.images, seed=0),
        imgsz=args.imgsz, batch_size=args.batch, val_batch_size=args.batch, num_workers=0, hyp=hyp,
        channels_last=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = YOLOv5.from_name(args.model, num_classes=dm.num_classes, fused_upsample=True)
    if args.weights:
        load_pretrained(model, args.weights)
    with tempfile.TemporaryDirectory(prefix="bench_val_") as tmp:
        cfg = compose_config([f"data.imgsz={args.imgsz}", f"module/metric={backend}"], output_dir=tmp)
    module = instantiate(cfg.module, model=model, names=dm.names, _convert_="all")
    totals: dict[str, float] = {}
    _clock(module, "_detect", "decode + NMS", totals)
    _clock(module.map_metric, "update", "mAP update", totals)
    _clock(module.map_metric, "compute", "mAP compute", totals)
    _clock(module.loss, "forward", "val loss", totals)
    fused_copy = module.fused_copy

    def clocked_copy() -> torch.nn.Module:
        net = fused_copy()
        _clock(net, "forward", "forward", totals)
        return net

    object.__setattr__(module, "fused_copy", clocked_copy)
    marks: dict[str, float] = {}

    class FirstBatch(pl.Callback):
        def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *_: Any) -> None:
            if batch_idx == 0:
                marks["first"] = time.perf_counter()

    precision = resolve_precision(args.precision, "cpu")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision=precision, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[FirstBatch()],
    )  # fmt: skip
    passes = []
    for _ in range(args.repeat):
        totals.clear()
        t0 = time.perf_counter()
        (metrics,) = trainer.validate(module, datamodule=dm, verbose=False)
        end = time.perf_counter()
        seconds = end - marks["first"]
        passes.append({"validate_s": end - t0, "from_first_batch_s": seconds, "stages_s": dict(totals)})
    last = passes[-1]
    return {
        "backend": backend,
        "precision": precision,
        "images": len(dm.val_dataset),
        "img_s": len(dm.val_dataset) / last["from_first_batch_s"],
        "passes": passes,
        "map_50": float(metrics["val/map_50"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="yolov5,coco", help="comma-separated map backends")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--model", default="yolov5s")
    parser.add_argument("--weights", default=None, help="yolo5l weights to validate (default: an untrained model)")
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--data-root", default="datasets/synthetic")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.chdir(REPO)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    results = [validate_once(args, b.strip()) for b in args.backends.split(",") if b.strip()]
    stages = ["forward", "val loss", "decode + NMS", "mAP update", "mAP compute"]
    first = results[0]
    print(f"\n{args.model} {args.imgsz} px, batch {args.batch}, {first['images']} images, {first['precision']}")
    print("| backend | img/s | " + " | ".join(f"{s} s" for s in stages) + " | rest s | mAP@0.5 |")
    print("|---|---:|" + "---:|" * (len(stages) + 2))
    for r in results:
        last = r["passes"][-1]
        spent = [last["stages_s"].get(s, math.nan) for s in stages]
        rest = last["from_first_batch_s"] - sum(x for x in spent if not math.isnan(x))
        cells = " | ".join(f"{x:.2f}" for x in spent)
        print(f"| {r['backend']} | {r['img_s']:.1f} | {cells} | {rest:.2f} | {r['map_50']:.4f} |")
    print("rest: loading the second and later batches (main process), Lightning's loop, logging.")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
