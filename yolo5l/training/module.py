"""`YOLOv5Module`: the LightningModule that composes model, loss, optimizer, schedule and mAP metric.

Every part is injected (`conf/module/yolov5.yaml` builds them): the loss as a factory of the model, the optimizer
and the schedule as partials. The module keeps YOLOv5's recipe around them: nominal-batch accumulation, warmup,
clipping at norm 10, the loss scaled by the world size, validation through NMS into the metric.

Manual optimisation, because YOLOv5's warmup ramps the gradient-accumulation count per iteration, which
Lightning's fixed `accumulate_grad_batches` cannot express.

Reference: ultralytics/yolov5 v7.0 `train.py` (nbs accumulation, warmup, clipping at norm 10, loss x WORLD_SIZE),
`val.py` (NMS thresholds, fitness).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import Metric

from yolo5l.data.image_weights import class_maps
from yolo5l.eval.best_fitness import BestFitness, checkpoint_best
from yolo5l.eval.stage_times import INFERENCE, NMS
from yolo5l.infer.boxes import labels_to_original, non_max_suppression, to_original
from yolo5l.training.divergence import LossGrowth, TrainingDiverged, describe_state, diverged, state_problem
from yolo5l.training.optim import (
    OPTIMIZER_IMPLS,
    extend_schedule,
    interp,
    optimizer_impl_kwargs,
    rescale_lr0,
    resolve_optimizer_impl,
    yolov5_param_groups,
)

__all__ = ["TrainingDiverged", "YOLOv5Module"]

_CLIP_NORM = 10.0  # YOLOv5 train.py: clip_grad_norm_(max_norm=10)
_MIN_WARMUP_ITERS = 100  # YOLOv5 train.py: nw = max(round(warmup_epochs * nb), 100)


def _loss_dict(items: Tensor, suffix: str = "") -> dict[str, Tensor]:
    """`train/loss_box|obj|cls` and `train/loss` (their sum) of a [box, obj, cls] tensor, each name + `suffix`."""
    values = (*items.unbind(), items.sum())
    return {f"train/loss{k}{suffix}": v for k, v in zip(("_box", "_obj", "_cls", ""), values, strict=True)}


def _plain(x: Any) -> Any:
    """Plain dicts/lists (no OmegaConf containers) so that checkpoints load with `weights_only=True`."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, str):
        return [_plain(v) for v in x]
    return x


class YOLOv5Module(pl.LightningModule):
    """Train / validate / predict a `YOLOv5` detector the way ultralytics' train.py and val.py do.

    The total training batch (for accumulation to `nbs` and the weight-decay scale) is the datamodule's
    `batch_size`, which is the total over all devices.

    Args:
        model: the detector (`yolo5l.models.yolo.YOLOv5`).
        loss: the loss module, or a factory called with the model (`YOLOv5Loss.from_model` as a partial).
        optimizer: a partial of a `torch.optim` class with lr (and momentum) bound; called with YOLOv5's three
            parameter groups and the implementation kwargs (`optimizer_impl`). None for validation only.
        scheduler: a partial of an epoch-stepped `LambdaLR` (`yolo5l.training.optim.LinearLR`, `CosineLR`) called with
            `optimizer` and `epochs` (the Trainer's max_epochs). None for validation only.
        metric: the validation metric (`DetectionMAP` or `COCOMap`): `update(dets, labels)`, `compute()`.
        names: class names.
        weight_decay: decay of the weight group at the nominal batch (scaled by total batch x accumulation / nbs).
        warmup_epochs: epochs of warmup (at least 100 iterations).
        warmup_momentum: momentum at the start of warmup.
        warmup_bias_lr: learning rate of the bias group at the start of warmup.
        nbs: nominal batch size: gradients accumulate up to it.
        conf_thres: validation NMS score threshold.
        iou_thres: validation NMS IoU threshold.
        max_det: detections kept per image.
        compile: `torch.compile` the model's forward (in place: state-dict keys stay the same).
        channels_last: convert the model to channels-last memory format (pair with channels-last input batches).
        optimizer_impl: "auto" (fused where it can be clipped, else foreach; see `resolve_optimizer_impl`),
            "fused", "foreach" or "loop" (torch's per-tensor reference). All give the same SGD updates.
        fuse_eval: validate a Conv+BN-fused copy of the weights being evaluated (the EMA ones with `EMACallback`),
            made once per validation epoch; False runs the training model in eval mode.
        max_nonfinite_steps: stop the run after this many optimizer steps in a row with a non-finite loss or
            gradient (each is skipped, as GradScaler skips them). Checked every `log_every_n_steps` batches.
        single_cls: validate as one class (YOLOv5 val.py `--single-cls`): NMS across classes, every detection class
            0; `names` may then be one name for a model of any class count.
        quad: the training loss counts x4 (YOLOv5 train.py `--quad`: each image of a quad batch holds four).
        augment: validate and predict with test-time augmentation (`yolo5l.infer.tta.augmented_decode`: three scales,
            one flipped); the validation loss stays that of the plain pass.
        hybrid: add each image's labels to the NMS candidates at score 1 (v7.0's `--save-hybrid`, for autolabelling:
            `yolo5l.eval.save_preds.with_label_candidates`); the metrics then count them too.
        max_loss_growth: stop the run when the epoch's running mean training loss exceeds this many times the lowest
            one so far (`yolo5l.training.divergence.LossGrowth`); None: off. Checked with `max_nonfinite_steps`.

    Non-finite weights, BatchNorm statistics or EMA at an epoch's end, and a non-finite validation loss or
    prediction, stop the run too (`yolo5l.training.divergence`).
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable[..., Optimizer] | None,
        scheduler: Callable[..., LambdaLR] | None,
        metric: Metric,
        names: Sequence[str],
        weight_decay: float = 5e-4,
        warmup_epochs: float = 3.0,
        warmup_momentum: float = 0.8,
        warmup_bias_lr: float = 0.1,
        nbs: int = 64,
        conf_thres: float = 0.001,
        iou_thres: float = 0.6,
        max_det: int = 300,
        compile: bool = False,
        channels_last: bool = False,
        optimizer_impl: str = "auto",
        fuse_eval: bool = True,
        max_nonfinite_steps: int = 50,
        single_cls: bool = False,
        quad: bool = False,
        augment: bool = False,
        hybrid: bool = False,
        max_loss_growth: float | None = 10.0,
    ) -> None:
        super().__init__()
        names = _plain(names)  # before save_hyperparameters, which reads these locals
        if len(names) != model.num_classes and not (single_cls and len(names) == 1):
            raise ValueError(f"{len(names)} class names for a model with {model.num_classes} classes")
        if optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"module.optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {optimizer_impl!r}")
        self.save_hyperparameters(ignore=["model", "loss", "optimizer", "scheduler", "metric"])
        self.automatic_optimization = False
        self.model = model
        self.loss = loss if isinstance(loss, nn.Module) else loss(model)
        self.map_metric = metric
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self._last_opt_step = -1  # ni of the last optimizer step (YOLOv5's last_opt_step)
        self._step_now = True  # whether the current micro-batch ends with an optimizer step
        self._no_sync = ExitStack()
        self._eval_model: nn.Module | None = None  # fused copy for validation; never a submodule (see below)
        self._loss_sum: Tensor | None = None  # this epoch's [box, obj, cls] summed over batches, on the device
        self._loss_batches = 0
        self._resumed_losses: tuple[Tensor, int] | None = None  # a checkpoint's epoch sums, until training starts
        self._bad_streak = torch.zeros((), dtype=torch.long)  # optimizer steps in a row with non-finite gradients
        self.step_finite: Tensor | None = None  # whether the last optimizer step was applied
        self.class_maps: np.ndarray | None = None  # per-class mAP@0.5:0.95 of the last validation in fit (v7.0 maps)
        self.best = BestFitness()  # the run's best validation: checkpointing, early stopping and the summary read it
        self._growth = LossGrowth(max_loss_growth)
        self._val_bad: Tensor | None = None  # this validation's [loss, predictions] non-finite flags, on the device

    # ---- set-up -------------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.hparams.names)

    def setup(self, stage: str) -> None:
        # Own metric states: ddp_spawn on the CPU hands the module to each rank in shared memory and Lightning
        # un-shares parameters and buffers only (the ranks would count into one image counter until a reset).
        self.map_metric.reset()
        if self.hparams.channels_last:
            self.model.to(memory_format=torch.channels_last)
        if self.hparams.compile and stage == "fit":
            self.model.compile()

    def _total_batch(self) -> int:
        datamodule = getattr(self.trainer, "datamodule", None)
        batch = getattr(datamodule, "batch_size", None)
        if not isinstance(batch, int) or batch < 1:
            raise ValueError("YOLOv5Module needs a datamodule whose batch_size is the total training batch")
        return batch

    def _full_accumulate(self) -> int:
        return max(round(self.hparams.nbs / self._total_batch()), 1)

    def configure_optimizers(self) -> dict[str, Any]:
        if self.optimizer_factory is None or self.scheduler_factory is None:
            raise ValueError("YOLOv5Module was built without an optimizer or scheduler: it can only validate")
        # ultralytics scales decay by the total batch: wd * batch * accumulate / nbs (bs 16 -> 5e-4, 128 -> 1e-3)
        wd = self.hparams.weight_decay * self._total_batch() * self._full_accumulate() / self.hparams.nbs
        impl = resolve_optimizer_impl(self.hparams.optimizer_impl, self.device.type, self._grad_scaler() is not None)
        opt = self.optimizer_factory(yolov5_param_groups(self.model, wd), **optimizer_impl_kwargs(impl))
        for group in opt.param_groups:
            if "momentum" in group:
                group.setdefault("initial_momentum", group["momentum"])  # the warmup's target
            if group.get("momentum"):
                # Zero momentum buffers give the first step exactly the update it would make without them, and let
                # a skipped first step (found_inf, see on_before_optimizer_step) leave them defined.
                for p in group["params"]:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        sched = self.scheduler_factory(optimizer=opt, epochs=self.trainer.max_epochs)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    # ---- training -----------------------------------------------------------------------------------------------
    def _warmup(self, ni: int) -> int:
        """Set lr/momentum of iteration `ni` (host floats, as YOLOv5's np.interp warmup); returns the accumulation."""
        hp, nb = self.hparams, self.trainer.num_training_batches
        nw = max(round(hp.warmup_epochs * nb), _MIN_WARMUP_ITERS)
        if ni > nw:
            return self._full_accumulate()
        xi = (0, nw)
        accumulate = max(1, round(interp(ni, xi, (1, hp.nbs / self._total_batch()))))
        lf = self.lr_schedulers().lr_lambdas[0](self.current_epoch)
        for j, group in enumerate(self.optimizers().optimizer.param_groups):
            start = hp.warmup_bias_lr if j == 0 else 0.0  # group 0 = biases
            group["lr"] = interp(ni, xi, (start, group["initial_lr"] * lf))
            if "momentum" in group:
                group["momentum"] = interp(ni, xi, (hp.warmup_momentum, group["initial_momentum"]))
        return accumulate

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        ni = batch_idx + self.trainer.num_training_batches * self.current_epoch
        self._step_now = ni - self._last_opt_step >= self._warmup(ni)
        self._ni = ni
        # DDP decides whether to all-reduce gradients when its forward runs (before training_step), so the
        # no_sync context for accumulation-only micro-batches opens here and closes in on_train_batch_end.
        if not self._step_now and isinstance(self.trainer.strategy, ParallelStrategy):
            self._no_sync.enter_context(self.trainer.strategy.block_backward_sync())

    def on_fit_start(self) -> None:
        # The loss copied the model's anchors when it was built; a restored checkpoint (resume) may have replaced
        # them since (AutoAnchor's re-fit travels in the weights): the loss follows the model.
        anchors = getattr(self.model, "anchors", None)
        if isinstance(anchors, Tensor) and hasattr(self.loss, "set_anchors"):
            self.loss.set_anchors(anchors.detach())

    def on_train_start(self) -> None:
        lr0 = getattr(self.optimizer_factory, "keywords", {}).get("lr")
        was = rescale_lr0(self.lr_schedulers(), float(lr0)) if lr0 and self.trainer.ckpt_path else None
        if was is not None:  # resume=... hyp.lr0=<other>: the restored schedule goes on at the new scale
            rank_zero_info(f"resuming with hyp.lr0={lr0:g} (the checkpoint's run had {was:g}): learning rates x "
                           f"{lr0 / was:.3g}")  # fmt: skip
        if self._resumed_losses is not None:  # resumed inside an epoch (no on_train_epoch_start): its sums go on
            self._loss_sum = self._resumed_losses[0].to(self.device)
            self._loss_batches = self._resumed_losses[1]
            self._resumed_losses = None
        # A resumed run given more epochs than its schedule was built for (trainer.max_epochs raised): the restored
        # schedule continues linearly from today's learning rate to lr0 x lrf at the new last epoch.
        extended = extend_schedule(self.lr_schedulers(), self.current_epoch, self.trainer.max_epochs)
        if extended is not None:
            now, end = extended
            schedule = (
                f"the learning rate stays at lr0 x {end:.4g}, where the schedule ended"
                if abs(now - end) <= 1e-9 * max(1.0, abs(end))
                else f"the learning rate goes linearly from lr0 x {now:.4g} to lr0 x {end:.4g}"
            )
            rank_zero_info(
                f"extending the run to {self.trainer.max_epochs} epochs: from epoch {self.current_epoch} {schedule}"
            )

    def on_train_epoch_start(self) -> None:
        self._loss_sum, self._loss_batches = None, 0

    def training_step(self, batch: Sequence[Any], batch_idx: int) -> Tensor:
        images, targets = batch[0], batch[1]
        total, items = self.loss(self.model(images), targets)  # items: detached [box, obj, cls]
        if self.hparams.get("quad"):
            total = total * 4.0  # YOLOv5 train.py: `if opt.quad: loss *= 4.`
        # DDP averages gradients over ranks; YOLOv5 multiplies by WORLD_SIZE to keep per-image sums.
        self.manual_backward(total * self.trainer.world_size)
        if self._step_now:
            opt = self.optimizers()
            opt.step()  # clipping happens in on_before_optimizer_step, after AMP unscaling
            opt.zero_grad(set_to_none=True)
            self._last_opt_step = self._ni
        self._loss_sum = items if self._loss_sum is None else self._loss_sum + items  # device add: no sync
        self._loss_batches += 1
        # Every log_every_n_steps to the loggers, as train/loss*_step (train/loss* are on_train_epoch_end's means).
        self.log_dict(_loss_dict(items, "_step"), prog_bar=False, batch_size=images.shape[0])
        return total.detach()

    def running_losses(self) -> dict[str, float]:
        """This epoch's mean [box, obj, cls] losses so far, as floats: one host sync, so call it at a refresh
        interval (the progress bar does), not every step."""
        if self._loss_sum is None:
            return {}
        box, obj, cls = (self._loss_sum / self._loss_batches).tolist()
        return {"box": box, "obj": obj, "cls": cls}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._no_sync.close()
        last = batch_idx + 1 >= self.trainer.num_training_batches
        if (batch_idx + 1) % max(1, self.trainer.log_every_n_steps) == 0 or last:
            self._check_divergence(epoch_end=last)
        if last:  # before the epoch's validation and last.ckpt (callbacks' hooks, the EMA's update, ran already)
            self._check_state()

    def _grad_scaler(self) -> Any:
        plugin = self.trainer.precision_plugin
        return getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called inside opt.step() after GradScaler.unscale_ (16-mixed), so the norm is of the true gradients. Clipped
        # here, as Lightning's Precision.clip_gradients would, minus its refusal of fused optimizers. No host sync:
        # the norm and the flags stay tensors.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, _CLIP_NORM)
        bad = ~torch.isfinite(norm)  # a non-finite loss or gradient anywhere makes the total norm non-finite
        self.step_finite = ~bad  # EMACallback keeps skipped steps out of the EMA
        self._bad_streak = torch.where(bad, self._bad_streak.to(bad.device) + 1, 0)
        if self._grad_scaler() is not None:
            return  # GradScaler skips non-finite steps itself
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = bad.float()  # the fused kernels skip the whole update on the device, as under AMP
        elif bool(bad):  # host sync, with the explicit foreach/loop implementations only: their skip needs the host
            for p in params:
                p.grad = None  # a parameter without a gradient is left alone: no momentum, no decay

    def _check_divergence(self, epoch_end: bool = False) -> None:
        """Stop a run whose steps keep failing or whose loss explodes (`yolo5l.training.divergence`). One host sync per
        logging interval reads the streak and the epoch's loss so far (under DDP after one all-reduce of the loss,
        so that every rank decides alike; the streak is the same everywhere: gradients are all-reduced)."""
        total = self._loss_sum.sum().float() if self._loss_sum is not None else torch.zeros((), device=self.device)
        values = torch.stack([total, total.new_tensor(float(self._loss_batches))])
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="sum")
        values = torch.cat([values, self._bad_streak.to(values.device, torch.float32).reshape(1)])
        loss_sum, batches, streak = values.tolist()  # the host sync
        streak = int(streak)
        if streak >= self.hparams.max_nonfinite_steps:
            what = f"{streak} optimizer steps in a row had a non-finite loss or gradient (they were skipped)"
            raise diverged(self.trainer, self._lr0(), what)
        lowest = self._growth.grew(loss_sum / batches, int(batches), epoch_end) if batches else None
        if lowest is not None:
            what = (f"the training loss exploded: its mean over the epoch so far, {loss_sum / batches:.4g}, is over "
                    f"{self._growth.factor:g} x its lowest, {lowest:.4g} (module.max_loss_growth)")  # fmt: skip
            raise diverged(self.trainer, self._lr0(), what)

    def _check_state(self) -> None:
        """Stop at an epoch end whose weights, BatchNorm statistics or EMA hold NaN or inf: no file can be saved
        from them. One host sync per epoch, plus one all-reduce under DDP (buffers differ between ranks)."""
        code, name = state_problem(self)
        if self.trainer.world_size > 1:
            agreed = int(self.trainer.strategy.reduce(torch.tensor(code, device=self.device), reduce_op="max"))
            code, name = agreed, (name if code == agreed else "")
        if code:
            raise diverged(self.trainer, self._lr0(), describe_state(code, name))

    def _lr0(self) -> float | None:
        """The initial learning rate of the optimizer's schedule (`hyp.lr0`)."""
        base = getattr(self.lr_schedulers(), "base_lrs", None)
        return float(max(base)) if base else None

    def on_train_epoch_end(self) -> None:
        if self._loss_sum is not None:  # the epoch's mean losses: every metrics.csv row carries them
            self.log_dict(_loss_dict(self._loss_sum / self._loss_batches), sync_dist=True)
        opt = self.optimizers().optimizer
        for j, group in enumerate(opt.param_groups):
            self.log(f"train/lr{j}", group["lr"])  # Python floats already on the host: no sync
        self.lr_schedulers().step()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["yolo5l_last_opt_step"] = self._last_opt_step
        checkpoint["yolo5l_lowest_loss"] = self._growth.lowest
        checkpoint["yolo5l_best"] = self.best.state_dict()
        if self._loss_sum is not None:  # a mid-epoch checkpoint (preemption): the epoch's mean losses go on
            checkpoint["yolo5l_epoch_losses"] = {"sum": self._loss_sum.detach().cpu(), "batches": self._loss_batches}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._last_opt_step = checkpoint.get("yolo5l_last_opt_step", -1)
        self._growth.lowest = checkpoint.get("yolo5l_lowest_loss")
        self.best.load_state_dict(checkpoint_best(checkpoint))
        losses = checkpoint.get("yolo5l_epoch_losses")
        self._resumed_losses = (losses["sum"], int(losses["batches"])) if losses else None

    # ---- validation / prediction ---------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        # Callbacks' hooks run before the module's, so EMACallback has already swapped the EMA weights in.
        # object.__setattr__: nn.Module's would register the copy as a submodule (and put it in checkpoints).
        object.__setattr__(self, "_eval_model", self.fused_copy() if self.hparams.fuse_eval else None)
        self._val_bad = None

    def fused_copy(self) -> nn.Module:
        """A Conv+BN-fused, eval-mode, frozen copy of the current weights (a few ms for yolov5s).

        The copy keeps the model's memory format and is never compiled (a compiled forward is bound to the
        original module); `fuse()` must exist on the model (`YOLOv5.fuse`), else the model itself is returned.
        """
        if not hasattr(self.model, "fuse"):
            return self.model
        model = copy.deepcopy(self.model)  # nn.Module.__getstate__ drops a `.compile()`d forward
        model.eval().requires_grad_(False).fuse()
        if self.hparams.channels_last:
            model.to(memory_format=torch.channels_last)  # fuse() builds new convs in the default format
        return model

    def _net(self) -> nn.Module:
        return self._eval_model if self._eval_model is not None else self.model

    def _detect(
        self, heads: Sequence[Tensor], images: Tensor | None = None, targets: Tensor | None = None
    ) -> list[Tensor]:
        """NMS of the decoded heads; with `images`, every test-time augmentation pass (`augment`), and with `targets`,
        the labels as candidates too (`hybrid`)."""
        return self._nms(self._decode(heads, images, targets))

    def _decode(self, heads: Sequence[Tensor], images: Tensor | None = None, targets: Tensor | None = None) -> Tensor:
        """The NMS candidates of `_detect`: the decoded heads (all TTA passes with `augment`), and with `hybrid` the
        labels."""
        net = self._net()
        if self.hparams.get("augment") and images is not None:
            from yolo5l.infer.tta import augmented_decode

            decoded = augmented_decode(net, images, heads)
        else:
            decoded = net.decode(heads)
        if self.hparams.get("hybrid") and targets is not None and images is not None:
            from yolo5l.eval.save_preds import with_label_candidates

            decoded = with_label_candidates(decoded, targets, images.shape[2:])
        return decoded

    def _nms(self, decoded: Tensor) -> list[Tensor]:
        # One call for the batch: candidate selection runs batched, the NMS itself image by image (infer/boxes.py).
        single_cls = bool(self.hparams.get("single_cls"))
        dets = non_max_suppression(
            decoded,
            conf_thres=self.hparams.conf_thres,
            iou_thres=self.hparams.iou_thres,
            agnostic=single_cls,
            multi_label=True,
            max_det=self.hparams.max_det,
            max_nms=30000,
        )
        if single_cls:  # YOLOv5 val.py: `if single_cls: pred[:, 5] = 0`
            for det in dets:
                det[:, 5] = 0
        return dets

    def validation_step(self, batch: Sequence[Any], batch_idx: int) -> list[Tensor]:
        """Loss and metric update of a batch; returns its detections (original-image pixels) for callbacks
        (`ValidationPlots` draws the first batches)."""
        images, targets, _, shapes = batch
        bsz, (h, w) = images.shape[0], images.shape[2:]
        profile = self.trainer.profiler.profile  # v7.0's stages, timed by `python -m yolo5l.val` (eval/stage_times.py)
        with profile(INFERENCE):
            heads = self._net()(images)
            decoded = self._decode(heads, images, targets)
        with profile(NMS):
            dets = self._nms(decoded)
        _, items = self.loss(heads, targets)  # targets are normalised to the letterboxed batch
        for name, value in zip(("box", "obj", "cls"), items, strict=True):
            self.log(f"val/loss_{name}", value, on_epoch=True, sync_dist=True, batch_size=bsz)
        bad = torch.stack([~torch.isfinite(items).all(), ~torch.isfinite(decoded).all()])  # on the device: no sync
        self._val_bad = bad if self._val_bad is None else self._val_bad | bad
        dets = to_original(dets, (h, w), shapes)
        self.map_metric.update(dets, labels_to_original(targets, (h, w), bsz, shapes))  # syncs: validation only
        return dets

    def on_validation_epoch_end(self) -> None:
        # compute() gathers every rank's states, so all ranks get (and log) the same values.
        self._eval_model = None  # free the fused copy; the next validation fuses the weights of that time
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self._check_validation()
        metrics = self.map_metric.compute()
        self.map_metric.reset()
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, prog_bar=False)
        trainer = self.trainer
        if trainer.state.fn == "fit" and not trainer.sanity_checking and "fitness" in metrics:
            keys = sorted(metrics)  # one host sync per validation
            values = torch.stack([metrics[k].float() for k in keys]).tolist()
            row = {f"val/{k}": v for k, v in zip(keys, values, strict=True)}
            self.best.update(row, trainer.current_epoch)
        if trainer.state.fn == "fit" and not trainer.sanity_checking and hasattr(self.map_metric, "per_class"):
            results = self.map_metric.per_class()  # computed above (on every rank): no second gather
            self.class_maps = class_maps(results.classes, results.map, self.model.num_classes)

    def _check_validation(self) -> None:
        """Stop at a validation whose loss or predictions are not finite (before best.pt and last.ckpt are written):
        one host sync per validation, plus one all-reduce under DDP (each rank saw its own shard)."""
        bad = self._val_bad if self._val_bad is not None else torch.zeros(2, dtype=torch.bool, device=self.device)
        bad = bad.to(torch.int32)
        if self.trainer.world_size > 1:
            bad = self.trainer.strategy.reduce(bad, reduce_op="max")
        loss_bad, pred_bad = bad.tolist()
        if loss_bad or pred_bad:
            what = "predictions hold" if not loss_bad else "loss and predictions hold" if pred_bad else "loss holds"
            raise diverged(self.trainer, self._lr0(), f"the validation {what} NaN or inf")

    def predict_step(self, batch: Any, batch_idx: int) -> list[Tensor]:
        """Detections (n, 6) [x1, y1, x2, y2, score, class] per image, in original-image pixels when shapes exist, of
        images or (images, targets, paths, shapes) batches: uint8 (a YOLODataModule loader as `dataloaders=`) or 0-1."""
        batch = (batch,) if isinstance(batch, Tensor) else batch
        images, shapes = batch[0], (batch[3] if len(batch) > 3 else None)
        images = images if images.is_floating_point() else images.float().div_(255)
        return to_original(self._detect(self.model(images), images), images.shape[2:], shapes)
