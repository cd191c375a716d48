"""The TensorBoard model graph: a run's event file holds the detector's graph, traced at the training size; the trace
leaves the model in training as it was (weights, batch-norm statistics, modes, random state); a model that does not
trace is one warning line; log_graph=false writes none."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch import nn

from yolo5l.config import compose_config
from yolo5l.models.yolo import YOLOv5
from yolo5l.tracking.tensorboard import TensorBoardLogger

#: A run of a few seconds: the smoke experiment, 2 training batches and 1 validation batch, 1 epoch.
TINY = [
    "experiment=smoke", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks.batch_plotter.num_batches=1",
    "plots=false",
]  # fmt: skip


def _graph(folder):
    events = EventAccumulator(str(folder))
    events.Reload()
    return events.Graph() if events.Tags()["graph"] else None


def _input_shape(graph) -> list[int]:
    (node,) = [n for n in graph.node if n.op == "IO Node" and n.name.startswith("input/")]
    return [d.size for d in node.attr["_output_shapes"].list.shape[0].dim]


def _convs(graph) -> int:
    return sum(n.op == "aten::_convolution" for n in graph.node)


def test_a_run_event_file_holds_the_detector_graph(tmp_path, one_thread):
    from yolo5l.train import build

    out = tmp_path / "run"
    cfg = compose_config([*TINY, f"data.synthetic.root={tmp_path / 'syn'}"], output_dir=out)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    graph = _graph(out)
    assert graph is not None, "no graph in the run's event file"
    assert _input_shape(graph) == [1, 3, cfg.data.imgsz, cfg.data.imgsz]  # one zero image at the training size
    assert _convs(graph) == sum(isinstance(m, nn.Conv2d) for m in module.model.modules())
    assert len(list(out.glob("events.out.tfevents.*"))) == 1  # the run's own event file, not a second writer


def _context(net: nn.Module, imgsz: int) -> SimpleNamespace:
    """What `log_graph` reads of a LightningModule: its detector and its trainer's data module."""
    return SimpleNamespace(model=net, trainer=SimpleNamespace(datamodule=SimpleNamespace(imgsz=imgsz)))


def test_the_trace_leaves_the_model_in_training_as_it_was(tmp_path):
    torch.manual_seed(0)
    net = YOLOv5(num_classes=2, depth=0.33, width=0.125).train()
    before = {k: v.clone() for k, v in net.state_dict().items()}  # batch-norm statistics and counters included
    rng = torch.get_rng_state()
    logger = TensorBoardLogger(tmp_path, name="", version="", log_graph=True)
    logger.log_graph(_context(net, 96))
    logger.log_graph(_context(net, 96))  # Lightning calls it at each fit, validate and test: one graph a run
    logger.experiment.flush()
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(m.training for m in net.modules())
    assert all(p.requires_grad and p.grad is None for p in net.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    (events,) = tmp_path.glob("events.out.tfevents.*")
    assert sum(e.HasField("graph_def") for e in EventFileLoader(str(events)).Load()) == 1
    graph = _graph(tmp_path)
    assert _input_shape(graph) == [1, 3, 96, 96]
    assert _convs(graph) == sum(isinstance(m, nn.Conv2d) for m in net.modules())


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        raise RuntimeError("cannot trace this\nsecond line")


def test_a_model_that_does_not_trace_is_one_warning_line(tmp_path, capsys):
    logger = TensorBoardLogger(tmp_path, name="", version="", log_graph=True)
    logger.log_graph(_context(_Untraceable(), 32))
    logger.experiment.flush()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    line = "warning: TensorBoard: no model graph (RuntimeError: cannot trace this); training goes on"
    assert lines == [line]  # the error's first line only, and nothing printed by the tracer
    assert _graph(tmp_path) is None


def test_log_graph_false_writes_no_graph(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version="", log_graph=False)
    logger.log_graph(_context(YOLOv5(num_classes=2, depth=0.33, width=0.125), 64))
    logger.log_metrics({"x": 1.0}, step=0)  # an event file to read
    logger.experiment.flush()
    assert _graph(tmp_path) is None
