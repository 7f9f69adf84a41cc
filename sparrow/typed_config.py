"""Typed configs: (nested) dataclasses built from YAML mappings and command-line values, checked up front.

A config is a dataclass whose fields are options or sections (fields whose type is itself a dataclass). Every
option has a flat name, unique in the whole config: its field name, or `field(metadata={"flag": ...})` where the
section would make it ambiguous (the `lr` of the `distill` section is `distill_lr`). The command line uses the
flat names (`--distill-lr`); a YAML file may use nested sections (`distill: {lr: 1.0e-3}`) or the flat names
(`distill_lr: 1.0e-3`), and a key that is both a section and an option (`distill: true` / `distill: {...}`) is
told apart by its value: a mapping is the section.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from sparrow.errors import SparrowError
from sparrow.io import require_file


@dataclass(frozen=True)
class Option:
    """One option of a config: where it lives (`path` of field names), its flat name, annotation and default."""

    path: tuple[str, ...]
    name: str
    annotation: object
    default: object
    help: str = ""
    positional: str | None = None  # the metavar of an option given as a positional argument, not as a flag

    @property
    def kind(self):
        return scalar_type(self.annotation)

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.annotation)

    @property
    def mixed(self) -> bool:
        """Whether the option takes values of several scalar types (`int | str`): given as a string on the command
        line, as either in a file, and parsed by its section's validate()."""
        return len([a for a in typing.get_args(self.annotation) if a is not type(None)]) > 1 \
            and typing.get_origin(self.annotation) in (typing.Union, types.UnionType)


def scalar_type(tp):
    """int, float, str, "bool" or "list" for an annotation (Optional[X] -> X)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return scalar_type(args[0]) if len(args) == 1 else str
    if tp is bool:
        return "bool"
    if origin in (list, tuple):
        return "list"
    return tp if tp in (int, float, str) else str


def item_type(tp):
    """The element type of a list[X] | None annotation (str when unknown)."""
    for arg in typing.get_args(tp) or (tp,):
        if typing.get_origin(arg) in (list, tuple) and typing.get_args(arg):
            inner = typing.get_args(arg)[0]
            return inner if inner in (int, float, str) else str
    return str


def _section_type(tp):
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def sections(cls) -> dict[str, type]:
    """The section fields of a config class and their dataclass types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and _section_type(hints[f.name])}


def options(cls, prefix: tuple[str, ...] = (), defaults=None) -> list[Option]:
    """Every option of `cls`, sections included, in declaration order. A section's defaults are those of the
    instance its field's default_factory makes (a command may set its own defaults for a shared section)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if _section_type(hints[f.name]):
            inner = None if f.default_factory is dataclasses.MISSING else f.default_factory()
            found += options(hints[f.name], prefix + (f.name,), inner)
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
        found.append(Option(prefix + (f.name,), f.metadata.get("flag", f.name), hints[f.name], default,
                            f.metadata.get("help", ""), f.metadata.get("positional")))
    names = [o.name for o in found]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}: option names are not unique: {sorted(n for n in names if names.count(n) > 1)}")
    return found


def _matches(value, kind) -> bool:
    """Whether a value has the scalar type `kind`; ints pass as floats, booleans never pass as numbers."""
    if kind == "bool" or isinstance(value, bool):
        return kind == "bool" and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def check_value(option: Option, value, source: str):
    """A file's value converted to the option's type (one item where a list is expected becomes a list)."""
    if value is None:
        if option.optional:
            return None
        raise SparrowError(f"{source}: {option.name} may not be empty (null)")
    kind = option.kind
    if option.mixed:
        return value  # an option of several types (int | str) is parsed by its section's validate()
    if kind == "list":
        value = value if isinstance(value, list) else [value]
        ok = all(_matches(v, item_type(option.annotation)) for v in value)
    else:
        ok = _matches(value, kind)
    if not ok:
        wanted = {"bool": "true or false", "list": f"a list of {item_type(option.annotation).__name__}",
                  int: "an integer", float: "a number"}.get(kind, "a string")
        raise SparrowError(f"{source}: {option.name} is {value!r}; expected {wanted}")
    return float(value) if kind is float else value


def flatten_mapping(cls, mapping: dict, source: str, command: str | None = None) -> dict[str, object]:
    """{flat option name: checked value} from a mapping of nested sections and/or (at the top) flat names.
    `command` names the `sparrow` command whose --help an unknown-option message points to."""
    every = options(cls)
    by_name = {o.name: o for o in every}
    values: dict[str, object] = {}
    spelled: dict[str, str] = {}  # flat name -> the key that set it ("learning_rate" or "grpo.learning_rate")

    def walk(section_cls, data: dict, prefix: tuple[str, ...]) -> None:
        inner = sections(section_cls)
        own = {o.path[-1]: o for o in every if o.path[:-1] == prefix}
        for key, value in data.items():
            spelling = ".".join(prefix + (str(key),))
            if key in inner and isinstance(value, dict):
                walk(inner[key], value, prefix + (key,))
                continue
            option = own.get(key) or (by_name.get(key) if not prefix else None)
            if option is None and key in inner:
                raise SparrowError(f"{source}: section {spelling!r} must be a mapping of its options, "
                                   f"got {short_repr(value)}")
            if option is None:
                raise SparrowError(f"{source}: unknown option {spelling!r}" + _suggest(
                    str(key), sorted(own) + sorted(inner) if prefix else sorted(set(by_name) | set(inner)),
                    by_name.get(key), command))
            if option.name in spelled:
                raise SparrowError(f"{source}: {spelled[option.name]!r} and {spelling!r} both set {option.name}; "
                                   "give one of them")
            spelled[option.name] = spelling
            values[option.name] = check_value(option, value, source)

    walk(cls, mapping, ())
    return values


def short_repr(value) -> str:
    """A repr cut to a readable length for a one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _suggest(key: str, known: list[str], elsewhere: Option | None, command: str | None) -> str:
    """The tail of an unknown-option message: the closest valid names, and where to see all of them."""
    close = difflib.get_close_matches(key, known, n=3)
    if elsewhere is not None:
        tail = f"; did you mean {'.'.join(elsewhere.path)}?"
    else:
        tail = f"; did you mean {' or '.join(close)}?" if close else ""
    return tail + (f" (`sparrow {command} --help` lists every option)" if command else "")


_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class ConfigYAMLError(yaml.MarkedYAMLError):
    """A YAML file that parses but is refused as a config (a key given twice, an alias)."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader for config files: YAML 1.2 floats (1e-4, not only 1.0e-4), no repeated keys in a
    mapping, and no aliases (`*name`), so a small file cannot expand into a huge one."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigYAMLError(problem=f"YAML aliases (*{event.anchor}) are not supported in config files",
                                  problem_mark=event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in first:
                    raise ConfigYAMLError(problem=f"key {key!r} is given twice in one mapping (first on line "
                                                  f"{first[key].line + 1})", problem_mark=key_node.start_mark)
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """One line for a YAML error: the file, line and column, and the problem."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return f"config file {str(path)!r} is not valid YAML: {' '.join(str(err).split())}"
    mark = err.problem_mark or err.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    if isinstance(err, ConfigYAMLError):
        return f"config file {str(path)!r}, {where}{err.problem}"
    text = err.problem or err.context
    if err.problem and err.context and err.context_mark:
        text += f" ({err.context} at line {err.context_mark.line + 1}, column {err.context_mark.column + 1})"
    return f"config file {str(path)!r} is not valid YAML: {where}{text}"


def load_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file, or a SparrowError saying what is wrong with the file."""
    path = require_file(path, "config file")
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=ConfigLoader) or {}
    except UnicodeDecodeError as err:
        raise SparrowError(f"config file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise SparrowError(_yaml_error(path, err)) from None
    if not isinstance(loaded, dict):
        raise SparrowError(f"config file {str(path)!r} must hold a mapping of option: value")
    return loaded


def build(cls, values: dict[str, object]):
    """An instance of `cls` from {flat option name: value}; unset options keep their defaults."""
    by_path = {o.path: o.name for o in options(cls)}

    def make(section_cls, prefix, factory=None):
        kwargs = {}
        for f in dataclasses.fields(section_cls):
            if not f.init:
                continue
            path = prefix + (f.name,)
            inner = sections(section_cls).get(f.name)
            if inner is not None:
                kwargs[f.name] = make(inner, path, None if f.default_factory is dataclasses.MISSING
                                      else f.default_factory)
            elif by_path[path] in values:
                kwargs[f.name] = values[by_path[path]]
        try:
            return dataclasses.replace(factory(), **kwargs) if factory is not None else section_cls(**kwargs)
        except TypeError as err:
            raise SparrowError(f"bad config: {err}") from None

    unknown = sorted(set(values) - set(by_path.values()))
    if unknown:
        raise SparrowError(f"unknown option(s) {unknown}")
    return make(cls, ())


def to_nested(config) -> dict:
    """The config as nested sections of plain values (for YAML and the run's saved config)."""
    return {f.name: to_nested(getattr(config, f.name)) if dataclasses.is_dataclass(getattr(config, f.name))
            else getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def option(default=None, help: str = "", *, flag: str | None = None, positional: str | None = None):
    """A config option with its help text (the CLI's --help) and, where the field's own name would be ambiguous
    across sections, its flat name `flag` (its CLI flag and flat YAML key: `distill.lr` is `distill_lr`).
    `positional`: the command line takes the option as a required positional argument shown as this name (the
    SPEC of `sparrow schedule show SPEC`; a list option takes one or more), not as a flag."""
    metadata = {"help": help, **({"flag": flag} if flag else {}),
                **({"positional": positional} if positional else {})}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls, **defaults):
    """A section field of type `cls` whose options default to `defaults` (a command's own defaults for a shared
    section, e.g. `max_new_tokens` 128 for generate); the others keep the section's."""
    return dataclasses.field(default_factory=lambda: cls(**defaults))


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int, or a SparrowError unless it is an integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise SparrowError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_finite(name: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False) -> None:
    """A SparrowError unless `value` is a finite number within the bounds (open or closed)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        left = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        right = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
        bounds = " and ".join(b for b in (left, right) if b)
        raise SparrowError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {value!r}")
