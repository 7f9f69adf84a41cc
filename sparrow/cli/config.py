"""Typed command configs: a dataclass per command, loadable from YAML, overridable from the command line.

Each dataclass field becomes a `--field-name` option (default None, so an unset option leaves the YAML or
dataclass default in place). `load_config` merges dataclass defaults < YAML file < command-line values and then
calls the config's own `validate()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path

import yaml

from sparrow.errors import SparrowError


def _scalar_type(tp):
    """The argparse `type` for a field annotation (Optional[X] -> X)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _scalar_type(args[0]) if len(args) == 1 else str
    if tp is bool:
        return "bool"
    if origin in (list, tuple):
        return "list"
    return tp if tp in (int, float, str) else str


def _item_type(tp):
    """The element type of a list[X] | None annotation (str when unknown)."""
    for arg in typing.get_args(tp) or (tp,):
        if typing.get_origin(arg) in (list, tuple) and typing.get_args(arg):
            inner = typing.get_args(arg)[0]
            return inner if inner in (int, float, str) else str
    return str


def _matches(value, kind) -> bool:
    """Whether a YAML value has the scalar type `kind` (int, float, str or "bool"); ints pass as floats and
    booleans never pass as numbers."""
    if kind == "bool" or isinstance(value, bool):
        return kind == "bool" and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def _check_yaml_value(name: str, value, tp, path: Path):
    """A YAML value of the field's type (a single item where a list is expected becomes a list); a SparrowError
    naming it otherwise."""
    if value is None:
        if type(None) in typing.get_args(tp):
            return None
        raise SparrowError(f"config file {str(path)!r}: {name} may not be empty (null)")
    kind = _scalar_type(tp)
    if kind == "list":
        value = value if isinstance(value, list) else [value]
        ok = all(_matches(v, _item_type(tp)) for v in value)
    else:
        ok = _matches(value, kind)
    if not ok:
        wanted = {"bool": "true or false", "list": f"a list of {_item_type(tp).__name__}", int: "an integer",
                  float: "a number"}.get(kind, "a string")
        raise SparrowError(f"config file {str(path)!r}: {name} is {value!r}; expected {wanted}")
    return float(value) if kind is float else value


def add_config_options(parser: argparse.ArgumentParser, cls, help_texts: dict[str, str] | None = None,
                       skip: tuple[str, ...] = ()) -> None:
    """Add `--config FILE` and one option per field of the dataclass `cls`."""
    help_texts = help_texts or {}
    parser.add_argument("--config", type=Path, default=None, help="YAML file with any of the options below")
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _scalar_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        text = help_texts.get(field.name, "")
        text = f"{text} (default: {default})" if text else f"default: {default}"
        if kind == "bool":
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif kind == "list":
            parser.add_argument(flag, dest=field.name, action="append", default=None,
                                type=_item_type(hints[field.name]), help=text + " (repeatable)")
        else:
            parser.add_argument(flag, dest=field.name, type=kind, default=None, help=text)


def load_config(cls, args: argparse.Namespace):
    """Build `cls` from defaults, then `args.config` (YAML), then explicit command-line values; validate it."""
    values: dict = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if getattr(args, "config", None) is not None:
        path = Path(args.config)
        if not path.is_file():
            raise SparrowError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise SparrowError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise SparrowError(f"config file {str(path)!r} must hold a mapping of option: value")
        unknown = sorted(set(loaded) - names)
        if unknown:
            raise SparrowError(f"config file {str(path)!r} has unknown option(s) {unknown}; known: {sorted(names)}")
        hints = typing.get_type_hints(cls)
        values.update({name: _check_yaml_value(name, value, hints[name], path) for name, value in loaded.items()})
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    try:
        config = cls(**values)
    except TypeError as err:
        raise SparrowError(f"bad config: {err}") from None
    config.validate()
    return config
