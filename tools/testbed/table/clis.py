"""The pipeline's CLIs, run inside this process as their console scripts run them.

The table runs dozens of commands; a fresh interpreter importing torch costs about 4 s each on a 2-core
machine, longer than a reduced training run. So each command is its click command called with its
argument list, exactly the words a user would type after `dflash-data`, `dflash-extract` or
`dflash-train`. Its console lines and log records go to a log file in the work directory (the command
line first); a command that fails raises StepFailed naming the command and that file. A training run
stopped by SIGTERM or Ctrl-C has checkpointed and exits 143 or 130: that stops the table, resumably.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
from pathlib import Path
from typing import Any

import click

from shards.common.errors import Stopped, UserError
from shards.common.logs import DATE_FORMAT, FORMAT

_STOP_CODES = (130, 143)  # dflash-train after SIGINT / SIGTERM: checkpointed, resumable


class StepFailed(UserError):
    """A pipeline command failed: its message and the log holding its whole output."""


def run_cli(program: str, command: click.Command, args: list[str], log_file: Path, obj: Any = None) -> None:
    """`program args...` through `command` (its click command), output appended to `log_file`."""
    root = logging.getLogger()
    with open(log_file, "a", encoding="utf-8") as log:
        log.write(f"$ {program} {shlex.join(args)}\n")
        log.flush()
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        level = root.level
        root.addHandler(handler)
        root.setLevel(logging.INFO)  # the console scripts' level; theirs is a no-op once a handler exists
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                code = command.main(args=args, prog_name=program, standalone_mode=False, obj=obj)
        except click.ClickException as e:
            raise StepFailed(f"`{program} {args[0]}` failed: {e.format_message()} (its output: {log_file})") from e
        except SystemExit as e:
            code = e.code
        finally:
            root.removeHandler(handler)
            root.setLevel(level)
    if code in _STOP_CODES:
        raise Stopped(f"`{program} {args[0]}` was stopped by a signal after a checkpoint; run the same command again")
    if code not in (None, 0):
        raise StepFailed(f"`{program} {args[0]}` exited with {code} (its output: {log_file})")
