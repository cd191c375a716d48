"""Readable logs: with stdout not a terminal, a run prints plain lines (one per epoch: losses, P, R, mAP, images/s,
data wait) and no bars or escape codes, the run folder's train.log holds the same story, and on a terminal the epoch
line is written above the bar, never on its line (yolo5l/base/console.py, yolo5l/callbacks/epoch_line.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from yolo5l.base.console import ConsoleFormatter, ConsoleHandler, clean_lines, run_log
from yolo5l.callbacks.epoch_line import EpochLine, format_epoch_line
from yolo5l.callbacks.progress_bar import NoBar, YOLOProgressBar, console_progress
from yolo5l.callbacks.throughput import ThroughputMonitor

GOLDEN = Path(__file__).parent / "golden" / "smoke_console.txt"
#: Regenerate the golden file from a run: YOLO5L_UPDATE_GOLDEN=1 pytest tests/test_console_log.py -k golden
UPDATE = os.environ.get("YOLO5L_UPDATE_GOLDEN") == "1"
_NUMBER = re.compile(r"(?<![@:\d.])\d+\.\d+|\d+%")  # not the 0.5 of mAP@0.5:0.95


def normalise(text: str) -> str:
    """What varies from run to run and machine to machine: decimals (times, losses, metrics, rates) and shares."""
    return _NUMBER.sub(lambda m: "N%" if m.group().endswith("%") else "X.X", text)


def test_clean_lines_keeps_what_a_terminal_shows_without_the_bars():
    bar = "Epoch 0:  50%|█████     | 2/4 [00:01<00:01,  1.20it/s, box=0.1]"
    stream = (
        "plain line\n"
        f"\r{bar}\r{bar.replace('2/4', '4/4')}"  # redraws, no newline
        "\r" + " " * 20 + "\repoch 0/2  box 0.1\n"  # tqdm.write: the bar cleared, the line written...
        f"\r{bar}"  # ...the bar drawn again
        "\x1b[A\rValidation: |          | 0/? [00:00<?, ?it/s]\n"  # a nested bar finished with a newline
        "\x1b[31mred\x1b[0m text\r\n"
    )
    lines, rest = clean_lines(stream)
    assert lines == ["plain line", "epoch 0/2  box 0.1", "red text"]
    assert rest == ""
    lines, rest = clean_lines("half a ", "")
    assert (lines, rest) == ([], "half a ")
    assert clean_lines("line\n", rest) == (["half a line"], "")


def test_console_progress_draws_a_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert isinstance(console_progress(style="auto"), NoBar)
    assert isinstance(console_progress(style="bar"), YOLOProgressBar)
    assert isinstance(console_progress(style="none"), NoBar)
    with pytest.raises(ValueError, match="style='fancy'"):
        console_progress(style="fancy")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert isinstance(console_progress(style="auto"), YOLOProgressBar)
    notebook = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})  # a Jupyter kernel's stdout
    monkeypatch.setattr(sys, "stdout", notebook())
    assert isinstance(console_progress(style="auto"), YOLOProgressBar)


def test_format_epoch_line():
    line = format_epoch_line(
        3, 40, {"box": 0.05121, "obj": 0.0231, "cls": 0.0104},
        {"val/precision": 0.512, "val/recall": 0.43, "val/map_50": 0.455, "val/map": 0.251},
        {"images_per_sec": 123.44, "data_wait": 0.021}, 14.24,
    )  # fmt: skip
    assert line == (
        "epoch 3/39  box 0.05121  obj 0.02310  cls 0.01040  P 0.512  R 0.430  mAP@0.5 0.455  mAP@0.5:0.95 0.251  "
        "123.4 images/s  data wait 2%  14.2 s"
    )
    assert format_epoch_line(0, None, {}, {}, {}) == "epoch 0"


class _TwoRanks:
    """The strategy of rank 0 of two: `reduce` averages with the other rank's values, in the order it is called."""

    def __init__(self, other: list[float]) -> None:
        self.other, self.ops = list(other), []

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.ops.append((tensor.shape, reduce_op))
        return (tensor + self.other.pop(0)) / 2


def _trainer(rank: int, world_size: int, strategy: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world_size, global_rank=rank, is_global_zero=rank == 0, strategy=strategy, current_epoch=0,
        max_epochs=2, callbacks=[], callback_metrics={}, sanity_checking=False,
    )  # fmt: skip


def test_under_ddp_the_epoch_line_shows_the_losses_of_all_ranks(capsys):
    """metrics.csv holds each loss averaged over the ranks (the module logs them with sync_dist=True): the line shows
    those, reduced as Lightning reduces them (a scalar at a time, "mean"), not rank 0's own; every rank joins the
    reductions, rank 0 alone prints."""
    own = {"box": 0.12254, "obj": 0.01962, "cls": 0.04447}  # rank 0's running means
    other = [0.119292, 0.0198364, 0.0445622]  # rank 1's: the means are 0.120916, 0.0197282, 0.0445161
    module = SimpleNamespace(running_losses=lambda: dict(own), device=torch.device("cpu"))
    for rank in (0, 1):
        strategy = _TwoRanks(other)
        trainer = _trainer(rank, 2, strategy)
        line = EpochLine()
        line.on_train_start(trainer, module)
        line.on_train_epoch_start(trainer, module)
        line.on_train_epoch_end(trainer, module)
        assert strategy.ops == [(torch.Size([]), "mean")] * 3
        assert line.epochs_run == 1
        out = capsys.readouterr().out
        if rank:
            assert out == ""
            continue
        assert out.startswith("epoch 0/1  box 0.12092  obj 0.01973  cls 0.04452  "), out


def test_on_one_process_the_epoch_line_shows_the_running_means_and_reduces_nothing(capsys):
    module = SimpleNamespace(running_losses=lambda: {"box": 0.5, "obj": 0.25, "cls": 0.125}, device=None)
    line = EpochLine()
    trainer = _trainer(0, 1, strategy=None)  # no strategy to reduce with: a reduction would fail
    line.on_train_start(trainer, module)
    line.on_train_epoch_end(trainer, module)
    assert capsys.readouterr().out.startswith("epoch 0/1  box 0.50000  obj 0.25000  cls 0.12500  ")


def test_with_a_bar_the_epoch_line_is_on_its_own_line_and_the_log_has_no_bar(tmp_path, capfd):
    """The bar drawn (as on a terminal) inside run_log: the console shows the epoch lines above the bar, the log
    keeps them and nothing of the bar."""
    log = tmp_path / "train.log"
    trainer = Trainer(
        max_epochs=2, limit_train_batches=3, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu",
        callbacks=[ThroughputMonitor(verbose=False), YOLOProgressBar(refresh_rate=1), EpochLine()],
    )  # fmt: skip
    with run_log(log):
        print("before the run")
        trainer.fit(BoringModel())
        warnings.warn("a warning\nover two lines", UserWarning, stacklevel=1)
        print("after the run")
        with_bar_open = YOLOProgressBar()  # a record logged while a bar is drawn: written above it
        bar = with_bar_open.init_train_tqdm()
        bar.update(1)
        handler = ConsoleHandler(sys.stdout)
        handler.setFormatter(ConsoleFormatter())
        logging.getLogger("yolo5l.test").addHandler(handler)
        try:
            logging.getLogger("yolo5l.test").warning("logged during an epoch")
        finally:
            logging.getLogger("yolo5l.test").removeHandler(handler)
            bar.close()
    console = capfd.readouterr()
    out = console.out + console.err
    assert "it/s" in out  # the bar was drawn
    for epoch in (0, 1):
        at = out.index(f"epoch {epoch}/1  ")
        assert out[at - 1] in "\r\n", repr(out[at - 80 : at])  # the line starts a console line: no bar before it
    text = log.read_text()
    lines = text.splitlines()
    assert lines[0] == "before the run"
    assert lines[-3:] == ["warning: a warning over two lines", "after the run", "warning: logged during an epoch"]
    assert "warning: a warning over two lines\n" in console.err  # no file, line number or source line
    at = out.index("warning: logged during an epoch")
    assert out[at - 1] in "\r\n", repr(out[at - 80 : at])
    epoch_lines = [ln for ln in lines if ln.startswith("epoch ")]
    assert [ln.split("  ")[0] for ln in epoch_lines] == ["epoch 0/1", "epoch 1/1"]
    assert all("images/s" in ln and "data wait" in ln for ln in epoch_lines)
    assert "it/s" not in text
    assert "\x1b" not in text
    assert "\r" not in text


def _smoke(tmp_path: Path) -> subprocess.CompletedProcess:
    args = [
        "experiment=smoke", "hydra.run.dir=run", "data.synthetic.root=synthetic", "data.imgsz=64",
        "trainer.max_epochs=2", "trainer.limit_train_batches=2", "callbacks.val_interval.n=2", "plots=false",
        "callbacks.throughput.warn_above=1.0",  # the data-wait hint depends on the machine's load
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "yolo5l.train", *args], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=env,
    )  # fmt: skip


def test_golden_console_of_a_short_run_when_stdout_is_a_file(tmp_path):
    """Two epochs (the first without validation) with stdout a pipe: the console, compared with a golden file with
    the numbers that vary normalised, and train.log with the same lines."""
    r = _smoke(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""  # warnings and Lightning's lines are console lines like the rest
    for noise in ("\r", "\x1b", "it/s", "Training:", "Validation", "Total FLOPs"):
        assert noise not in r.stdout, noise
    got = normalise(r.stdout)
    if UPDATE:
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text()
    assert normalise((tmp_path / "run" / "train.log").read_text()) == got  # the run folder keeps the story
    # The weights record the data yaml and image size (val's defaults).
    weights = torch.load(tmp_path / "run" / "checkpoints" / "weights.pt", map_location="cpu", weights_only=True)
    assert (weights["data"], weights["imgsz"]) == (str((tmp_path / "synthetic" / "data.yaml").resolve()), 64)
