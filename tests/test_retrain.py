"""The retraining loop around the core: early stopping on fitness, best.pt kept by fitness, weights that remember
their image size, the PyPI yolov5 package's pickles."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from yolo5l.callbacks import FitnessEarlyStopping, LastCheckpoint
from yolo5l.eval.metrics import DetectionMAP
from yolo5l.models.weights import load_weights


class _ScriptedFitness(DetectionMAP):
    """`fitness` replaced by the next value of a script (the tiny model's real fitness is 0 every epoch)."""

    def __init__(self, values):
        super().__init__()
        self.values = list(values)

    def compute(self):
        return {**super().compute(), "fitness": torch.tensor(self.values.pop(0))}


class _EMAAfterValidation(pl.Callback):
    """The module's weights after each validation (the EMA is swapped back by then: these are the raw ones), and
    the EMA weights the checkpoint of that moment holds."""

    def __init__(self):
        self.ema = []

    def on_validation_end(self, trainer, pl_module):
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=True)["state_dict"]
        self.ema.append({k.removeprefix("model."): v.clone() for k, v in state.items() if k.startswith("model.")})


def _module(tiny_module, values):
    module = tiny_module()
    module.map_metric = _ScriptedFitness(values)
    return module


def test_early_stopping_on_fitness_names_the_best_epoch_and_resumes_counting(
    tmp_path, tiny_module, tiny_data, make_trainer, caplog
):
    from yolo5l.callbacks import EMACallback

    ck = tmp_path / "ck"
    stop = FitnessEarlyStopping(patience=2)
    trainer = make_trainer(tmp_path, [EMACallback(tau=2), stop, LastCheckpoint(dirpath=ck)], max_epochs=10)
    with caplog.at_level("INFO"):
        trainer.fit(_module(tiny_module, [0.1, 0.3, 0.2, 0.25]), tiny_data())
    assert trainer.current_epoch == 4  # epochs 2 and 3 did not improve on epoch 1: stopped after epoch 3
    assert stop.best_epoch == 1
    assert "early stopping at epoch 3" in caplog.text
    assert "the best was epoch 1 (0.3000)" in caplog.text
    last = torch.load(ck / "last.ckpt", map_location="cpu", weights_only=True)
    state = next(v for k, v in last["callbacks"].items() if k.startswith("FitnessEarlyStopping"))
    assert (last["yolo5l_best"]["epoch"], state["wait_count"]) == (1, 2)  # best.pt's epoch, the module's record

    # Resumed (with a larger patience) the count goes on from 2: two more flat validations make 4 and stop it.
    stop2 = FitnessEarlyStopping(patience=4)
    trainer = make_trainer(tmp_path / "b", [stop2], max_epochs=10)
    trainer.fit(_module(tiny_module, [0.2, 0.25, 0.3]), tiny_data(), ckpt_path=str(ck / "last.ckpt"))
    assert stop2.patience == 4  # the resumed run's setting, not the checkpoint's
    assert stop2.best_epoch == 1
    assert trainer.current_epoch == 6  # epochs 4 and 5 ran, the count reached 4


def test_best_pt_holds_the_ema_weights_of_the_best_validation(tmp_path, tiny_module, tiny_data, make_trainer):
    from yolo5l.callbacks import EMACallback

    ck = tmp_path / "ck"
    watch = _EMAAfterValidation()
    trainer = make_trainer(tmp_path, [EMACallback(tau=2), LastCheckpoint(dirpath=ck), watch], max_epochs=3)
    trainer.fit(_module(tiny_module, [0.2, 0.5, 0.1]), tiny_data())
    best, info = load_weights(ck / "best.pt")
    assert info.names == ["a", "b"]
    assert info.imgsz is None  # TinyData has no imgsz to record
    state = best.state_dict()
    for k, v in watch.ema[1].items():  # epoch 1 (fitness 0.5) in half precision, not epoch 2's weights
        torch.testing.assert_close(state[k], v.half().to(state[k].dtype), rtol=0, atol=0)
    assert any(not torch.equal(watch.ema[1][k], watch.ema[2][k]) for k in watch.ema[1])


def test_weights_record_the_training_image_size(tmp_path):
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    save_weights(YOLOv5.from_name("yolov5n", num_classes=3), tmp_path / "w.pt", imgsz=320)
    assert load_weights(tmp_path / "w.pt")[1].imgsz == 320


def test_the_pypi_yolov5_packages_pickles_load(tmp_path, monkeypatch):
    """PyPI's `yolov5` package pickles `yolov5.models.yolo.DetectionModel`: the same classes under its package."""
    import copy
    import sys
    import types

    from test_weights import YOLOV5S_YAML, _fake_ultralytics_modules, _randomize, _ultralytics_ckpt

    fakes = _fake_ultralytics_modules()
    renamed = {f"yolov5.{name}": module for name, module in fakes.items()}
    for name, module in fakes.items():
        module.__name__ = f"yolov5.{name}"
        for obj in vars(module).values():
            if isinstance(obj, type):
                obj.__module__ = module.__name__
    root = types.ModuleType("yolov5")
    root.__path__ = []
    for name, module in {"yolov5": root, **renamed}.items():
        monkeypatch.setitem(sys.modules, name, module)
    cfg = {**copy.deepcopy(YOLOV5S_YAML), "width_multiple": 0.125, "nc": 2}
    model = renamed["yolov5.models.yolo"].DetectionModel(cfg)
    _randomize(model)
    path = tmp_path / "pypi.pt"
    torch.save(_ultralytics_ckpt(model.half()), path)
    for name in [*renamed, "yolov5"]:
        monkeypatch.delitem(sys.modules, name)  # loading must not need the package
    loaded, info = load_weights(path)
    assert info.transferred == info.total == len(loaded.state_dict())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k].to(v.dtype), v, rtol=0, atol=0)
