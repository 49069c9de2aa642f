"""Errors and warnings of the command line as one line each on stderr, never a traceback.

* usage errors (a bad option value, an unknown command): ``Error: ... (try 'autosymm X --help')``,
  exit code 2;
* runtime failures a user can cause or meet (a corrupt or newer database, an unreadable path, a
  bad setting, a CUDA or worker failure: ValueError, OSError, RuntimeError, sqlite3.Error and
  autosymm's database errors, which are ValueErrors): ``Error: <message>``, exit code 1;
* anything else (a bug): ``Error: unexpected <type>: <message> ...``, exit code 1.

With ``AUTOSYMM_LOG=debug`` every non-click exception keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import sqlite3
import warnings
from typing import Iterator

import click

from ..logs import debug_enabled

#: Exceptions a user's input or environment causes (RuntimeError: torch's CUDA/NCCL failures, a
#: failed tune worker, no GPU for --nproc): shown as their message alone.
USER_ERRORS = (ValueError, OSError, RuntimeError, sqlite3.Error)


def one_line(text: object) -> str:
    """``text`` (an exception or message) as one line: every run of whitespace, newlines included,
    as one space; an embedded traceback (a worker's, already printed by the worker) cut off."""
    lines = str(text).splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), len(lines))
    line = " ".join(" ".join(lines[:cut]).split())
    return line or type(text).__name__


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    click.echo(f"Warning: {one_line(message)}", err=True)


#: click's own exits that print what they must (help, version) rather than an error.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", None)  # click >= 8.2
_CLICK_EXITS = (click.exceptions.Exit, click.exceptions.Abort) + ((_NO_ARGS_IS_HELP,) if _NO_ARGS_IS_HELP else ())


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn what the block raises into click's one-line errors (see the module docstring)."""
    try:
        yield
    except _CLICK_EXITS:
        raise
    except click.UsageError as exc:
        if exc.ctx is None and "\n" not in exc.format_message():
            raise
        hint = f" (try '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        raise click.UsageError(one_line(exc.format_message()) + hint) from None
    except click.ClickException as exc:
        if "\n" not in exc.format_message():
            raise
        error = click.ClickException(one_line(exc.format_message()))
        error.exit_code = exc.exit_code
        raise error from None
    except Exception as exc:
        if debug_enabled() or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
            raise  # click handles a closed pipe (`autosymm show | head`) itself
        if isinstance(exc, USER_ERRORS):
            raise click.ClickException(one_line(exc)) from None
        raise click.ClickException(f"unexpected {type(exc).__name__}: {one_line(exc)} "
                                   f"(AUTOSYMM_LOG=debug shows the traceback)") from None


class OneLineErrorGroup(click.Group):
    """A click group whose parsing and commands (subgroups' included) end any error as one line
    on stderr, and print warnings as one line each."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with one_line_errors():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        with warnings.catch_warnings(), one_line_errors():
            warnings.showwarning = _show_warning
            return super().invoke(ctx)
