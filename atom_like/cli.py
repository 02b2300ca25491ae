"""The one place where command-line entry points turn bad input into one line and exit status 2.

The engine says what is wrong with a checkpoint, config, flag or prompt by raising ValueError
with the file, field or flag named; a model or file that is not there raises FileNotFoundError.
Every entry point's `main` is wrapped in `entry_point`, which prints such an error as
`error: <message>` on one line of stderr and exits with status 2 (argparse's status for a bad
flag). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

EXIT_BAD_INPUT = 2

F = TypeVar("F", bound=Callable)


def fail(message: str) -> NoReturn:
    """Print `message` as one `error:` line on stderr and exit with status 2."""
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT)


def entry_point(main: F) -> F:
    """Decorate a command's `main`: its return value passes through; bad input exits via `fail`."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ValueError, FileNotFoundError) as exc:
            fail(str(exc))

    return run  # type: ignore[return-value]
