"""Click options generated from the typed config dataclasses: every setting is written once.

Both CLIs (dflash-extract, dflash-train) build their options from their config class, as torchtitan
derives its flags from its config classes. A field whose type is itself a config dataclass (torchtitan's
nesting: dflash-train's loss, optimizer, drafter and evaluation settings) contributes its own fields as
top-level options, in place, so the command line stays flat while each component validates its own
fields. For each leaf field:

    name     the option's name: the click parameter, and the key of `to_options` (run records and
             resume identities are flat dicts of these): the field name, or `cli_field(name=...)` where a
             nested field's short name would be ambiguous at top level (`chunk_blocks` -> loss_chunk_blocks)
    flag     the name with dashes (`token_budget` -> `--token-budget`), or the one named by
             `cli_field(flag=...)` where the short name is the established one (`--out`, `--taps`)
    default  the field's default (None: the option is optional and the help says what unset means)
    help     the docstring under the field (the convention of every config class here)
    type     from the annotation: int, float, str; bool -> `--x` (default False) or `--x/--no-x`
             (default True or None); Literal[...] -> Choice; list[int] / tuple[float, ...] -> one
             comma-separated value (parse_number_list), or with `cli_field(repeat=True)` a repeatable option; `cli_field(path=...)` -> click.Path
    identity `cli_field(identity=False)` marks a setting a resumed run may change (cadence, paths, kernels):
             `to_options(cfg, identity_only=True)` leaves it out
    envvar   `cli_field(envvar=...)`: the variable that gives the value when the flag is not on the command
             line, named in --help. For secrets only (dflash-data's --api-key from OPENAI_API_KEY), so they
             need not sit in `ps` and shell history; no other setting comes from the environment
A field without a default is a required option. `from_options` builds the config (nested ones first)
from flat options; `build_config` does so for a command and turns a ValueError from a __post_init__ into
a usage error (exit 2, no traceback). The configs' own messages speak in flags (`config_error`), so
what the user reads names what they typed.

It lives in shards/ because that is the one package both stages import.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import click

from shards.format import canonical_precision

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])

# click.Path settings by name, for cli_field(path=...).
PATH_KINDS = {
    "existing_dir": dict(exists=True, file_okay=False),  # must exist, a directory
    "dir": dict(file_okay=False),  # a directory that may not exist yet
    "file": dict(dir_okay=False),  # a file that may not exist yet
    "existing_file": dict(exists=True, dir_okay=False),  # must exist, a file
}
# Context settings every command of both CLIs uses: `-h` as well as `--help`, help text 110 wide.
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def cli_field(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    path: str | None = None,
    name: str | None = None,
    identity: bool = True,
    envvar: str | None = None,
    repeat: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with CLI metadata: `flag` replaces the derived flag, `path` is a PATH_KINDS key,
    `name` replaces the field name as the option's name, `identity=False` keeps it out of the run's
    identity (to_options(identity_only=True)), `envvar` names the variable a secret may come from, `repeat`
    makes a list[str] field a repeatable option (one value per flag) instead of one comma-separated value."""
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"cli_field path must be one of {sorted(PATH_KINDS)}, got {path!r}")
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        repr=envvar is None,  # a secret's value stays out of the config's repr (and so of any message with it)
        metadata={"flag": flag, "path": path, "name": name, "identity": identity, "envvar": envvar, "repeat": repeat},
    )


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a config class: a leaf field, at the top or inside nested configs."""

    name: str  # the click parameter and the flat key (to_options, from_options)
    path: tuple[str, ...]  # attribute path from the root config: ("loss", "chunk_blocks")
    owner: type  # the dataclass declaring the field (its docstrings are the option's --help)
    field: dataclasses.Field
    hint: Any  # the field's resolved annotation

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag") or "--" + self.name.replace("_", "-")

    @property
    def identity(self) -> bool:
        return self.field.metadata.get("identity", True)


def _is_config(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def option_fields(cls: type) -> tuple[Option, ...]:
    """Every option of config class `cls`, nested configs' fields in place of the nested field."""
    hints = typing.get_type_hints(cls)
    found: list[Option] = []
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]):
            found += [dataclasses.replace(o, path=(f.name, *o.path)) for o in option_fields(hints[f.name])]
        else:
            found.append(Option(f.metadata.get("name") or f.name, (f.name,), cls, f, hints[f.name]))
    names = [o.name for o in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # one flag and one record key per option: a clash is a bug in the config classes
        raise TypeError(f"{cls.__name__}: options {twice} are declared twice; give one a cli_field(name=...)")
    return tuple(found)


def flag_name(cls: type, name: str) -> str:
    """The command-line flag of option `name` of config class `cls` (`--token-budget`); a nested config
    class also answers for its own field names (LossConfig's `chunk_blocks` -> `--loss-chunk-blocks`)."""
    for o in option_fields(cls):
        if o.name == name or o.path == (name,):
            return o.flag
    raise KeyError(name)


def shown(value: Any) -> str:
    """A value as the user would have typed it: lists comma-separated, strings unquoted."""
    if isinstance(value, (list, tuple)):
        return ",".join(shown(v) for v in value)
    return str(value)


def config_error(cfg: Any, name: str, rule: str) -> ValueError:
    """`--warmup-ratio 1.5: must be in [0, 1)`: the flag, the value given, then the rule and fix."""
    return ValueError(f"{flag_name(type(cfg), name)} {shown(getattr(cfg, name))}: {rule}")


def at_least(cfg: Any, minimum: int, *names: str) -> None:
    """Each named field is an integer >= minimum, else `--name value: must be an integer >= minimum`."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < minimum:
            raise config_error(cfg, name, f"must be an integer >= {minimum}")


def to_options(cfg: Any, *, identity_only: bool = False) -> dict[str, Any]:
    """The config as flat options {name: value}, in option order (values copied, as dataclasses.asdict
    copies them); identity_only: only the settings a resumed run must keep (cli_field(identity=...))."""
    out = {}
    for o in option_fields(type(cfg)):
        if o.identity or not identity_only:
            value = cfg
            for attr in o.path:
                value = getattr(value, attr)
            out[o.name] = copy.deepcopy(value)
    return out


def from_options(cls: type[C], options: Mapping[str, Any]) -> C:
    """The config from flat options (an option left out takes its default). Nested configs are built
    first, so their __post_init__ checks run before the outer one's; raises ValueError as those do."""
    left = dict(options)
    cfg = _build(cls, left)
    if left:
        raise TypeError(f"{cls.__name__}: no option named {', '.join(sorted(left))}")
    return cfg


def _build(cls: type[C], left: dict[str, Any]) -> C:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], left)
        elif (name := f.metadata.get("name") or f.name) in left:
            kwargs[f.name] = left.pop(name)
    return cls(**kwargs)


def parse_number_list(text: str, kind: type = int) -> list:
    """'1,16,31' or '1 16 31' -> [1, 16, 31]: the one parser of every list-valued flag."""
    try:
        return [kind(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"expected comma-separated {'integers' if kind is int else 'numbers'}, got {text!r}") from None


class NumberList(click.ParamType):
    """A comma-separated list of ints (or floats) as one option value."""

    def __init__(self, kind: type = int) -> None:
        self.kind = kind
        self.name = {int: "ints", float: "numbers"}.get(kind, "list")  # the metavar in --help

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list:
        if isinstance(value, (list, tuple)):
            return [self.kind(v) for v in value]
        try:
            return parse_number_list(value, self.kind)
        except ValueError as e:
            self.fail(str(e), param, ctx)


INT_LIST = NumberList(int)


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, one paragraph (read from the class's source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (frozen app): options without help rather than a crash
            continue
        body = tree.body[0].body
        for stmt, after in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def config_options(cls: type, *, exclude: Sequence[str] = ()) -> Callable[[F], F]:
    """Decorator adding one click option per option of `cls` (minus those named in `exclude`)."""
    options = [o for o in option_fields(cls) if o.name not in exclude]
    docs = {o.owner: field_docs(o.owner) for o in options}

    def decorate(fn: F) -> F:
        for o in reversed(options):  # click lists options in decoration order, innermost first
            fn = _option(o, docs[o.owner].get(o.field.name, ""))(fn)
        return fn

    return decorate


def _option(o: Option, help_text: str) -> Callable[[F], F]:
    f, flag = o.field, o.flag
    has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    default = (
        f.default
        if f.default is not dataclasses.MISSING
        else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    )
    base, optional = _strip_optional(o.hint)
    kwargs: dict[str, Any] = dict(help=help_text, required=not has_default)
    if f.metadata.get("envvar"):
        kwargs |= dict(envvar=f.metadata["envvar"], show_envvar=True)
    if base is bool:
        if default is False:
            return click.option(flag, o.name, is_flag=True, default=False, **kwargs)
        return click.option(
            f"{flag}/--no-{flag[2:]}", o.name, default=default, show_default=default is not None, **kwargs
        )
    if typing.get_origin(base) is Literal:
        kwargs["type"] = PrecisionChoice([str(c) for c in typing.get_args(base)])
    elif f.metadata.get("repeat"):
        kwargs |= dict(type=str, multiple=True)  # repeatable: --template-kwarg a=1 --template-kwarg b=2
        default = tuple(default or ()) or None  # click passes () when none is given
    elif typing.get_origin(base) in (list, tuple):
        kind = typing.get_args(base)[0]
        kwargs["type"] = NumberList(kind)
        default = shown(default) if default else None  # shown in --help as the user would type it
    elif f.metadata.get("path"):
        kwargs["type"] = click.Path(**PATH_KINDS[f.metadata["path"]])
    elif base in (int, float, str):
        kwargs["type"] = base
    else:
        raise TypeError(f"{o.owner.__name__}.{f.name}: no CLI type for annotation {o.hint!r}")
    if has_default:
        kwargs["default"] = default
        kwargs["show_default"] = default is not None
    return click.option(flag, o.name, **kwargs)


class PrecisionChoice(click.Choice):
    """click.Choice that also takes the other spelling of a precision name (format.canonical_precision:
    `--storage bfloat16` is bf16, `--compute-dtype bf16` is bfloat16) and passes on the listed one."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return super().convert(canonical_precision(value, self.choices), param, ctx)


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    """`int | None` -> (int, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def build_config(cls: type[C], options: dict[str, Any]) -> C:
    """The config from parsed options; its ValueError becomes click's usage error (exit 2, no traceback)."""
    try:
        return from_options(cls, options)
    except ValueError as e:
        raise click.UsageError(str(e)) from e


def gpus_option(fn: F) -> F:
    """`--gpus N|all`: start one process per GPU under torchrun (both CLIs)."""
    return click.option(
        "--gpus",
        default=None,
        metavar="N|all",
        help="Start one process per GPU under torchrun: a number or 'all' (more than the machine's GPUs is "
        "refused; with --device cpu, that many CPU processes). Default: one process, or whatever torchrun "
        "you launched yourself.",
    )(fn)


def relaunch_if_asked(module: str, gpus: str | None, device: str = "auto") -> bool:
    """With --gpus and not yet under torchrun, replace this process by torchrun over `module`.

    Returns False when nothing was relaunched (no --gpus, or already a torchrun rank); on a
    relaunch it does not return (os.execv). device: the command's --device (cpu: CPU processes).
    """
    if gpus is None or "LOCAL_RANK" in os.environ:
        return False
    from shards.common.runtime import relaunch_under_torchrun  # imports torch: only when relaunching

    try:
        relaunch_under_torchrun(module, gpus, sys.argv[1:], device)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    return True
