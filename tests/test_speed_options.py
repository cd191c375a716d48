"""The training speed options give the same results as their slow baselines (nothing here is timed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from yolo5l.callbacks import EMACallback
from yolo5l.models.yolo import YOLOv5
from yolo5l.training.optim import optimizer_impl_kwargs, resolve_optimizer_impl, yolov5_param_groups

pytestmark = pytest.mark.usefixtures("one_thread")


class _Holder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(2, 3))


def _ema_after_updates(foreach: bool, steps: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = _Holder()
    ema = EMACallback(decay=0.9, tau=3, foreach=foreach)
    ema.on_fit_start(None, module)
    ema.on_train_start(SimpleNamespace(global_step=0), module)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p))
            module.model[1].num_batches_tracked += 1
            module.model[1].running_mean.add_(0.5)
        ema.on_train_batch_end(SimpleNamespace(global_step=step), module, None, None, step)
    return {k: v.clone() for k, v in ema.ema_state_dict.items()}


def test_foreach_ema_equals_per_tensor_loop():
    fast, loop = _ema_after_updates(True), _ema_after_updates(False)
    assert fast.keys() == loop.keys()
    for k in fast:
        assert torch.equal(fast[k], loop[k]), k
    # and both are the EMA: after 5 updates the int buffer is copied, the floats moved away from the start
    assert int(fast["model.1.num_batches_tracked"]) == 5
    assert not torch.equal(fast["model.1.running_mean"], torch.zeros(4))


def test_ema_loop_matches_hand_computed_value():
    module = _Holder()
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    ema = EMACallback(decay=0.5, tau=1e-9, foreach=False)  # d = 0.5 from the first update
    ema.on_fit_start(None, module)
    ema.on_train_start(SimpleNamespace(global_step=0), module)
    with torch.no_grad():
        module.model[2].bias.fill_(4.0)
    ema.on_train_batch_end(SimpleNamespace(global_step=1), module, None, None, 0)
    ema.on_train_batch_end(SimpleNamespace(global_step=2), module, None, None, 1)
    # v1 = 0.5 * 0 + 0.5 * 4 = 2, v2 = 0.5 * 2 + 0.5 * 4 = 3
    torch.testing.assert_close(ema.ema_state_dict["model.2.bias"], torch.full((3,), 3.0))


def test_resolve_optimizer_impl(tiny_module):
    assert resolve_optimizer_impl("auto", "cpu", grad_scaler=False) == "fused"
    assert resolve_optimizer_impl("auto", "cuda", grad_scaler=False) == "fused"
    assert resolve_optimizer_impl("auto", "cuda", grad_scaler=True) == "foreach"
    assert resolve_optimizer_impl("auto", "mps", grad_scaler=False) == "foreach"
    assert resolve_optimizer_impl("loop", "cpu", grad_scaler=False) == "loop"
    with pytest.raises(ValueError, match="16-mixed"):
        resolve_optimizer_impl("fused", "cuda", grad_scaler=True)
    with pytest.raises(ValueError, match="optimizer_impl"):
        resolve_optimizer_impl("apex", "cpu", grad_scaler=False)
    with pytest.raises(ValueError, match="optimizer_impl"):
        tiny_module(optimizer_impl="apex")


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_fused_foreach_and_loop_optimizers_agree(name):
    torch.manual_seed(0)
    base = YOLOv5(num_classes=2, depth=0.33, width=0.125)
    grads = [[torch.randn_like(p) * 1e-2 for p in base.parameters()] for _ in range(3)]
    final = {}
    for impl in ("loop", "foreach", "fused"):
        model = YOLOv5(num_classes=2, depth=0.33, width=0.125)
        model.load_state_dict(base.state_dict())
        kinds = {"SGD": (torch.optim.SGD, {"momentum": 0.937, "nesterov": True}), "AdamW": (torch.optim.AdamW, {})}
        cls, kw = kinds[name]
        opt = cls(yolov5_param_groups(model, 5e-4), lr=0.01, **kw, **optimizer_impl_kwargs(impl))
        assert opt.defaults.get("fused") is (True if impl == "fused" else None)
        for step in grads:
            for p, g in zip(model.parameters(), step, strict=True):
                p.grad = g.clone()
            opt.step()
        final[impl] = [p.detach().clone() for p in model.parameters()]
    for impl in ("foreach", "fused"):
        for a, b in zip(final[impl], final["loop"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(a, p) for a, p in zip(final["loop"], base.parameters(), strict=True))


@pytest.fixture
def fit_weights(tiny_module, tiny_data, make_trainer):
    """`fit_weights(tmp_path, **module_kw)`: the model weights after one epoch of the tiny module on `tiny_data`."""

    def fit(tmp_path, **module_kw) -> dict[str, torch.Tensor]:
        module = tiny_module(**module_kw)
        tr = make_trainer(tmp_path, max_epochs=1, limit_val_batches=0)
        tr.fit(module, tiny_data())
        return {k: v.detach().clone() for k, v in module.model.state_dict().items()}

    return fit


def test_fused_optimizer_and_fused_ciou_train_like_the_baseline(tmp_path, fit_weights):
    fast = fit_weights(tmp_path / "a", optimizer_impl="auto", ciou_backend="auto")
    slow = fit_weights(tmp_path / "b", optimizer_impl="loop", ciou_backend="reference")
    for k in fast:
        torch.testing.assert_close(fast[k], slow[k], rtol=1e-4, atol=1e-5, msg=k)


def test_fused_optimizer_is_clipped_under_bf16_mixed(tmp_path, tiny_module, tiny_data, make_trainer):
    """Lightning refuses to clip fused optimizers under mixed precision; the module clips itself without a scaler."""
    module = tiny_module(channels_last=True)
    seen = []

    class Spy(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer.defaults.get("fused"))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(bool(torch.isfinite(outputs["loss"])))

    tr = make_trainer(tmp_path, [Spy()], max_epochs=1, limit_val_batches=0, precision="bf16-mixed")
    tr.fit(module, tiny_data(n=8, batch_size=4))
    assert module.optimizers().optimizer.defaults["fused"] is True
    assert all(seen)
    assert len(seen) >= 2


def test_clipping_without_scaler_matches_norm_10(tmp_path, tiny_module, tiny_data, make_trainer):
    module = tiny_module()
    tr = make_trainer(tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=0)
    tr.fit(module, tiny_data())  # attaches the trainer, builds the optimizer
    opt = module.optimizers().optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    n = sum(p.numel() for p in params)
    module.on_before_optimizer_step(opt)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    torch.testing.assert_close(total, torch.tensor(10.0), rtol=1e-4, atol=0)  # 3 sqrt(n) > 10: scaled to 10
    torch.testing.assert_close(params[0].grad[0].flatten()[0], torch.tensor(10.0 / n**0.5), rtol=1e-4, atol=0)


def test_channels_last_bf16_module_trains(tmp_path, tiny_module, tiny_data, make_trainer):
    class ChannelsLastData(tiny_data):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return (batch[0].contiguous(memory_format=torch.channels_last), *batch[1:])

    module = tiny_module(channels_last=True)
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[0].is_contiguous(memory_format=torch.channels_last))

    tr = make_trainer(tmp_path, [Spy()], max_epochs=1, precision="bf16-mixed")
    tr.fit(module, ChannelsLastData())
    assert seen
    assert all(seen)
    assert module.model.model[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.isfinite(tr.callback_metrics["val/map"])


@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_eval_copy_gives_the_same_detections(channels_last, tiny_module):
    module = tiny_module(channels_last=channels_last)
    model = module.model
    with torch.no_grad():  # non-trivial BN statistics, so the fold is actually exercised
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused = module.fused_copy()
    assert fused is not model
    assert not fused.training
    assert all(m.bn is None for m in fused.modules() if hasattr(m, "bn"))
    assert all(not p.requires_grad for p in fused.parameters())
    assert "_eval_model" not in dict(module.named_modules())
    x = torch.rand(2, 3, 64, 64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        assert fused.model[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        ref, out = model.decode(model(x)), fused.decode(fused(x))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the training model is untouched
    module.on_validation_epoch_start()  # as during validation: the copy stays out of the checkpoint
    assert module._eval_model is not None
    assert set(module.state_dict()) == {k for k in module.state_dict() if "_eval_model" not in k}
    assert len([k for k in module.state_dict() if k.startswith("model.")]) == len(before)


def test_fused_eval_validation_equals_unfused(tmp_path, tiny_module, tiny_data, make_trainer):
    results = {}
    for fuse in (True, False):
        module = tiny_module(fuse_eval=fuse)
        tr = make_trainer(tmp_path / str(fuse), [EMACallback(tau=2)], max_epochs=1)
        tr.fit(module, tiny_data())
        assert module._eval_model is None  # freed after validation
        results[fuse] = {k: float(v) for k, v in tr.callback_metrics.items() if k.startswith("val/")}
    assert results[True].keys() == results[False].keys()
    for k in results[True]:
        assert results[True][k] == pytest.approx(results[False][k], abs=1e-4), k


def _backward_nodes(t: torch.Tensor) -> set[str]:
    """Names of the autograd nodes that produced `t`."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def test_ciou_backend_decides_the_kernel_of_the_loss(tiny_module):
    """`module.loss.ciou_backend` reaches the box loss: "cpu" runs the analytic kernel (its own backward node),
    "reference" the pure-torch composition; both give the same loss."""
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.5]])
    totals = {}
    for backend in ("cpu", "reference"):
        module = tiny_module(ciou_backend=backend)  # seeded: the same weights each time
        total, _ = module.loss(
            module.model(torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))), targets
        )
        totals[backend] = total
        assert ("_CIoUTorchBackward" in _backward_nodes(total)) == (backend == "cpu"), backend
    torch.testing.assert_close(totals["cpu"], totals["reference"], rtol=1e-5, atol=1e-6)


_MALLOC = """
import os
import yolo5l.base.hostmem as hostmem
from yolo5l._cli import run_entry_point, running
from yolo5l.train import main  # as pip's console script: `main` of a yolo5l module in __main__

with running(tune_malloc=True):  # called from code: a notebook, a test
    print("code", hostmem._applied is not None)

def command():
    with running(tune_malloc=os.environ["TUNE_MALLOC"] == "on"):
        print("command", hostmem._applied is not None, flush=True)

run_entry_point(command, "train")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt (Linux)")
@pytest.mark.parametrize("option", ["on", "off"])
def test_tune_malloc_applies_on_the_command_line_only(tmp_path, option):
    """`tune_malloc` is process-wide: the work block of a command applies it, called from code it leaves the
    allocator alone."""
    r = subprocess.run(
        [sys.executable, "-c", _MALLOC],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "TUNE_MALLOC": option},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["code False", f"command {option == 'on'}"], r.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "clang", "c++", "g++")),
    reason="torch.compile's CPU backend (inductor) builds C++: no compiler on this machine",
)
def test_compiled_module_trains(tmp_path, tiny_module, tiny_data, make_trainer):
    """`module.compile=true` trains and validates through the compiled model (any failure is a failure)."""
    module = tiny_module(compile=True)
    tr = make_trainer(tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    tr.fit(module, tiny_data())
    assert module.model._compiled_call_impl is not None
    assert torch.isfinite(tr.callback_metrics["val/map"])


def test_batch_nms_equals_image_by_image_calls(tiny_module):
    from yolo5l.infer.boxes import non_max_suppression

    module = tiny_module()
    module.model.eval()
    torch.manual_seed(1)
    heads = module.model(torch.rand(3, 3, 64, 64))
    dets = module._detect(heads)  # the whole batch in one call
    pred = module.model.decode(heads)
    ref = [non_max_suppression(pred[i : i + 1], 0.001, 0.6, multi_label=True, max_det=300)[0] for i in range(3)]
    assert len(dets) == 3
    assert sum(len(d) for d in dets) > 0
    for d, r in zip(dets, ref, strict=True):
        assert torch.equal(d, r)
