"""Text for a terminal: what came from data (sample ids, names, file names, a crafted header) shown,
never obeyed.

A sample id carrying `ESC ] 0 ; ... BEL` retitled the terminal and `ESC [ 2 J` cleared it when a command
printed it. Every line the CLIs print (messages, logs, reports) passes through `escaped`: characters
that move the cursor, change the terminal's state or reorder what is shown are written as Python
escapes (\\x1b, \\x9b, \\u202e), which also keeps a lone surrogate from failing the write. Newlines and
tabs stay: messages use them for layout.
"""

from __future__ import annotations

import re

import click

# C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI), the bidirectional
# controls (a right-to-left override reverses what follows it), the line and paragraph separators, and
# lone surrogates (not encodable: printing one raised UnicodeEncodeError). A regex character class body.
CONTROL_CHARACTERS = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE = re.compile(f"[{CONTROL_CHARACTERS}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escaped(text: str) -> str:
    """`text` with every terminal control written as an escape; unchanged when it holds none."""
    return _UNSAFE.sub(_escape, text)


def has_controls(text: str) -> bool:
    """Whether `text` holds a character `escaped` would rewrite."""
    return _UNSAFE.search(text) is not None


def echo(text: str, *, err: bool = False) -> None:
    """click.echo of `text` escaped: what every CLI prints goes through here."""
    click.echo(escaped(text), err=err)
