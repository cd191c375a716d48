"""What `resume=` means for `python -m yolo5l.train`, all of it: the checkpoint a run resumes from
(`find_resume_checkpoint`) and what it holds (`read_resume_state`), the interrupted run's own folder
(`resume_in_place`), its config with the command line merged in (`merge_resume_config`, `RESUME_MAY_CHANGE`), the
config the override check reads (`stored_config`), and the start of a run, new or resumed (`start_or_resume`).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from yolo5l.base.console import info, is_rank_zero
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.files import atomic_write
from yolo5l.base.run_files import refuse_if_training, training_now
from yolo5l.callbacks.checkpoint import CONFIG_KEY, checkpoint_position
from yolo5l.config_values import override_key
from yolo5l.io.archive import archive_damage
from yolo5l.io.hyp_file import apply_hyp_file
from yolo5l.io.old_targets import current_targets

__all__ = [
    "RESUME_MAY_CHANGE", "SETTLE_REQUESTS", "ResumeState", "find_resume_checkpoint", "merge_resume_config",
    "read_resume_state", "resume_config", "resume_in_place", "start_or_resume", "stored_config",
]  # fmt: skip


def start_or_resume(cfg: DictConfig, overrides: list[str], output_dir: Path) -> tuple[DictConfig, Path | None]:
    """The config a training run starts from and the checkpoint it resumes (None for a new run): with `resume=`, the
    checkpoint's config with this command line merged in (`resume_config`); else the composed config with its hyp
    file's values (`yolo5l.io.hyp_file.apply_hyp_file`; a resumed run's config holds them already)."""
    ckpt_path = find_resume_checkpoint(cfg.get("resume"), output_dir.parent, exclude=output_dir)
    if ckpt_path is None:
        return apply_hyp_file(cfg, overrides, output_dir), None
    return resume_config(cfg, ckpt_path, overrides, output_dir), ckpt_path


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
            f"with trainer.max_epochs=N, any N above {state.epochs_done}, or start a new run with weights={ckpt_path}"
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


@dataclass
class ResumeState:
    """What `resume=` needs from a checkpoint before anything is built.

    Attributes:
        path: the checkpoint.
        epochs_done: epochs completed when it was written.
        config: the run's composed config (None in checkpoints written without `RunConfig`).
        batches_done: batches of epoch `epochs_done` already trained (a mid-epoch checkpoint; 0 at an epoch end).
    """

    path: Path
    epochs_done: int
    config: dict[str, Any] | None
    batches_done: int = 0


def find_resume_checkpoint(resume: Any, runs_root: Path, exclude: Path | None = None) -> Path | None:
    """The checkpoint a run resumes from: None, a path, or `true` = the newest `*/checkpoints/last.ckpt` under
    `runs_root` (`runs/train` by default) of a run that no process trains now, the folder `exclude` (the new run's
    own) left out. With `true` a line says which runs were passed over: those training now, and a newer run folder
    without a checkpoint (stopped before its first epoch ended).

    Raises:
        UserError: The checkpoint does not exist, none was found, or its run is training now.
    """
    if resume is None or resume is False or str(resume).lower() in ("false", "null", "none", ""):
        return None
    # Whether a run trains now is rank 0's question: the ranks Lightning starts find the run rank 0 holds.
    trains = training_now if is_rank_zero() else lambda _: None
    if resume is not True and str(resume).lower() != "true":
        path = Path(str(resume))
        if not path.is_file():
            raise UserError(f"resume checkpoint {str(path)!r} not found: pass the last.ckpt of an interrupted run")
        if path.parent.name == "checkpoints" and is_rank_zero():
            refuse_if_training(path.parent.parent, then="then resume it")
        return path

    def kept(p: Path) -> bool:  # not in the new run's own folder
        return exclude is None or not (p == Path(exclude) or Path(exclude) in p.parents)

    patterns = ("*/checkpoints/last.ckpt", "*/*/checkpoints/last.ckpt")
    found = [p for pattern in patterns for p in Path(runs_root).glob(pattern) if kept(p)]
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    live = [(p, holder) for p in found if (holder := trains(p.parent.parent))]
    path = next((p for p in found if all(p != q for q, _ in live)), None)
    if path is None:
        if live:
            raise UserError(
                f"resume=true: every run under {runs_root} with a last.ckpt is being trained now "
                f"({', '.join(f'{shown_path(p.parent.parent)}: {h}' for p, h in live)}): wait for one to end"
            )
        raise UserError(f"resume=true found no */checkpoints/last.ckpt under {runs_root}: pass resume=<path>")
    passed = [f"{shown_path(p.parent.parent)} (being trained now, {h})" for p, h in live]
    written = path.stat().st_mtime
    newer = [d.parent for d in Path(runs_root).glob("*/.hydra") if d.stat().st_mtime > written]
    passed += [
        f"{shown_path(run)} (no checkpoint: it stopped before its first epoch ended)"
        for run in sorted(newer)
        if kept(run) and not (run / "checkpoints" / "last.ckpt").is_file() and not trains(run)
    ]
    if passed:
        _say_once(f"resume=true: resuming {shown_path(path.parent.parent)}, the newest run to resume; passed over: "
                  f"{'; '.join(passed)}")  # fmt: skip
    return path


_said: set[str] = set()


def _say_once(line: str) -> None:
    """`info(line)` once per process: the checkpoint is looked up before Hydra starts and again in the run."""
    if line not in _said:
        _said.add(line)
        info(line)


def read_resume_state(path: Path) -> ResumeState:
    """Read a training checkpoint without running pickled code (`weights_only=True`).

    Raises:
        UserError: The file is damaged, holds more than a yolo5l checkpoint can, or is not a training checkpoint.
    """
    damage = archive_damage(path)
    if damage:
        raise UserError(f"{path} is damaged ({damage}): resume from another copy of it")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0]
        raise UserError(f"{path}: refused to load, it holds more than a yolo5l checkpoint can ({reason})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(
            f"{path}: damaged or not a PyTorch checkpoint ({type(e).__name__}): use another last.ckpt"
        ) from None
    if not isinstance(ckpt, dict) or "epoch" not in ckpt or "state_dict" not in ckpt:
        raise UserError(
            f"{path} is not a training checkpoint (no optimizer/epoch state): start a new run with weights={path}"
        )
    epochs_done, batches_done = checkpoint_position(ckpt)
    return ResumeState(path, epochs_done, current_targets(ckpt.get(CONFIG_KEY)), batches_done)


#: Keys a resumed run may change: how it runs and what it writes, never what it trains (model, data, hyp, module),
#: except a new `hyp.lr0` for the rest of a run that diverged (`yolo5l.training.optim.rescale_lr0`).
RESUME_MAY_CHANGE = (
    "hyp.lr0", "trainer.max_epochs", "trainer.devices", "trainer.num_nodes", "trainer.accelerator", "trainer.strategy",
    "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.limit_val_batches", "data.num_workers",
    "data.val_num_workers", "data.persistent_workers", "data.pin_memory", "data.prefetch_factor", "data.cache",
    "data.cache_dir", "data.val_batch_size", "data.pipeline", "data.device_cache_reserve_gb", "callbacks", "logger",
    "paths", "resume", "tune_malloc", "hydra", "plots",
)  # fmt: skip


#: Values that ask the run to settle something (a batch size search, the precision `auto` picks): typed again on a
#: resume's command line, they take what the run settled, which its checkpoint holds.
SETTLE_REQUESTS = {"data.batch_size": -1, "trainer.precision": "auto"}


def merge_resume_config(cfg: DictConfig, saved: dict[str, Any], overrides: Sequence[str], path: Any) -> DictConfig:
    """The config of a resumed run: the checkpoint's own (`saved`), with the command line's overrides applied where
    `RESUME_MAY_CHANGE` allows. An override of anything else must agree with the checkpoint's run, but for a
    request the run settled (`SETTLE_REQUESTS`). A precision `auto` picked is picked again on another accelerator.

    Args:
        cfg: the config composed from this command line.
        saved: the run's config stored in the checkpoint.
        overrides: this command line's overrides (`HydraConfig.get().overrides.task`).
        path: the checkpoint (for the message).

    Raises:
        UserError: An override changes what the run trains (model, data, hyperparameters, ...).
    """
    merged = OmegaConf.create(saved)
    for override in overrides:
        key = override_key(override)
        mine = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if key == "resume" or key.startswith(tuple(f"{k}." for k in RESUME_MAY_CHANGE)) or key in RESUME_MAY_CHANGE:
            if override.lstrip().startswith("~"):
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(merged, parent) if parent else merged
                if OmegaConf.is_dict(node) and leaf in node:
                    with open_dict(node):
                        del node[leaf]
            else:
                OmegaConf.update(merged, key, mine, merge=False, force_add=True)
            continue
        if key in SETTLE_REQUESTS and mine == SETTLE_REQUESTS[key]:
            continue
        theirs = OmegaConf.select(merged, key, default=None, throw_on_missing=False)
        if key == "data.imgsz" and _rounds_to(mine, merged, theirs):
            continue
        as_plain = [OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (mine, theirs)]
        if as_plain[0] != as_plain[1]:
            raise UserError(
                f"resume: {override} changes what the run in {path} trains ({_difference(key, *as_plain)}); "
                f"drop it to resume, or start a new run with weights={path}"
            )
    with open_dict(merged):
        merged.weights = None  # the checkpoint holds the weights: the run's starting weights are not read again
    picked = str(OmegaConf.select(merged, "sources.trainer.precision", default="")).startswith("auto")
    if picked and any(override_key(o) == "trainer.accelerator" for o in overrides):
        merged.trainer.precision = "auto"
        del merged.sources.trainer["precision"]
    return merged


def _rounds_to(typed: Any, saved: DictConfig, size: Any) -> bool:
    """Whether the image size `typed` again is one the run rounded up to its `size` (`data.imgsz=100` for a run at
    128), by the rounding its start recorded in `sources.data.imgsz` (`yolo5l.base.image_size.rounding_note`)."""
    from yolo5l.base.image_size import round_up, rounding_of

    rule = rounding_of(str(OmegaConf.select(saved, "sources.data.imgsz", default="") or ""))
    if rule is None or not isinstance(typed, int) or isinstance(typed, bool) or typed <= 0:
        return False
    return round_up(typed, *rule) == size


def _difference(key: str, mine: Any, theirs: Any, shown: int = 2) -> str:
    """How a resume's value of `key` differs from the run's: the value there, or for a node (`model=yolov5s`) the
    first `shown` leaves that differ, each with the value here."""
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return f"{key} is {theirs!r} there"
    leaves = []
    for k in [*theirs, *(k for k in mine if k not in theirs)]:
        a, b = mine.get(k), theirs.get(k)
        if a != b:
            leaves.append(_difference(f"{key}.{k}", a, b, shown=1) if isinstance(a, dict) and isinstance(b, dict)
                          else f"{key}.{k} is {b!r} there, {a!r} here")  # fmt: skip
    return "; ".join(leaves[:shown])


def stored_config(resume: Any, runs_dir: str) -> dict[str, Any] | None:
    """The config stored in the checkpoint `resume=` names under `runs_dir`, for the check of a resume's overrides
    (`yolo5l.overrides`); None when there is none (train reports a missing or damaged checkpoint)."""
    try:
        path = find_resume_checkpoint(resume, Path(runs_dir) / "train")
        config = read_resume_state(path).config if path is not None else None
    except UserError:
        return None
    return dict(config) if isinstance(config, dict) else None
