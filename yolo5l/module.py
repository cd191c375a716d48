"""`YOLOv5Module`: the LightningModule that composes model, loss and mAP metric, with YOLOv5's optimisation recipe.

Manual optimisation, because YOLOv5's warmup ramps the gradient-accumulation count per iteration, which
Lightning's fixed `accumulate_grad_batches` cannot express.

Reference: ultralytics/yolov5 v7.0 `train.py` (optimizer groups, nbs accumulation, warmup, LambdaLR schedule,
clipping at norm 10, loss x WORLD_SIZE), `val.py` (NMS thresholds, fitness); see docs/design.md "Training".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from yolo5l.boxes import non_max_suppression, scale_boxes, xywh2xyxy
from yolo5l.hostmem import tune_malloc
from yolo5l.loss import YOLOv5Loss
from yolo5l.metrics import MAP_BACKENDS, DetectionMAP, make_map_metric, summarize_map

__all__ = [
    "OPTIMIZER_IMPLS",
    "LinearLR",
    "OneCycleLR",
    "YOLOv5Module",
    "build_optimizer",
    "interp",
    "param_groups",
    "resolve_optimizer_impl",
    "use_fused",
]

OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")

_CLIP_NORM = 10.0  # YOLOv5 train.py: clip_grad_norm_(max_norm=10)


def interp(x: float, xp: Sequence[float], fp: Sequence[float]) -> float:
    """`np.interp` for two points, in Python floats (clamped outside [xp[0], xp[1]])."""
    (x0, x1), (y0, y1) = xp, fp
    if x <= x0:
        return float(y0)
    if x >= x1:
        return float(y1)
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class LinearLR:
    """YOLOv5's linear schedule factor `lf(x) = (1 - x / epochs) (1 - lrf) + lrf` (a picklable LambdaLR lambda)."""

    def __init__(self, epochs: int, lrf: float) -> None:
        self.epochs, self.lrf = int(epochs), float(lrf)

    def __call__(self, epoch: int) -> float:
        return (1 - epoch / self.epochs) * (1.0 - self.lrf) + self.lrf


class OneCycleLR:
    """YOLOv5's `--cos-lr` factor `((1 - cos(x pi / epochs)) / 2) (lrf - 1) + 1` (utils/general.py one_cycle)."""

    def __init__(self, epochs: int, lrf: float) -> None:
        self.epochs, self.lrf = int(epochs), float(lrf)

    def __call__(self, epoch: int) -> float:
        return ((1 - math.cos(epoch * math.pi / self.epochs)) / 2) * (self.lrf - 1) + 1


def param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Split trainable parameters as YOLOv5's `smart_optimizer`: (biases, decayed weights, norm-layer weights)."""
    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    biases: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue  # frozen layers (--freeze) stay out of the optimizer
            if name == "bias":
                biases.append(p)
            elif name == "weight" and isinstance(module, norm_types):
                no_decay.append(p)
            else:
                decay.append(p)
    return biases, decay, no_decay


def use_fused(device_type: str, mixed_precision: bool) -> bool:
    """Whether to ask for the fused (single-kernel) optimizer step: `resolve_optimizer_impl("auto", ...) == "fused"`.

    Args:
        device_type: "cuda", "cpu", ...
        mixed_precision: whether a GradScaler unscales the gradients (16-mixed).
    """
    return resolve_optimizer_impl("auto", device_type, grad_scaler=mixed_precision) == "fused"


def resolve_optimizer_impl(impl: str, device_type: str, grad_scaler: bool) -> str:
    """The optimizer implementation to build: "fused", "foreach" or "loop".

    "auto" picks fused (one kernel over all parameters; bit-identical to the loop for SGD) on CPU and CUDA, except
    when a GradScaler (16-mixed) is in use: a fused step unscales inside `step()`, after the point where YOLOv5
    clips at norm 10, and Lightning 2.6.6's `MixedPrecision.clip_gradients` refuses fused optimizers; foreach there.
    Under bf16-mixed and 32-true there is no scaler and the module clips the gradients itself (see
    `YOLOv5Module.on_before_optimizer_step`), so fused and clipping coexist.

    Args:
        impl: one of `OPTIMIZER_IMPLS` ("loop" = torch's per-tensor reference implementation).
        device_type: the parameters' device type.
        grad_scaler: whether a GradScaler unscales the gradients (16-mixed).

    Raises:
        ValueError: unknown `impl`, or "fused" with a GradScaler.
    """
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"yolo5l/module.py: optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {impl!r}")
    if impl == "fused" and grad_scaler:
        raise ValueError(
            "yolo5l/module.py: optimizer_impl='fused' cannot be clipped under 16-mixed (the GradScaler unscales "
            "inside the fused step); use optimizer_impl='foreach' or 'auto', or precision bf16-mixed"
        )
    if impl != "auto":
        return impl
    return "fused" if device_type in ("cpu", "cuda") and not grad_scaler else "foreach"


def build_optimizer(
    name: str,
    groups: tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]],
    lr: float,
    momentum: float,
    weight_decay: float,
    fused: bool = False,
    impl: str | None = None,
) -> torch.optim.Optimizer:
    """YOLOv5's optimizer with group order [biases (no decay), weights (decay), norm weights (no decay)].

    Args:
        name: "SGD" (nesterov), "Adam" or "AdamW" (betas (momentum, 0.999)).
        groups: output of `param_groups`.
        lr: initial learning rate lr0.
        momentum: SGD momentum / Adam beta1.
        weight_decay: decay of the weight group (already scaled by the nominal batch size).
        fused: fused step kernels (see `use_fused`); foreach otherwise.
        impl: "fused", "foreach" or "loop" (see `resolve_optimizer_impl`); overrides `fused` when given.

    Returns:
        The optimizer; group 0 holds the biases (the warmup gives them their own lr ramp).

    Raises:
        ValueError: unknown optimizer name.
    """
    biases, decay, no_decay = groups
    impl = impl or ("fused" if fused else "foreach")
    if impl not in ("fused", "foreach", "loop"):
        raise ValueError(f"yolo5l/module.py: optimizer impl must be 'fused', 'foreach' or 'loop', got {impl!r}")
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    if name == "SGD":
        opt: torch.optim.Optimizer = torch.optim.SGD(biases, lr=lr, momentum=momentum, nesterov=True, **impl)
    elif name in ("Adam", "AdamW"):
        cls = torch.optim.Adam if name == "Adam" else torch.optim.AdamW
        opt = cls(biases, lr=lr, betas=(momentum, 0.999), weight_decay=0.0, **impl)
    else:
        raise ValueError(f"yolo5l/module.py: optimizer must be 'SGD', 'Adam' or 'AdamW', got {name!r}")
    opt.add_param_group({"params": decay, "weight_decay": weight_decay})
    opt.add_param_group({"params": no_decay, "weight_decay": 0.0})
    return opt


def _plain(x: Any) -> Any:
    """Plain dicts/lists (no OmegaConf containers) so that checkpoints load with `weights_only=True`."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, str):
        return [_plain(v) for v in x]
    return x


class YOLOv5Module(pl.LightningModule):
    """Train / validate / predict a `YOLOv5` detector the way ultralytics' train.py and val.py do.

    Args:
        model: the detector (`yolo5l.models.yolo.YOLOv5`).
        hyp: YOLOv5 hyperparameters (lr0, lrf, momentum, weight_decay, warmup_*, loss gains; see conf/hyp).
        batch_size: per-device training batch size.
        imgsz: training image size (scales the objectness gain).
        names: class names.
        optimizer: "SGD", "Adam" or "AdamW".
        nbs: nominal batch size: gradients accumulate up to it, and weight decay scales with it.
        cos_lr: one-cycle cosine schedule instead of linear.
        conf_thres: validation NMS score threshold.
        iou_thres: validation NMS IoU threshold.
        max_det: detections kept per image.
        compile: `torch.compile` the model's forward (in place: state-dict keys stay the same).
        channels_last: convert the model to channels-last memory format (pair with channels-last input batches).
        optimizer_impl: "auto" (fused where it can be clipped, else foreach; see `resolve_optimizer_impl`),
            "fused", "foreach" or "loop" (torch's per-tensor reference). All give the same SGD updates.
        ciou_backend: CIoU implementation of the box loss (`YOLOv5Loss`): "auto" (fused: Triton on CUDA, the
            analytic CPU kernel otherwise), "reference" (autograd composition of small ops), "cpu", "compiled".
        fuse_eval: validate a Conv+BN-fused copy of the weights being evaluated (the EMA ones with `EMACallback`),
            made once per validation epoch; False runs the training model in eval mode. Same detections up to
            float rounding.
        tune_malloc: make glibc keep freed host memory for reuse (`yolo5l.hostmem.tune_malloc`, process-wide,
            applied in `setup`): no page faults re-zeroing the activation buffers every step on the CPU.
        map_backend: "yolov5" (YOLOv5's own matching and AP, `DetectionMAP`; milliseconds to compute) or "coco"
            (torchmetrics' COCO protocol via faster_coco_eval, `make_map_metric`). Same `val/*` keys.
    """

    def __init__(
        self,
        model: nn.Module,
        hyp: Mapping[str, Any],
        batch_size: int,
        imgsz: int,
        names: Sequence[str],
        optimizer: str = "SGD",
        nbs: int = 64,
        cos_lr: bool = False,
        conf_thres: float = 0.001,
        iou_thres: float = 0.6,
        max_det: int = 300,
        compile: bool = False,
        channels_last: bool = False,
        optimizer_impl: str = "auto",
        fuse_eval: bool = True,
        ciou_backend: str = "auto",
        tune_malloc: bool = True,
        map_backend: str = "yolov5",
    ) -> None:
        super().__init__()
        hyp, names = _plain(hyp), _plain(names)  # before save_hyperparameters, which reads these locals
        missing = [k for k in ("lr0", "lrf", "momentum", "weight_decay", "warmup_epochs") if k not in hyp]
        if missing:
            raise KeyError(f"yolo5l/module.py: hyp lacks {missing}; add them to the hyp config (see conf/hyp)")
        if len(names) != model.num_classes:
            raise ValueError(f"yolo5l/module.py: {len(names)} class names for a model with {model.num_classes} classes")
        if optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"yolo5l/module.py: optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {optimizer_impl!r}"
            )
        if map_backend not in MAP_BACKENDS:
            raise ValueError(f"yolo5l/module.py: map_backend must be one of {MAP_BACKENDS}, got {map_backend!r}")
        self.save_hyperparameters(ignore=["model"])
        self.automatic_optimization = False
        self.model = model
        self.loss = YOLOv5Loss.from_model(model, hyp, imgsz, ciou_backend=ciou_backend)
        self.map_metric = DetectionMAP() if map_backend == "yolov5" else make_map_metric(max_det)
        self._last_opt_step = -1  # ni of the last optimizer step (YOLOv5's last_opt_step)
        self._step_now = True  # whether the current micro-batch ends with an optimizer step
        self._no_sync = ExitStack()
        self._eval_model: nn.Module | None = None  # fused copy for validation; never a submodule (see below)

    # ---- set-up -------------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.hparams.names)

    def setup(self, stage: str) -> None:
        if self.hparams.tune_malloc:
            tune_malloc()
        if self.hparams.channels_last:
            self.model.to(memory_format=torch.channels_last)
        if self.hparams.compile and stage == "fit":
            self.model.compile()

    def _total_batch(self) -> int:
        return self.hparams.batch_size * self.trainer.world_size

    def _full_accumulate(self) -> int:
        return max(round(self.hparams.nbs / self._total_batch()), 1)

    def _lf(self) -> LinearLR | OneCycleLR:
        epochs, lrf = self.trainer.max_epochs, self.hparams.hyp["lrf"]
        if epochs is None or epochs < 1:
            raise ValueError("yolo5l/module.py: set trainer max_epochs (the LR schedule spans it)")
        return OneCycleLR(epochs, lrf) if self.hparams.cos_lr else LinearLR(epochs, lrf)

    def configure_optimizers(self) -> dict[str, Any]:
        hyp = self.hparams.hyp
        # ultralytics scales decay by the total batch: wd * batch * accumulate / nbs (bs 16 -> 5e-4, 128 -> 1e-3)
        wd = hyp["weight_decay"] * self._total_batch() * self._full_accumulate() / self.hparams.nbs
        impl = resolve_optimizer_impl(self.hparams.optimizer_impl, self.device.type, self._grad_scaler() is not None)
        opt = build_optimizer(
            self.hparams.optimizer, param_groups(self.model), hyp["lr0"], hyp["momentum"], wd, impl=impl
        )
        sched = LambdaLR(opt, lr_lambda=self._lf())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    # ---- training -----------------------------------------------------------------------------------------------
    def _warmup(self, ni: int) -> int:
        """Set lr/momentum of iteration `ni` (host floats, as YOLOv5's np.interp warmup); returns the accumulation."""
        hyp, nb = self.hparams.hyp, self.trainer.num_training_batches
        nw = max(round(hyp["warmup_epochs"] * nb), 100)  # at least 100 warmup iterations, as YOLOv5
        if ni > nw:
            return self._full_accumulate()
        xi = (0, nw)
        accumulate = max(1, round(interp(ni, xi, (1, self.hparams.nbs / self._total_batch()))))
        lf = self._lf()(self.current_epoch)
        for j, group in enumerate(self.optimizers().optimizer.param_groups):
            start = hyp.get("warmup_bias_lr", 0.1) if j == 0 else 0.0  # group 0 = biases
            group["lr"] = interp(ni, xi, (start, group["initial_lr"] * lf))
            if "momentum" in group:
                group["momentum"] = interp(ni, xi, (hyp.get("warmup_momentum", 0.8), hyp["momentum"]))
        return accumulate

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        ni = batch_idx + self.trainer.num_training_batches * self.current_epoch
        self._step_now = ni - self._last_opt_step >= self._warmup(ni)
        self._ni = ni
        # DDP decides whether to all-reduce gradients when its forward runs (before training_step), so the
        # no_sync context for accumulation-only micro-batches opens here and closes in on_train_batch_end.
        if not self._step_now and isinstance(self.trainer.strategy, ParallelStrategy):
            self._no_sync.enter_context(self.trainer.strategy.block_backward_sync())

    def training_step(self, batch: Sequence[Any], batch_idx: int) -> Tensor:
        images, targets = batch[0], batch[1]
        total, items = self.loss(self.model(images), targets)  # items: detached [box, obj, cls]
        # DDP averages gradients over ranks; YOLOv5 multiplies by WORLD_SIZE to keep per-image sums.
        self.manual_backward(total * self.trainer.world_size)
        if self._step_now:
            opt = self.optimizers()
            opt.step()  # clipping happens in on_before_optimizer_step, after AMP unscaling
            opt.zero_grad(set_to_none=True)
            self._last_opt_step = self._ni
        losses = {"train/loss_box": items[0], "train/loss_obj": items[1], "train/loss_cls": items[2]}
        self.log_dict({**losses, "train/loss": items.sum()}, prog_bar=False, batch_size=images.shape[0])
        return total.detach()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._no_sync.close()

    def _grad_scaler(self) -> Any:
        plugin = self.trainer.precision_plugin
        return getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called inside opt.step() after GradScaler.unscale_ (16-mixed), so the norm is of the true gradients.
        if self._grad_scaler() is not None:
            self.clip_gradients(optimizer, gradient_clip_val=_CLIP_NORM, gradient_clip_algorithm="norm")
            return
        # No scaler (32-true, bf16-mixed): the gradients are the true ones, so clip them directly, which is what
        # Lightning's Precision.clip_gradients does, minus its refusal of fused optimizers. No host sync: the
        # clip coefficient stays a tensor.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, _CLIP_NORM)

    def on_train_epoch_end(self) -> None:
        opt = self.optimizers().optimizer
        for j, group in enumerate(opt.param_groups):
            self.log(f"train/lr{j}", group["lr"])  # Python floats already on the host: no sync
        self.lr_schedulers().step()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["yolo5l_last_opt_step"] = self._last_opt_step

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._last_opt_step = checkpoint.get("yolo5l_last_opt_step", -1)

    # ---- validation / prediction ---------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        # Callbacks' hooks run before the module's, so EMACallback has already swapped the EMA weights in.
        # object.__setattr__: nn.Module's would register the copy as a submodule (and put it in checkpoints).
        object.__setattr__(self, "_eval_model", self.fused_copy() if self.hparams.fuse_eval else None)

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

    def _detect(self, heads: Sequence[Tensor]) -> list[Tensor]:
        # One call for the batch: candidate selection runs batched, the NMS itself image by image (see boxes.py).
        return non_max_suppression(
            self._net().decode(heads),
            conf_thres=self.hparams.conf_thres,
            iou_thres=self.hparams.iou_thres,
            multi_label=True,
            max_det=self.hparams.max_det,
            max_nms=30000,
        )

    @staticmethod
    def _to_original(dets: list[Tensor], img_hw: Sequence[int], shapes: Sequence[Any] | None) -> list[Tensor]:
        """Scale (n, 6) detections from the letterboxed batch back to each original image (shapes[i] may be None)."""
        if shapes is None:
            return dets
        for det, shape in zip(dets, shapes, strict=True):
            if shape is not None:
                scale_boxes(img_hw, det, shape[0], shape[1])
        return dets

    def validation_step(self, batch: Sequence[Any], batch_idx: int) -> None:
        images, targets, _, shapes = batch
        bsz, (h, w) = images.shape[0], images.shape[2:]
        heads = self._net()(images)
        _, items = self.loss(heads, targets)  # targets are normalised to the letterboxed batch
        for name, value in zip(("box", "obj", "cls"), items, strict=True):
            self.log(f"val/loss_{name}", value, on_epoch=True, sync_dist=True, batch_size=bsz)
        dets = self._to_original(self._detect(heads), (h, w), shapes)

        # Ground truth per image, in the same original-image pixels (validation only: these sync the host).
        order = torch.argsort(targets[:, 0], stable=True)
        t = targets[order]
        gt_boxes = xywh2xyxy(t[:, 2:6] * torch.tensor([w, h, w, h], device=t.device, dtype=t.dtype))
        gt = torch.cat((gt_boxes, t[:, 1:2]), 1).split(torch.bincount(t[:, 0].long(), minlength=bsz).tolist())
        gt = self._to_original([g.clone() for g in gt], (h, w), shapes)
        if isinstance(self.map_metric, DetectionMAP):
            self.map_metric.update(dets, gt)
        else:
            self.map_metric.update(
                [{"boxes": d[:, :4], "scores": d[:, 4], "labels": d[:, 5].long()} for d in dets],
                [{"boxes": g[:, :4], "labels": g[:, 4].long()} for g in gt],
            )

    def on_validation_epoch_end(self) -> None:
        # compute() gathers every rank's states, so all ranks get (and log) the same values.
        self._eval_model = None  # free the fused copy; the next validation fuses the weights of that time
        result = self.map_metric.compute()
        metrics = result if isinstance(self.map_metric, DetectionMAP) else summarize_map(result)
        self.map_metric.reset()
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, prog_bar=False)

    def predict_step(self, batch: Any, batch_idx: int) -> list[Tensor]:
        """Detections (n, 6) [x1, y1, x2, y2, score, class] per image, in original-image pixels when shapes exist."""
        if isinstance(batch, Tensor):
            images, shapes = batch, None
        else:  # (images, targets, paths, shapes) like the validation batches
            images, shapes = batch[0], (batch[3] if len(batch) > 3 else None)
        return self._to_original(self._detect(self.model(images)), images.shape[2:], shapes)
