"""Stage options stated once: a config dataclass whose fields carry their help and their check, and the command
line derived from it (litgpt's way). One place per option: the default, the flag, the help, the validation.

    @dataclass
    class CaptureConfig:
        out: str = option(help="store folder to write")                      # required (no default)
        limit: int | None = option(None, help="only the first N prompts", check=at_least(1))

    add_options(parser, CaptureConfig)                  # --out, --limit (types, choices, help from the fields)
    cfg = from_args(CaptureConfig, args)                # builds the dataclass and runs every field's check

Flags are the field names with `-` for `_`; `bool` fields are switches (`--flag`, or `--no-flag` when the default is
True); `list[int]` fields read comma-separated integers; `dict` fields read a JSON object. A check returns what is
wrong in words (or None), and `validate` turns it into one `UserError` naming the flag and the value, so a bad value
fails before any work starts, whether the config came from the command line or from code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from dataclasses import MISSING
from typing import Any, Callable, Literal

from dflash_train.errors import UserError

Check = Callable[[Any], "str | None"]


def option(default: Any = MISSING, *, help: str, check: Check | None = None, flag: str | None = None,
           aliases: tuple[str, ...] = (), metavar: str | None = None,
           default_factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that is also a command-line option (no default: a required flag). `aliases` are older
    spellings of the flag that keep working."""
    metadata = {"help": help, "check": check, "flag": flag, "aliases": aliases, "metavar": metavar}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# --- checks -----------------------------------------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at_least(low: float) -> Check:
    def check(value: Any) -> str | None:
        if value is None:
            return None
        if not _number(value) or not math.isfinite(value) or value < low:
            return f"must be a number >= {low:g}"
        return None
    return check


def integer_at_least(low: int) -> Check:
    def check(value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            return f"must be an integer >= {low}"
        return None
    return check


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if value is None:
            return None
        if not _number(value) or not math.isfinite(value) or (value <= low if low_open else value < low) \
                or (value >= high if high_open else value > high):
            return f"must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        return None
    return check


def each(check: Check) -> Check:
    """A list option's check: `check` on every element, and every element once (a K or a concurrency named twice
    would be timed twice; None passes)."""
    def check_all(values: Any) -> str | None:
        for i, value in enumerate(values or []):
            if problem := check(value):
                return f"has {value!r}, which {problem}"
            if value in values[:i]:
                return f"has {value!r} twice"
        return None
    return check_all


def one_of(*choices: Any) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(map(str, choices))}"
    return check


# --- parsing ----------------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return _number_list(text, int, "integers")


def float_list(text: str) -> list[float]:
    return _number_list(text, float, "numbers")


def _number_list(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:  # a list option given with nothing in it is a mistake, not "none"
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    return values


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls: type, positional: tuple[str, ...] = ()) -> None:
    """One argparse option per field of `cls` (fields named in `positional` become positional arguments)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        tp = _strip_optional(hints[f.name])
        required = f.default is MISSING and f.default_factory is MISSING
        default = None if required else (f.default if f.default is not MISSING else f.default_factory())
        kwargs: dict[str, Any] = {"help": f.metadata["help"]}
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if f.name in positional:
            parser.add_argument(f.name, **kwargs)
            continue
        flags = [flag_of(f), *f.metadata.get("aliases", ())]
        if tp is bool:
            if default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    **kwargs)
            else:
                parser.add_argument(*flags, dest=f.name, action="store_true", **kwargs)
            continue
        origin = typing.get_origin(tp)
        if origin is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = type(kwargs["choices"][0])
        elif origin is list and typing.get_args(tp) in ((int,), (float,)):
            kwargs["type"] = int_list if typing.get_args(tp) == (int,) else float_list
        elif origin is list:  # repeatable; argparse appends to a fresh list (from_args fills the field's default)
            kwargs.update(action="append", metavar=kwargs.get("metavar") or f.name.upper().rstrip("S"))
            default = None
        elif tp is dict or origin is dict:
            kwargs["type"] = json_object
        elif tp in (int, float, str):
            kwargs["type"] = tp
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
            if default not in (None, [], {}, "") and "(default" not in kwargs["help"]:
                kwargs["help"] += f" (default: {default})"
        parser.add_argument(*flags, dest=f.name, **kwargs)


def validate(cfg: Any) -> Any:
    """Run every field's check (and, for a Literal field, its choices); the first failure is one UserError naming
    the flag and the value."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        checks = [f.metadata.get("check")]
        tp = _strip_optional(hints[f.name])
        if typing.get_origin(tp) is Literal and not (value is None and tp is not hints[f.name]):
            checks.append(one_of(*typing.get_args(tp)))
        for check in checks:
            problem = check(value) if check is not None else None
            if problem:
                raise UserError(f"{flag_of(f)} {value!r} {problem}")
    return cfg


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass `cls` from parsed arguments (fields without an option, and repeatable options given no
    time, keep their defaults), validated."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in names and not (v is None and isinstance(
        _default_of(cls, k), list))}
    return validate(cls(**given))


def _default_of(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default
