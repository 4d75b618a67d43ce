"""How a command ends: its exit code, and its errors as one line for a person.

Exit codes: 0 success; 1 the operation failed (device error, mount failed);
2 bad usage or input the user can fix (message on one line, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kvfs.common.errors import KvfsError, UserError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The command's exit code; its errors as one line on stderr."""
    try:
        try:
            return command(args)
        except BaseExceptionGroup as group:  # a trio nursery's: report what went wrong
            raise root_cause(group) from None
    except UserError as e:
        print(f"kvfs: {e}", file=sys.stderr)
        return e.exit_code
    except KvfsError as e:
        print(f"kvfs: {e}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return EXIT_FAIL
    except BrokenPipeError:  # `kvfs ... | head`: the reader left; nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error flushing stdout at exit
        return EXIT_OK


def root_cause(e: BaseException) -> BaseException:
    """The exception a person should read: inside exception groups (trio nurseries),
    the first kvfs error if there is one, else the first leaf."""
    leaves: list[BaseException] = []
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, BaseExceptionGroup):
            stack.extend(reversed(x.exceptions))
        else:
            leaves.append(x)
    ours = [x for x in leaves if isinstance(x, (UserError, KvfsError))]
    return (ours or leaves or [e])[0]


def describe(e: BaseException) -> str:
    """One line for a person: the message, not the exception's repr."""
    e = root_cause(e)
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    return str(e) or type(e).__name__


__all__ = ["EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "describe", "root_cause", "run_command"]
