"""The user-error family and the one decorator that turns it into exit codes for every CLI.

A user error is one the user acts on (a damaged file, a refused setting, a cache that is not this
run's): the CLIs print its message as one line and exit with its code, never a traceback.

    UserError   exit 1, stderr `Error: <message>` (click's ClickException), terminal controls escaped; so is a full disk anywhere
                (ENOSPC / EDQUOT, whatever the command lists: DiskFullError and the rest of
                shards.common.diskfull, which this module imports)
    Stopped     exit 143 (128 + SIGTERM, as a killed job reports), stderr `stopped: <message>`: a
                pre-empted job that stopped cleanly, nothing lost, resumable
    (click)     a bad flag or value stays click's usage error, exit 2 (build_config turns a config's
                ValueError into one)

Members keep the standard base they had before joining (CacheFormatError is a ValueError,
NonFiniteError a RuntimeError), so code that catches ValueError or RuntimeError still catches them.
Library code also reports user errors as plain ValueError / OSError (the house rule: ValueError for
user errors); a command lists the standard exceptions it reports the same way, as it did before:
`@user_errors(ValueError, OSError)`.

It lives in shards/ because that is the one package all four CLIs' stages import.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from shards.common.diskfull import disk_full_line
from shards.common.terminal import echo, escaped

F = TypeVar("F", bound=Callable[..., Any])


class UserError(Exception):
    """An error the user can act on: the CLIs print `Error: <message>` and exit with `exit_code`."""

    exit_code = 1


class Stopped(UserError):
    """A clean stop on a signal (pre-emption): `stopped: <message>`, exit 128 + SIGTERM."""

    exit_code = 143


# click's own ways out pass through untouched: Exit and Abort are RuntimeErrors, which a command may
# list as user errors (dflash-train plot), and a usage error must keep its exit 2.
_CLICK_EXITS = (click.ClickException, click.exceptions.Exit, click.Abort)


def user_errors(*also: type[Exception]) -> Callable[[F], F]:
    """Decorator for a click command's function (put it right above the `def`): the family, and the
    standard exceptions `also` lists, become one message and their exit code instead of a traceback."""

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except _CLICK_EXITS:
                raise
            except Stopped as e:
                echo(f"stopped: {e}", err=True)
                sys.exit(e.exit_code)
            except Exception as e:
                message = disk_full_line(e) or (str(e) if isinstance(e, (UserError, *also)) else None)
                if message is None:
                    raise
                failure = click.ClickException(escaped(message))  # messages quote data: ids, file names
                failure.exit_code = getattr(e, "exit_code", 1)
                raise failure from e

        return run  # type: ignore[return-value]

    return decorate
