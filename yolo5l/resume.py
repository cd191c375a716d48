"""What `resume=` means for `python -m yolo5l.train`: the interrupted run's own folder and config.

Finding and reading the checkpoint is `yolo5l.callbacks.checkpoint` (`find_resume_checkpoint`, `read_resume_state`);
merging the command line into the run's config is `yolo5l.config.merge_resume_config`.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from yolo5l.base.console import info, is_rank_zero
from yolo5l.base.errors import UserError, shown_path
from yolo5l.callbacks.checkpoint import find_resume_checkpoint, read_resume_state
from yolo5l.config import merge_resume_config
from yolo5l.io.files import atomic_write

__all__ = ["resume_config", "resume_in_place"]


def resume_config(cfg: DictConfig, ckpt_path: Path, overrides: list[str], output_dir: Path) -> DictConfig:
    """The resumed run's config (the checkpoint's own, see `merge_resume_config`), checked against its epochs."""
    state = read_resume_state(ckpt_path)
    if state.config is not None:
        cfg = merge_resume_config(cfg, state.config, overrides, ckpt_path)
        if is_rank_zero() and (output_dir / ".hydra").is_dir():  # what this run really uses, beside Hydra's files
            atomic_write(output_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
    max_epochs = cfg.trainer.get("max_epochs")
    if max_epochs is not None and 0 <= int(max_epochs) <= state.epochs_done:
        raise UserError(
            f"{ckpt_path} already trained {state.epochs_done} of {max_epochs} epochs, nothing to resume: extend it "
            f"with trainer.max_epochs={state.epochs_done + 10} (or more), or start a new run with weights={ckpt_path}"
        )
    at = f", batch {state.batches_done}" if state.batches_done else ""
    info(f"resuming {shown_path(ckpt_path)} at epoch {state.epochs_done}{at} of {max_epochs}")
    return cfg


#: `~callbacks.<name>` or `~logger.<name>` on its own: an entry the command line turns off.
_ENTRY_DELETION = re.compile(r"~((?:callbacks|logger)\.[A-Za-z_]\w*)")


def resume_in_place(argv: list[str]) -> list[str]:
    """`resume=<last.ckpt>` (or `true`) continues in the interrupted run's own folder: the command line gets that
    folder as `hydra.run.dir` before Hydra makes a new one, so metrics.csv, TensorBoard events and checkpoints stay
    in one place. Nothing changes when `hydra.run.dir` is given, in a multirun, or for a file outside a run folder.

    `~callbacks.<name>` (or `~logger.<name>`) of an entry the run's config has turns it off: it becomes
    `++callbacks.<name>=null`, which Hydra takes whether or not this command line's own config has the entry (one the
    run added with `+callbacks.<name>` is only in the checkpoint's config, and Hydra cannot delete what it does not
    have); the run's config then holds the entry as null, and a null entry is not built. Any other deletion stays as
    typed, for the checks to report.
    """
    resume = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=")), None)
    if resume is None or resume.lower() in ("false", "null", "none", ""):
        return argv
    runs_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("paths.runs_dir=")), "runs")
    if any(_ENTRY_DELETION.fullmatch(a) for a in argv):
        argv = _entries_off(argv, find_resume_checkpoint(resume, Path(runs_dir) / "train"))
    if any(a.startswith("hydra.run.dir=") for a in argv) or {"-m", "--multirun"} & set(argv):
        return argv
    path = find_resume_checkpoint(resume, Path(runs_dir) / "train")
    if path is None or path.parent.name != "checkpoints":
        return argv
    path = path.absolute()
    return [*(a for a in argv if not a.startswith("resume=")), f"resume={path}", f"hydra.run.dir={path.parent.parent}"]


def _entries_off(argv: list[str], path: Path | None) -> list[str]:
    """`argv` with each `~callbacks.<name>` / `~logger.<name>` of an entry in the checkpoint's config as a null."""
    saved = read_resume_state(path).config if path is not None else None

    def in_run(key: str) -> bool:
        group, _, name = key.partition(".")
        entries = saved.get(group) if isinstance(saved, dict) else None
        return isinstance(entries, dict) and name in entries

    return [f"++{m.group(1)}=null" if (m := _ENTRY_DELETION.fullmatch(a)) and in_run(m.group(1)) else a for a in argv]
