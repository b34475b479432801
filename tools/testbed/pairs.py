"""Prompt/continuation pairs from one source file: Python code or reST documentation.

    code  every top-level function and every method of a top-level class: the prompt is its
          decorators, signature and docstring (the signature alone without one), the continuation
          the rest of its body, both dedented to the def's column; the reply sits in a ```python
          fence, so its first line keeps its indentation through the chat template's `| trim`
    docs  every section (split at reST headings, any level) cut into units: a paragraph starting at
          column 0 with the indented blocks that follow it (literal blocks, directive bodies); a
          pair's prompt is its first units (at least PROMPT_MIN_CHARS), its continuation the units
          that follow up to CONTINUATION_MAX_CHARS, so no text starts indented or is cut mid-block

The user turn names the file (and the section or the class) and says what to do, as a request to an
assistant would; the assistant turn is the corpus' own text. Pairs whose text holds chat markup
(<|...|>, think or tool tags) are dropped: the template would read them as turns or reasoning.
Deterministic: the same text gives the same pairs on any machine (ast and string operations only).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

PROMPT_MIN_CHARS = 200  # docs: units are added to a prompt until it holds this much text
PROMPT_MAX_CHARS = 1200  # a longer prompt (a long docstring, a huge first paragraph) drops the pair
CONTINUATION_MAX_CHARS = 3000  # longer continuations (long functions, long units) drop the pair
# Text the chat template gives a meaning: a pair holding it would render as something else.
CHAT_MARKUP = ("<|", "|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# reST heading adornments: a line of one repeated punctuation character under (and maybe over) a title.
_ADORNMENT = re.compile(r"""([=\-`:.'"~^_*+#<>])\1{2,}\s*""")


@dataclass(frozen=True)
class Pair:
    prompt: str  # the user turn
    continuation: str  # the assistant turn: what the source says next


def code_pairs(path: str, source: str) -> list[Pair]:
    """One pair per function or method of `source` (a Python file at `path`), in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    pairs = []
    for node, owner in _functions(tree):
        pair = _function_pair(path, lines, node, owner)
        if pair is not None and _acceptable(pair):
            pairs.append(pair)
    return pairs


def docs_pairs(path: str, text: str) -> list[Pair]:
    """Pairs of consecutive units within each section of `text` (a reST file at `path`)."""
    pairs = []
    for title, body in _sections(text.splitlines()):
        where = f"{path}, section {title!r}" if title else path
        units = _units(body)
        i = 0
        while i < len(units):
            prompt, i = _take(units, i, lambda text: len(text) >= PROMPT_MIN_CHARS)
            continuation, i = _take(units, i, None)
            if prompt and continuation:
                pair = Pair(f"Continue this part of the Django documentation ({where}):\n\n{prompt}", continuation)
                if _acceptable(pair):
                    pairs.append(pair)
    return pairs


def _acceptable(pair: Pair) -> bool:
    if len(pair.prompt) > PROMPT_MAX_CHARS or len(pair.continuation) > CONTINUATION_MAX_CHARS:
        return False
    return not any(mark in pair.prompt or mark in pair.continuation for mark in CHAT_MARKUP)


# ---- code -------------------------------------------------------------------------------------


def _functions(tree: ast.Module):
    """(function node, owning class name or None): module-level defs and top-level classes' methods."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, defs):
            yield node, None
        elif isinstance(node, ast.ClassDef):
            yield from ((m, node.name) for m in node.body if isinstance(m, defs))


def _function_pair(path: str, lines: list[str], node: ast.FunctionDef, owner: str | None) -> Pair | None:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1  # 0-based, decorators included
    body = node.body
    has_doc = (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    rest = body[1:] if has_doc else body
    if not rest or lines[rest[0].lineno - 1][: rest[0].col_offset].strip():
        return None  # a docstring only, or a body sharing a line with the signature or docstring
    # The head is lines [first, split); comments between the signature and the first statement
    # belong to the continuation.
    split = body[0].end_lineno if has_doc else _end_of_signature(lines, node, rest[0].lineno - 1)
    column = node.col_offset
    head = _dedent(lines[first:split], column).rstrip()
    tail = _dedent(lines[split : node.end_lineno], column).rstrip()
    if not tail.strip():
        return None
    what = f"method of class {owner}" if owner else "function"
    prompt = f"Complete this {what} from {path}:\n\n```python\n{head}\n```"
    return Pair(prompt, f"```python\n{tail}\n```")


def _end_of_signature(lines: list[str], node: ast.FunctionDef, first_statement: int) -> int:
    """Index of the line after the signature's closing `:` (the def may span several lines)."""
    for i in range(node.lineno - 1, first_statement):
        if lines[i].split("#", 1)[0].rstrip().endswith(":"):
            return i + 1
    return first_statement


def _dedent(lines: list[str], column: int) -> str:
    """Remove the def's own indentation; lines indented less (inside strings) are kept as they are."""
    prefix = " " * column
    return "\n".join(line[column:] if line.startswith(prefix) else line for line in lines)


# ---- docs -------------------------------------------------------------------------------------


def _sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(title, body lines) per section; text before the first heading has the title ""."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    i = 0
    while i < len(lines):
        title_at = _heading_at(lines, i)
        if title_at is None:
            sections[-1][1].append(lines[i])
            i += 1
            continue
        title, consumed = title_at
        sections.append((title, []))
        i += consumed
    return [(title, body) for title, body in sections if any(line.strip() for line in body)]


def _heading_at(lines: list[str], i: int) -> tuple[str, int] | None:
    """(title, lines it spans) when a heading starts at line i: an optional overline, a title at column
    0, an underline at least as long as the title."""

    def adornment(j: int) -> bool:
        return j < len(lines) and bool(_ADORNMENT.fullmatch(lines[j]))

    over = adornment(i)
    t = i + 1 if over else i
    if t + 1 >= len(lines):
        return None
    title = lines[t]
    if not title.strip() or title[0].isspace() or adornment(t) or not adornment(t + 1):
        return None
    if len(lines[t + 1].rstrip()) < len(title.rstrip()):
        return None
    if over and lines[i].rstrip()[0] != lines[t + 1].rstrip()[0]:
        return None
    return title.strip(), (t + 2 - i)


def _units(body: list[str]) -> list[str]:
    """Blocks separated by blank lines, each indented block joined to the column-0 block before it."""
    units: list[list[str]] = []
    block: list[str] = []
    for line in body + [""]:
        if line.strip():
            block.append(line)
            continue
        if block:
            starts_indented = block[0][0].isspace()
            if starts_indented and units:
                units[-1] += [""] + block
            elif not starts_indented:
                units.append(block)
            # An indented block with no paragraph before it in the section is left out.
            block = []
    return ["\n".join(u).rstrip() for u in units]


def _take(units: list[str], i: int, enough) -> tuple[str, int]:
    """Units from index i joined by blank lines: for a prompt (`enough` given) until enough(text); for a
    continuation, as many as fit in CONTINUATION_MAX_CHARS (at least one). Returns (text, next index)."""
    taken: list[str] = []
    while i < len(units):
        text = "\n\n".join(taken)
        if enough is not None and taken and enough(text):
            break
        grown = "\n\n".join(taken + [units[i]])
        if enough is None and taken and len(grown) > CONTINUATION_MAX_CHARS:
            break
        taken.append(units[i])
        i += 1
    return "\n\n".join(taken), i
