"""`UserError`: a mistake in a command, a config or an input file that the user fixes.

Any layer may raise it; the entry points print it as one line `error: <message>` and exit with code 2.
"""

from __future__ import annotations

__all__ = ["EXIT_USAGE", "UserError"]

EXIT_USAGE = 2  # what argparse and the entry points exit with on a usage mistake


class UserError(Exception):
    """A mistake the user fixes (bad value, missing or damaged file): printed as one sentence, exit code 2."""
