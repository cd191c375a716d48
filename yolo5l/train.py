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
from omegaconf import DictConfig, OmegaConf, open_dict

from yolo5l._cli import guarded, one_console_line_per_log, quiet_lightning, run_entry_point, running
from yolo5l.base.console import fail, info, is_rank_zero
from yolo5l.base.errors import UserError
from yolo5l.base.run_files import hold_run_folder, let_go_of_run_folder, refuse_if_training
from yolo5l.callbacks.checkpoint import LastCheckpoint, RunConfig
from yolo5l.callbacks.lost_rank import raise_if_rank_lost
from yolo5l.callbacks.spawned import SpawnedConsole, adopt_fit_state, fit_ran_elsewhere
from yolo5l.config import check_train_config
from yolo5l.effective_config import EffectiveConfig
from yolo5l.final_val import validate_best
from yolo5l.io.hyp_file import hyp_file_argv
from yolo5l.resume import resume_in_place, start_or_resume
from yolo5l.run_info import model_source_line, report_outputs, settle, settle_build, warn_if_crowded
from yolo5l.tracking.trackers import finish_run, instantiate_entries
from yolo5l.training.divergence import TrainingDiverged


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Instantiate the DataModule, YOLOv5Module and Trainer that `cfg` describes (no fitting).

    Usable from notebooks after `yolo5l.compose_config(...)`.

    Returns:
        (datamodule, module, trainer).
    """
    from lightning.pytorch import seed_everything

    quiet_lightning()  # a notebook's too: Lightning's tips and its own deprecations say nothing about the run

    from yolo5l.base.hardware import resolve_precision, use_tensor_cores
    from yolo5l.base.image_size import MAX_STRIDE, rounding_note
    from yolo5l.callbacks.progress_bar import with_console_progress
    from yolo5l.callbacks.sweep import SweepSummary
    from yolo5l.models.model_source import build_model, model_stride
    from yolo5l.models.yolo import freeze_layers
    from yolo5l.training.amp_check import check_amp

    seed_everything(int(cfg.seed), workers=True, verbose=False)
    typed_size = int(cfg.data.imgsz)
    fit_image_size(cfg, MAX_STRIDE)
    datamodule = instantiate(cfg.data, _convert_="all")
    model, loaded = build_model(cfg, datamodule.num_classes)  # cfg.model gets what was built (resume rebuilds it)
    if line := model_source_line(cfg, model, loaded):
        info(line)
    stride = model_stride(model)  # 64 for P6: its sizes and rectangular batches are multiples of it
    if fit_image_size(cfg, stride) != datamodule.imgsz:
        datamodule = instantiate(cfg.data, _convert_="all")
    datamodule.stride = stride
    frozen = freeze_layers(model, OmegaConf.to_object(cfg.freeze) if OmegaConf.is_list(cfg.freeze) else cfg.freeze)
    if frozen and not any(p.requires_grad for p in model.parameters()):
        last = len(model.model) - 1  # the Detect layer
        raise UserError(
            f"freeze={cfg.freeze} freezes every layer of the model ({last + 1} layers), so nothing would train: "
            f"freeze fewer (freeze=10 is v7.0's backbone; {last} leaves only the Detect layer)"
        )
    if frozen:
        info(f"froze {len(frozen)} parameter tensors (freeze={cfg.freeze})")
    module = instantiate(cfg.module, model=model, names=list(datamodule.names), _convert_="all")

    accelerator = str(cfg.trainer.accelerator)
    use_tensor_cores(accelerator)
    precision = resolve_precision(cfg.trainer.precision, accelerator)  # conf resolves it; `auto` typed means the same
    precision, amp_line = check_amp(model, precision, accelerator)
    if amp_line:
        info(amp_line)
    # a bar on a terminal only (and when turned on): Lightning's own would draw into redirected output too
    callbacks = with_console_progress(
        instantiate_entries(cfg.get("callbacks")), cfg.trainer.get("enable_progress_bar", True)
    )
    callbacks += SweepSummary.of_this_job()  # in a multirun: the sweep's summary table
    effective = EffectiveConfig.of_run(cfg)  # the start-up block and .hydra/config.yaml once the data is set up
    callbacks += [RunConfig(cfg), effective]  # the config in every checkpoint: resume= rebuilds the run from it
    loggers = instantiate_entries(cfg.get("logger"))
    trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, precision=precision, _convert_="all"
    )
    settle_build(cfg, datamodule, trainer, precision, loaded is not None, effective.overrides, effective.choices)
    if int(cfg.data.imgsz) != typed_size:
        why = rounding_note(typed_size, stride, 2 * stride)
        settle(cfg, "data.imgsz", None, f"{cfg.sources.data.imgsz}: {why}")
    return datamodule, module, trainer


def fit_image_size(cfg: DictConfig, stride: int) -> int:
    """`data.imgsz` rounded up in place to a multiple of `stride` and to at least twice it, with a warning, as v7.0's
    train.py (`check_img_size(opt.imgsz, gs, floor=gs * 2)`); returns it."""
    from yolo5l.base.image_size import fit_to_stride

    imgsz = fit_to_stride(int(cfg.data.imgsz), stride, floor=2 * stride)
    if imgsz != int(cfg.data.imgsz):  # else the value stays as composed (its source reads the interpolation)
        with open_dict(cfg):
            cfg.data.imgsz = imgsz
    return imgsz


def train(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` says, write the run folder, print where everything is; returns the final metrics. The run
    folder is locked while it trains (`hold_run_folder`): a second command resuming or writing into it is refused."""
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if is_rank_zero():  # the launching process: the ranks Lightning starts are its own
        hold_run_folder(output_dir)
    try:
        return _train(cfg, output_dir)
    finally:
        let_go_of_run_folder(output_dir)


def _train(cfg: DictConfig, output_dir: Path) -> dict[str, float]:
    hc = HydraConfig.get()
    cfg, ckpt_path = start_or_resume(cfg, list(hc.overrides.task), output_dir)  # resume=: the run's own config
    warn_if_crowded(cfg, check_train_config(cfg, multirun=hc.mode == RunMode.MULTIRUN))

    datamodule, module, trainer = build(cfg)  # the start-up block is printed as fitting starts (EffectiveConfig)
    for callback in trainer.checkpoint_callbacks:
        if ckpt_path and isinstance(callback, LastCheckpoint):
            callback.resuming = True  # its folder holds the run's own checkpoints: no "not empty" warning
    if (spawned := fit_ran_elsewhere(trainer)) == "spawn":  # new interpreters: this command's console and run logs
        trainer.callbacks.insert(0, SpawnedConsole(output_dir, hc.job.name, tidy=one_console_line_per_log))
    with running(tune_malloc=bool(cfg.get("tune_malloc", False))):  # batch-size search and fit make cycles
        if int(cfg.data.batch_size) == -1:
            settle(cfg, "data.batch_size", instantiate(cfg.tune)(trainer, module, datamodule), "batch search")
        t0 = time.perf_counter()
        try:
            trainer.fit(module, datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
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
        if spawned:
            adopt_fit_state(trainer, datamodule)  # the callbacks' state and epochs from the ranks' last.ckpt

        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        best_pt = validate_best(trainer, module, datamodule)  # the closing per-class table and plots, as YOLOv5's
    if trainer.is_global_zero:
        sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
        report_outputs(trainer, module, output_dir, wall, sweep_dir, best_pt)
    return metrics | finish_run(trainer, output_dir)  # best fitness; weights and tables to MLflow / W&B (rank 0)


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
        run_dir = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir=")), "${")
        if "${" not in run_dir and is_rank_zero():  # a folder named: refused before Hydra writes into it
            refuse_if_training(run_dir)
    except UserError as e:
        fail(str(e))
    run_entry_point(_hydra_main, "train")


if __name__ == "__main__":
    main()
