"""Mistakes a user can fix at start-up (a wrong flag, a missing or unsuitable file): one `error:` line, exit 1.
Raised later, while training, the same errors keep their traceback (bugs to report, not input to fix)."""

import contextlib
import functools
import sys
from typing import Callable, Iterator

from . import watchdog

# What our validation and loading raise for bad input (argparse's own errors exit by themselves).
USER_ERROR_TYPES = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)

class UserError(Exception):
    """A start-up error whose message is meant for the user (it names the flag or file and the fix)."""


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """The block that reads the user's flags and files: its input errors become `UserError`."""
    try:
        yield
    except USER_ERROR_TYPES as error:
        raise UserError(str(error)) from error


def exit_on_user_error(main: Callable) -> Callable:
    """`main`, printing a `UserError` as `error: ...` and exiting 1; the stall watchdog is stopped however it ends."""
    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            sys.exit(f"error: {error}")
        finally:
            watchdog.stop()

    return guarded
