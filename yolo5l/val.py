"""Validate weights on a dataset split: `python -m yolo5l.val weights=<weights.pt|yolov5s.pt> [data=...] [task=...]`.

Prints the mAP table (precision, recall, mAP@0.5, mAP@0.5:0.95) and writes it as `metrics.json` in the run folder,
then the per-class table (`per_class.csv`), v7.0's `Speed:` line (per-image pre-process, inference and NMS times,
`yolo5l.eval.stage_times`) and, unless `plots=false`, ultralytics' validation plots
(`yolo5l.callbacks.val_plots.ValidationPlots`; an exported file gets all but the drawn batches).
The data and module come from the same configs as training (`module.conf_thres`, `module/metric=coco`, ...). It runs
in float32 unless `half=true`, as v7.0's val.py (`trainer.precision` in conf/val.yaml); an image size that is not a
multiple of the model's largest stride is rounded up to one, with a warning, as v7.0.

`task=val|test|train` validates on that split of the data yaml; `task=speed` and `task=study` time the model
(`yolo5l.val_tasks`). `augment=true` adds test-time augmentation (`yolo5l.infer.tta`); `save_txt`, `save_conf`,
`save_hybrid` and `save_json` save the predictions (`yolo5l.eval.save_preds`), and a COCO results file is scored against
the COCO annotations when they are there.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from yolo5l._cli import guarded, one_console_line_per_log, run_entry_point
from yolo5l.validation import validate_weights


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="val")
@guarded
def _hydra_main(cfg: DictConfig) -> float | None:
    one_console_line_per_log()
    return validate_weights(cfg).get("val/map")


def main() -> None:
    """Console entry point (`python -m yolo5l.val`, `yolo5l-val`)."""
    run_entry_point(_hydra_main, "val")


if __name__ == "__main__":
    main()
