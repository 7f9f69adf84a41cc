"""Schedules from strings: 'dense', 'const:N', 'steps:BIN:b1,b2,...', explicit 'start:budget,...' pairs, a
preset name or a JSON file (`parse_schedule`), and lists of them (`split_schedules`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sparrow.errors import SparrowError

from .files import read_file
from .schedule import DEFAULT_KEPT_PAGES, DENSE, PRESET_PAGE_SIZE, Schedule, const, load_presets, steps

_INT = re.compile(r"[+-]?\d+")

_FORMS = "'dense', 'const:N', 'steps:BIN:b1,b2,...', 'start:budget,...'"


def parse_schedule(spec: str, page_size: int = 16,
                   always_kept_pages: int = DEFAULT_KEPT_PAGES) -> Schedule:
    """Build and validate a schedule from a command-line or config string (forms listed in the error below); its
    budgets must hold `always_kept_pages` whole pages (by default the default SparseConfig's sink + recent)."""
    schedule = _parse(str(spec).strip(), page_size, always_kept_pages)
    schedule.validate(page_size, always_kept_pages)
    return schedule



def split_schedules(text: str) -> list[str]:
    """'const:256,const:512,dense' -> specs. Pieces starting with a digit continue the previous spec (so
    'steps:1000:256,512' stays whole); ';' separates specs outright."""
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if specs and piece[0].isdigit():
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs



def _parse(spec: str, page_size: int, always_kept_pages: int) -> Schedule:
    """Dispatch on the spec's form, without validation."""
    if spec == "dense":
        return DENSE
    if spec.startswith("const:"):
        return const(_parse_int(spec[len("const:"):], "const budget", spec))
    if spec.startswith("steps:"):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2]:
            raise SparrowError(f"bad steps schedule {spec!r}: expected 'steps:BIN:b1,b2,...', "
                               "e.g. 'steps:1000:256,512,1024'")
        budgets = [_parse_int(b, "steps budget", spec) for b in parts[2].split(",")]
        return steps(_parse_int(parts[1], "steps bin size", spec), budgets)
    presets = load_presets()
    if spec in presets:
        if page_size != PRESET_PAGE_SIZE:
            raise SparrowError(f"preset {spec!r} is defined for page size {PRESET_PAGE_SIZE}, not {page_size}")
        return presets[spec]
    if spec.endswith(".json") or os.sep in spec or "/" in spec or Path(spec).is_file():
        return read_file(Path(spec), page_size, always_kept_pages)[0]
    if ":" in spec:
        head = spec.split(":", 1)[0].strip()
        if head and not head.lstrip("+-").isdigit() and "," not in head:
            raise SparrowError(f"unknown schedule kind {head!r} in {spec!r}: expected {_FORMS}, a preset name "
                               f"({', '.join(presets)}) or a JSON file")
        return _parse_pairs(spec)
    raise SparrowError(f"unknown schedule {spec!r}: expected {_FORMS}, a preset name "
                       f"({', '.join(presets)}) or a JSON file")



def _parse_pairs(spec: str) -> Schedule:
    """Explicit bins `start:budget,start:budget,...`."""
    starts, budgets = [], []
    for item in spec.split(","):
        pair = item.split(":")
        if len(pair) != 2:
            raise SparrowError(f"bad bin {item.strip()!r} in schedule {spec!r}: expected 'start:budget', "
                               "e.g. '0:256,2000:512'")
        starts.append(_parse_int(pair[0], "bin start", spec))
        budgets.append(_parse_int(pair[1], "bin budget", spec))
    return Schedule(spec, tuple(starts), tuple(budgets))



def _parse_int(text: str, what: str, spec: str) -> int:
    """An integer from a spec fragment, or an error naming the fragment and the whole spec."""
    text = text.strip()
    if not _INT.fullmatch(text):
        raise SparrowError(f"{what} {text!r} in schedule {spec!r} is not an integer")
    return int(text)
