"""Detect objects: `python -m yolo5l.predict weights=<weights.pt|yolov5s.pt> source=<image|folder|[a.jpg,b.jpg]>`.

Writes into the run folder: each image with its boxes drawn (`save_images`), `predictions.json` (every detection:
image, class id and name, score, xyxy box in original pixels) and YOLO txt labels (`labels/<stem>.txt`:
class cx cy w h score, normalised; `save_txt`).
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from yolo5l._cli import (
    guarded,
    print_outputs,
    relpath,
    resume_gc,
    run_entry_point,
    unfreeze_start_up,
)
from yolo5l.config import check_predict_config
from yolo5l.data.layout import IMG_FORMATS
from yolo5l.errors import UserError

IMAGE_SUFFIXES = {f".{s}" for s in IMG_FORMATS}


def list_images(source: str | list[str]) -> list[Path]:
    """Image files of `source`: one image, a folder (sorted, not recursive) or a list of either."""
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    files: list[Path] = []
    for item in map(Path, map(str, items)):
        if item.is_dir():
            files += sorted(p for p in item.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        elif item.is_file():
            files.append(item)
        else:
            raise UserError(f"source {str(item)!r} not found: pass an image, a folder or a list [a.jpg,b.jpg]")
    if not files:
        raise UserError(f"source {source!r} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


@torch.inference_mode()
def predict(cfg: DictConfig) -> list[dict]:
    """Run detection as `cfg` (conf/predict.yaml) says; returns the detections written to predictions.json."""
    from yolo5l.boxes import non_max_suppression, scale_boxes
    from yolo5l.data.augment import letterbox
    from yolo5l.data.images import read_image
    from yolo5l.exported import is_exported, load_exported
    from yolo5l.hardware import inference_device
    from yolo5l.weights import load_weights, resolve_weights

    check_predict_config(cfg)
    imgsz = int(cfg.imgsz)
    source = OmegaConf.to_container(cfg.source) if OmegaConf.is_list(cfg.source) else str(cfg.source)
    files = list_images(source)
    device = inference_device(str(cfg.device))
    if is_exported(str(cfg.weights)):  # an ONNX / TorchScript file: returns the decoded boxes itself
        detector, file_names, _, _ = load_exported(str(cfg.weights), device)
    else:
        try:
            model, info = load_weights(resolve_weights(str(cfg.weights)))
        except ValueError as e:
            raise UserError(str(e).splitlines()[0]) from None
        file_names = getattr(info, "names", None) or range(model.num_classes)
        model = model.fuse().eval().to(device)

        def detector(images: torch.Tensor) -> torch.Tensor:
            return model.decode(model(images))

    names = list(cfg.names) if cfg.get("names") else list(file_names)
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "labels").mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    bs = max(1, int(cfg.batch_size))
    resume_gc()  # set-up is built (the command line paused the collector for it)
    for start in range(0, len(files), bs):
        chunk = files[start : start + bs]
        originals = [read_image(f) for f in chunk]
        boxed = [letterbox(im, imgsz, auto=False) for im in originals]
        batch = torch.from_numpy(np.stack([b[0] for b in boxed])).permute(0, 3, 1, 2).to(device).float() / 255
        dets = non_max_suppression(
            detector(batch),
            conf_thres=float(cfg.conf_thres),
            iou_thres=float(cfg.iou_thres),
            max_det=int(cfg.max_det),
        )
        for path, im, (_, ratio, pad), det in zip(chunk, originals, boxed, dets, strict=True):
            det = det.cpu()
            scale_boxes((imgsz, imgsz), det, im.shape[:2], (ratio, pad))  # ratio is (ratio_h, ratio_w)
            h, w = im.shape[:2]
            lines, drawn = [], cv2.cvtColor(im, cv2.COLOR_RGB2BGR)
            for x1, y1, x2, y2, score, cls in det.tolist():
                c = int(cls)
                name = str(names[c]) if c < len(names) else str(c)
                results.append(
                    {
                        "image": str(path),
                        "class": c,
                        "name": name,
                        "score": round(score, 5),
                        "box_xyxy": [round(v, 2) for v in (x1, y1, x2, y2)],
                    }
                )
                lines.append(
                    f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} "
                    f"{(y2 - y1) / h:.6f} {score:.5f}"
                )
                color = tuple(int(v) for v in np.random.default_rng(c).integers(64, 256, 3))
                cv2.rectangle(drawn, (int(x1), int(y1)), (int(x2), int(y2)), color, 2)
                cv2.putText(
                    drawn,
                    f"{name} {score:.2f}",
                    (int(x1), max(int(y1) - 4, 10)),
                    cv2.FONT_HERSHEY_SIMPLEX,
                    0.5,
                    color,
                    1,
                    cv2.LINE_AA,
                )
            if cfg.save_txt:
                (out / "labels" / f"{path.stem}.txt").write_text("".join(ln + "\n" for ln in lines))
            if cfg.save_images:
                cv2.imwrite(str(out / path.name), drawn)
    unfreeze_start_up()  # this run's objects become collectable (the next run of a sweep needs the memory)
    (out / "predictions.json").write_text(json.dumps(results, indent=1))
    print(f"{len(results)} detections in {len(files)} images")
    print_outputs(
        "Outputs:",
        {
            "images": relpath(out) if cfg.save_images else None,
            "detections": relpath(out / "predictions.json"),
            "YOLO txt": relpath(out / "labels") if cfg.save_txt else None,
        },
    )
    return results


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="predict")
@guarded
def _hydra_main(cfg: DictConfig) -> None:
    predict(cfg)


def main() -> None:
    """Console entry point (`python -m yolo5l.predict`, `yolo5l-predict`)."""
    run_entry_point(_hydra_main)


if __name__ == "__main__":
    main()
