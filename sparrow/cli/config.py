"""Command-line side of the typed configs (sparrow/typed_config.py): one `--option` per config option.

Each option becomes `--flat-name` (default None, so an unset option leaves the YAML or dataclass default in place),
or a positional argument where it is declared so (`option(positional=...)`). `load_config` merges dataclass defaults
< the `--config` YAML file < command-line values, builds the config and calls its own `validate()`, before any model
is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sparrow.typed_config import build, flatten_mapping, item_type, load_yaml, options, sections


def add_config_options(parser: argparse.ArgumentParser, cls) -> None:
    """Add `--config FILE` and one option per option of the config class `cls` (sections included), with the
    help text its field declares: a flag, or a positional argument where the option says so."""
    parser.add_argument("--config", type=Path, default=None, help="YAML file with any of the options below")
    for option in options(cls):
        if option.positional:
            parser.add_argument(option.name, metavar=option.positional, help=option.help,
                                nargs="+" if option.kind == "list" else None,
                                type=item_type(option.annotation) if option.kind == "list" else option.kind)
            continue
        flag = "--" + option.name.replace("_", "-")
        text = option.help
        text = f"{text} (default: {option.default})" if text else f"default: {option.default}"
        if option.kind == "bool":
            parser.add_argument(flag, dest=option.name, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        elif option.kind == "list":
            parser.add_argument(flag, dest=option.name, action="append", default=None,
                                type=item_type(option.annotation), help=text + " (repeatable)")
        else:
            parser.add_argument(flag, dest=option.name, type=option.kind, default=None, help=text)


def load_config(cls, args: argparse.Namespace):
    """Build `cls` from defaults, then `args.config` (YAML), then explicit command-line values; validate it."""
    values: dict = {}
    if getattr(args, "config", None) is not None:
        path = Path(args.config)
        values.update(flatten_mapping(cls, load_yaml(path), f"config file {str(path)!r}",
                                      getattr(args, "command", None)))
    for option in options(cls):
        value = getattr(args, option.name, None)
        if value is not None:
            values[option.name] = value
    config = build(cls, values)
    config.validate()
    for part in (config, *(getattr(config, name) for name in sections(cls))):
        if hasattr(part, "check_given"):  # options that must not be given where they would do nothing
            part.check_given(values)
    return config
