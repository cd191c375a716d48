"""What `module.max_loss_growth`'s rule sees in a run: the largest ratio of a running epoch mean loss, at the points
where the module reads it, to the lowest one before it (the rule stops a run when that ratio exceeds the setting).

Runs `python -m yolo5l.train` with the given overrides and this file's `GrowthProbe` callback, then prints the
largest ratio and where it was (docs/benchmarks.md, "The exploding-loss rule on healthy runs"):

    python scripts/loss_growth_probe.py experiment=synthetic_learn seed=0
    python scripts/loss_growth_probe.py experiment=quickstart seed=0 data.cache=ram
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from yolo5l.training.divergence import MIN_GROWTH_BATCHES

HERE = Path(__file__).resolve().parent


class GrowthProbe(Callback):
    """Follow the rule's reads (every `log_every_n_steps` batches and at each epoch's end; averages over fewer than
    `MIN_GROWTH_BATCHES` batches only at an epoch's end) and write the largest ratio to `out` after every epoch.

    Args:
        out: the JSON file written.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.lowest: float | None = None
        self.worst: dict[str, Any] = {"ratio": 0.0}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        last = batch_idx + 1 >= trainer.num_training_batches
        batches = pl_module._loss_batches
        if not ((batch_idx + 1) % max(1, trainer.log_every_n_steps) == 0 or last):
            return
        if batches < MIN_GROWTH_BATCHES and not last:
            return
        mean = float(pl_module._loss_sum.sum()) / batches
        if self.lowest is not None and mean / self.lowest > self.worst["ratio"]:
            self.worst = {"ratio": mean / self.lowest, "epoch": trainer.current_epoch, "batches": batches,
                          "mean": mean, "lowest": self.lowest}  # fmt: skip
        self.lowest = mean if self.lowest is None else min(self.lowest, mean)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        Path(self.out).write_text(json.dumps({**self.worst, "epochs": trainer.current_epoch + 1}))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "growth.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
        probe = ["+callbacks.loss_growth_probe._target_=loss_growth_probe.GrowthProbe",
                 f"+callbacks.loss_growth_probe.out={out}"]  # fmt: skip
        run = subprocess.run([sys.executable, "-m", "yolo5l.train", *sys.argv[1:], *probe], env=env)
        if not out.is_file():
            print("the run ended before its first epoch did", file=sys.stderr)
            return run.returncode or 1
        r = json.loads(out.read_text())
        where = f" at epoch {r['epoch']}, mean of {r['batches']} batches" if "epoch" in r else ""
        print(f"largest rise over the lowest running mean loss: {r['ratio']:.3f} x{where} ({r['epochs']} epochs)")
        return run.returncode


if __name__ == "__main__":
    sys.exit(main())
