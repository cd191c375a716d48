"""Train a YOLOv5 detector: `python -m yolo5l.train [overrides]` (or `yolo5l-train`).

Examples:
    python -m yolo5l.train experiment=smoke
    python -m yolo5l.train model=yolov5n data.file=datasets/coco128/data.yaml trainer.max_epochs=30
    python -m yolo5l.train weights=yolov5s.pt data=coco128                  # fine-tune ultralytics weights
    python -m yolo5l.train resume=true                                      # continue the most recent run
    python -m yolo5l.train trainer=ddp trainer.devices=2 data.batch_size=32 # DDP, 16 images per device
    python -m yolo5l.train -m data.batch_size=8,16 data.num_workers=0,2     # sweep + summary table

The composition root: check the config (`yolo5l.config`), instantiate what `conf/` describes, fit, report.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # the collector stays off through the imports: see yolo5l._cli.pause_gc
    gc.disable()

import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from yolo5l._cli import guarded, one_console_line_per_log, run_entry_point, running
from yolo5l.base.console import fail, info, print_outputs
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.hardware import uses_cuda
from yolo5l.callbacks.checkpoint import RunConfig, find_resume_checkpoint
from yolo5l.callbacks.epoch_line import EpochLine
from yolo5l.callbacks.lost_rank import raise_if_rank_lost
from yolo5l.callbacks.val_summary import ValidationSummary, format_row
from yolo5l.config import check_train_config
from yolo5l.effective_config import EffectiveConfig
from yolo5l.io.hyp_file import apply_hyp_file, hyp_file_argv
from yolo5l.resume import resume_config, resume_in_place
from yolo5l.run_info import cpu_oversubscription, settle, settle_build
from yolo5l.tracking.trackers import finish_run, instantiate_entries
from yolo5l.training.divergence import TrainingDiverged
from yolo5l.training.final_val import validate_best


def _instantiate_all(node: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group keyed by name (callbacks, loggers); a tracker's missing extra is
    a `UserError`, an unreachable one is left out with a warning (`yolo5l.tracking.trackers.instantiate_entries`)."""
    return instantiate_entries(node)


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Instantiate the DataModule, YOLOv5Module and Trainer that `cfg` describes (no fitting).

    Usable from notebooks after `yolo5l.compose_config(...)`.

    Returns:
        (datamodule, module, trainer).
    """
    from lightning.pytorch import seed_everything

    from yolo5l.base.hardware import resolve_precision, use_tensor_cores
    from yolo5l.callbacks.progress_bar import with_console_progress
    from yolo5l.io.model_source import build_model, check_stride
    from yolo5l.models.yolo import freeze_layers
    from yolo5l.training.amp_check import check_amp

    seed_everything(int(cfg.seed), workers=True, verbose=False)
    datamodule = instantiate(cfg.data, _convert_="all")
    model, loaded = build_model(cfg, datamodule.num_classes)  # cfg.model gets what was built (resume rebuilds it)
    if loaded is not None:
        info(f"transferred {loaded.transferred}/{loaded.total} items from {cfg.weights} ({model.describe()})")
    elif cfg.data.get("file") and not cfg.get("resume"):
        info(_from_scratch_line())
    datamodule.stride = check_stride(model, int(cfg.data.imgsz))  # 64 for P6: rectangular batches use it
    frozen = freeze_layers(model, OmegaConf.to_object(cfg.freeze) if OmegaConf.is_list(cfg.freeze) else cfg.freeze)
    if frozen:
        info(f"froze {len(frozen)} parameter tensors (freeze={cfg.freeze})")
    module = instantiate(cfg.module, model=model, names=list(datamodule.names), _convert_="all")

    accelerator = str(cfg.trainer.accelerator)
    use_tensor_cores(accelerator)
    precision = resolve_precision(cfg.trainer.precision, accelerator)  # conf resolves it; `auto` typed means the same
    precision, amp_line = check_amp(model, precision, accelerator)
    if amp_line:
        info(amp_line)
    # a bar on a terminal only, none when turned off (Lightning refuses a bar callback then, and without one it adds
    # its rich bar, which draws into redirected output too)
    callbacks = with_console_progress(
        _instantiate_all(cfg.get("callbacks")), cfg.trainer.get("enable_progress_bar", True)
    )
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    if hc is not None and hc.mode == RunMode.MULTIRUN:
        from yolo5l.callbacks.sweep import SweepSummary

        callbacks.append(SweepSummary(hc.sweep.dir, int(hc.job.num), list(hc.overrides.task), hc.runtime.output_dir))
    effective = EffectiveConfig.of_run(cfg)  # the start-up block and .hydra/config.yaml once the data is set up
    callbacks += [RunConfig(cfg), effective]  # the config in every checkpoint: resume= rebuilds the run from it
    loggers = _instantiate_all(cfg.get("logger"))
    trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, precision=precision, _convert_="all"
    )
    settle_build(cfg, datamodule, trainer, precision, loaded is not None, effective.overrides, effective.choices)
    return datamodule, module, trainer


def _from_scratch_line() -> str:
    """The note for a run on a dataset of one's own without `weights=` (YOLOv5's train.py fine-tunes yolov5s.pt by
    default)."""
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    choice = str(hc.runtime.choices.get("model", "")) if hc is not None else ""
    name = choice if choice.startswith("yolov5") else "yolov5s"
    return (
        f"training from scratch (no weights=); to fine-tune the COCO-pretrained {name} as YOLOv5's train.py does "
        f"by default, add weights={name}.pt"
    )


def train(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` says, write the run folder, print where everything is; returns the final metrics."""
    hc = HydraConfig.get()
    output_dir = Path(hc.runtime.output_dir)
    ckpt_path = find_resume_checkpoint(cfg.get("resume"), output_dir.parent, exclude=output_dir)
    if ckpt_path is not None:
        cfg = resume_config(cfg, ckpt_path, list(hc.overrides.task), output_dir)
    else:  # a resumed run's config holds its hyp file's values already
        cfg = apply_hyp_file(cfg, list(hc.overrides.task), output_dir)
    world = check_train_config(cfg, multirun=hc.mode == RunMode.MULTIRUN)
    crowded = cpu_oversubscription(
        world // int(cfg.trainer.get("num_nodes") or 1), not uses_cuda(cfg.trainer.accelerator)
    )
    if crowded:
        info(f"warning: {crowded}")

    datamodule, module, trainer = build(cfg)  # the start-up block is printed as fitting starts (EffectiveConfig)
    with running(tune_malloc=bool(cfg.get("tune_malloc", False))):  # batch-size search and fit make cycles
        if int(cfg.data.batch_size) == -1:
            settle(cfg, "data.batch_size", instantiate(cfg.tune)(trainer, module, datamodule), "batch search")
        t0 = time.perf_counter()
        try:
            ckpt = str(ckpt_path) if ckpt_path else None
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
        except TrainingDiverged:
            if hc.mode != RunMode.MULTIRUN:
                raise  # its line is printed; exit status 65
            # one trial of a sweep (a sampled hyp.lr0 too high): the others go on
            info("this trial diverged (the line above): the sweep goes on, with fitness 0 for it")
            return {"val/best_fitness": 0.0}
        except Exception as e:
            raise_if_rank_lost(trainer, e)  # a collective failed for a rank that is gone: its line, exit status 75
            raise
        wall = time.perf_counter() - t0

        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        validate_best(trainer, module, datamodule)  # the closing per-class table and plots: best.pt's, as YOLOv5's
    if trainer.is_global_zero:
        _report(trainer, module, output_dir, wall, Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None)
    return metrics | finish_run(trainer, output_dir)  # best fitness; weights and tables to MLflow / W&B (rank 0)


def _report(trainer: Any, module: Any, output_dir: Path, wall: float, sweep_dir: Path | None) -> None:
    ckpt_dir = next((Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)), None)
    if ckpt_dir is None:  # no LastCheckpoint (callbacks=none): the weights still leave the run
        from yolo5l.io.weights import save_weights

        spec = getattr(trainer.datamodule, "spec", None)
        data, imgsz = getattr(spec, "file", None), getattr(trainer.datamodule, "imgsz", None)
        ckpt_dir = save_weights(module.model, output_dir / "weights.pt", module.names, imgsz=imgsz, data=data).parent

    def existing(path: Path | None) -> str | None:
        return shown_path(path) if path is not None and path.exists() else None

    csv = next((Path(lg.path) for lg in trainer.loggers if hasattr(lg, "history")), None)
    tb = any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers)
    summary = next((cb for cb in trainer.callbacks if isinstance(cb, ValidationSummary)), None)
    rows = {"best": summary.best, "last": summary.last} if summary is not None and summary.last else {}
    print_outputs(
        f"Training done in {wall:.1f} s, {_epochs_done(trainer)}. Outputs:",
        {
            **{f"{k} (epoch {r['epoch']})": format_row(r) for k, r in rows.items()},
            "run folder": shown_path(output_dir),
            "weights": existing(ckpt_dir / "weights.pt" if ckpt_dir else None),
            "checkpoint": existing(ckpt_dir / "last.ckpt" if ckpt_dir else None),
            "logs": f"tensorboard --logdir {shown_path(output_dir)}" if tb else None,
            "metrics CSV": existing(csv),
            "config": existing(output_dir / ".hydra" / "config.yaml"),
        },
    )
    if sweep_dir is not None:
        print_outputs("Sweep summary:", {"table": shown_path(sweep_dir / "summary.md")})


def _epochs_done(trainer: Any) -> str:
    """`3 epochs`, or for a resumed or extended run `1 epoch (epoch 3), 4 in all`: the epochs this command trained
    (numbered from 0, as the epoch lines)."""
    line = next((cb for cb in trainer.callbacks if isinstance(cb, EpochLine)), None)
    if line is None or line.first_epoch is None:
        return f"{trainer.current_epoch} epoch(s)"
    n, first = line.epochs_run, line.first_epoch
    text = f"{n} epoch{'s' if n != 1 else ''}"
    if first > 0:
        which = f"epoch {first}" if n == 1 else f"epochs {first}-{first + n - 1}"
        text += f" ({which}), {first + n} in all" if n else f", {first} in all"
    return text


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="train")
@guarded
def _hydra_main(cfg: DictConfig) -> float | None:
    one_console_line_per_log()
    metrics = train(cfg)
    return metrics.get("val/best_fitness")  # what a sweeper maximises: YOLOv5's fitness, best over the run


def main() -> None:
    """Console entry point (`python -m yolo5l.train`, `yolo5l-train`)."""
    try:
        # in place: DDP re-launches each rank with sys.argv
        sys.argv[1:] = hyp_file_argv(resume_in_place(sys.argv[1:]))
    except UserError as e:
        fail(str(e))
    run_entry_point(_hydra_main, "train")


if __name__ == "__main__":
    main()
