"""`UserError`: a mistake in a command, a config or an input file that the user fixes; `shown_path`: how messages
name a file.

Any layer may raise it; the entry points print it as one line `error: <message>` and exit with code 2.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXIT_DIVERGED", "EXIT_RANK_LOST", "EXIT_USAGE", "UserError", "shown_path"]

EXIT_USAGE = 2  # what argparse and the entry points exit with on a usage mistake
# A run that cannot go on (docs/guide.md, "Exit codes"); numbers from BSD's sysexits.h, clear of 1, 2 and 128 + signal.
EXIT_DIVERGED = 65  # EX_DATAERR: the model's numbers went bad; resuming unchanged would diverge again
EXIT_RANK_LOST = 75  # EX_TEMPFAIL: a DDP rank died; resuming from the last checkpoint continues the run


class UserError(Exception):
    """A mistake the user fixes (bad value, missing or damaged file): printed as one sentence, exit code 2."""


def shown_path(path: str | os.PathLike) -> str:
    """`path` relative to the current folder when it lies below it (as the user typed the run), else absolute."""
    p = Path(path).absolute()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)
