"""KV-budget schedules: step functions from a sequence's total cached length to its KV budget in tokens.

The cached length counts prompt plus generated tokens, including the token being decoded. A schedule raises the
budget as the sequence grows so the tail acceptance rate stays roughly constant (SPEC section 4). Budgets include
the always-kept pages (`SparseConfig.always_kept_pages`: 1 sink page + 2 most recent pages by default), so
top-k pages = budget / page_size - always-kept pages.

User schedules (`const:`, `steps:`, explicit pairs, files) give their bin starts in tokens. The published presets
are keyed by page count as the release's planner keys them (`page_bin_starts`): bin i starts at cached length
2000 i - 15, not 2000 i.
"""

from __future__ import annotations

import bisect
import functools
import json
import operator
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError
from sparrow.io import atomic_write_json, require_file

PRESET_PAGE_SIZE = 16
_INT = re.compile(r"[+-]?\d+")
_FORMS = "'dense', 'const:N', 'steps:BIN:b1,b2,...', 'start:budget,...'"
MAX_TOKENS = 2**53
"""Bin starts and budgets stay below this: exact as float64 (the cost model) and far inside int64 (the kernels)."""
FILE_KEYS = ("name", "page_size", "version", "bins")
BIN_KEYS = ("start", "kv_budget")


@dataclass(frozen=True)
class Schedule:
    """Bin i covers cached lengths in [starts[i], starts[i+1]) and gets budgets[i] tokens; empty means dense."""

    name: str
    starts: tuple[int, ...]
    budgets: tuple[int, ...]

    def __post_init__(self):
        starts = tuple(_as_int(s, f"schedule {self.name!r} start") for s in self.starts)
        budgets = tuple(_as_int(b, f"schedule {self.name!r} budget") for b in self.budgets)
        if len(starts) != len(budgets):
            raise SparrowError(f"schedule {self.name!r} has {len(starts)} starts but {len(budgets)} budgets; "
                               "expected one budget per bin")
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "budgets", budgets)

    @property
    def is_dense(self) -> bool:
        """True when there are no bins: every token is attended."""
        return not self.starts

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Starts and budgets as int64 tensors on `device`, built once per device (decode calls this every step)."""
        cache = self.__dict__.setdefault("_tensor_cache", {})
        if device not in cache:
            cache[device] = (torch.tensor(self.starts, dtype=torch.int64, device=device),
                             torch.tensor(self.budgets, dtype=torch.int64, device=device))
        return cache[device]

    def budget_for(self, lengths: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """Budget in tokens of the bin holding each length (int64, same shape and device as `lengths`; a numpy
        array for a numpy array, as the vLLM plugin's host-side plan passes)."""
        if self.is_dense:
            raise SparrowError(f"schedule {self.name!r} is dense and has no KV budget; check is_dense first")
        if isinstance(lengths, np.ndarray):
            idx = np.searchsorted(self.starts, lengths, side="right") - 1
            return np.asarray(self.budgets, dtype=np.int64)[np.maximum(idx, 0)]
        lengths = torch.as_tensor(lengths)
        starts, budgets = self._tables(lengths.device)
        idx = torch.searchsorted(starts, lengths.to(torch.int64).contiguous(), right=True) - 1
        return budgets[idx.clamp_(min=0)]

    def budget_at(self, length: int) -> int | None:
        """Budget in tokens for one cached length, or None for a dense schedule."""
        if self.is_dense:
            return None
        return self.budgets[max(bisect.bisect_right(self.starts, length) - 1, 0)]

    def to_json(self) -> list[dict]:
        """Bins as `[{"start": s, "kv_budget": b}, ...]`, the format parse_schedule reads from files."""
        return [{"start": s, "kv_budget": b} for s, b in zip(self.starts, self.budgets)]

    @classmethod
    def from_json(cls, name: str, bins, where: str = "schedule") -> Schedule:
        """The inverse of `to_json`, unvalidated; a SparrowError naming `where` and the bad bin otherwise."""
        if not isinstance(bins, list):
            raise SparrowError(f"{where} holds a {type(bins).__name__}; expected a list of "
                               '{"start", "kv_budget"} objects or an object with "bins"')
        starts, budgets = [], []
        for i, item in enumerate(bins):
            if not isinstance(item, dict) or "start" not in item or "kv_budget" not in item:
                raise SparrowError(f"{where}: bin {i} is {item!r}; "
                                   'expected {"start": int, "kv_budget": int}')
            starts.append(_as_int(item["start"], f"{where} bin {i} start"))
            budgets.append(_as_int(item["kv_budget"], f"{where} bin {i} kv_budget"))
        return cls(name, tuple(starts), tuple(budgets))

    def validate(self, page_size: int, always_kept_pages: int) -> None:
        """Raise SparrowError unless budgets are whole pages covering the always-kept ones and bins are ordered from
        0, all below MAX_TOKENS."""
        if page_size <= 0:
            raise SparrowError(f"page size must be a positive integer, got {page_size}")
        if self.is_dense:
            return
        if self.starts[0] != 0:
            raise SparrowError(f"schedule {self.name!r}: first bin starts at {self.starts[0]}; expected 0")
        for i, (start, budget) in enumerate(zip(self.starts, self.budgets)):
            if start >= MAX_TOKENS or budget >= MAX_TOKENS:
                what, value = ("start", start) if start >= MAX_TOKENS else ("budget", budget)
                raise SparrowError(f"schedule {self.name!r}: bin {i} {what} {value} is out of range; expected fewer "
                                   f"than 2**53 tokens")
        for i in range(1, len(self.starts)):
            if self.starts[i] <= self.starts[i - 1]:
                raise SparrowError(f"schedule {self.name!r}: bin {i} starts at {self.starts[i]}, not after bin "
                                   f"{i - 1} at {self.starts[i - 1]}; expected strictly increasing starts")
        minimum = always_kept_pages * page_size
        for i, budget in enumerate(self.budgets):
            if budget <= 0 or budget % page_size:
                raise SparrowError(f"schedule {self.name!r}: bin {i} budget {budget} is not a positive multiple "
                                   f"of the page size {page_size}; every budget must be whole pages")
            if budget < minimum:
                raise SparrowError(f"schedule {self.name!r}: bin {i} budget {budget} is below {minimum} tokens "
                                   f"(the {always_kept_pages} always-kept pages of {page_size} tokens); every budget "
                                   "must cover the pages each sparse step keeps (sink and recent)")


DENSE = Schedule("dense", (), ())


def const(budget: int) -> Schedule:
    """One bin from length 0: the same budget at every length."""
    return Schedule(f"const:{budget}", (0,), (budget,))


def steps(bin_size: int, budgets: list[int]) -> Schedule:
    """Equal-width bins: bin i starts at i * bin_size; the last budget covers everything longer."""
    bin_size = _as_int(bin_size, "steps bin size")
    if bin_size <= 0:
        raise SparrowError(f"steps bin size must be a positive number of tokens, got {bin_size}")
    if not budgets:
        raise SparrowError("steps needs at least one budget, got none")
    name = f"steps:{bin_size}:" + ",".join(str(b) for b in budgets)
    return Schedule(name, tuple(i * bin_size for i in range(len(budgets))), tuple(budgets))


def page_bin_starts(bin_pages: int, page_size: int, count: int) -> tuple[int, ...]:
    """Token starts of `count` bins keyed by page count, as the release's planner keys its schedules.

    With pages = ceil(length / page_size), bin i holds pages in [bin_pages * i, bin_pages * (i + 1)), so it
    starts at the shortest length with bin_pages * i pages: (bin_pages * i - 1) * page_size + 1, bin 0 at 0.
    For the presets (125 pages of 16 tokens) that is 2000 i - 15.
    """
    return (0,) + tuple((bin_pages * i - 1) * page_size + 1 for i in range(1, count))


@functools.cache
def _load_presets() -> dict[str, Schedule]:
    """The release's published schedules, read once from the packaged JSON (see its "about" field)."""
    data = json.loads((resources.files("sparrow") / "data" / "sparrow_schedules.json").read_text(encoding="utf-8"))
    page_size, bin_pages = data["page_size"], data["bin_pages"]
    kept = data["sink_pages"] + data["local_pages"]
    presets = {}
    for name, topk in data["topk_pages"].items():
        starts = page_bin_starts(bin_pages, page_size, len(topk))
        presets[name] = Schedule(name, starts, tuple(page_size * (v + kept) for v in topk))
    return presets


def __getattr__(name: str):
    """Lazy module attribute PRESETS: the JSON is read on first use, not at import."""
    if name == "PRESETS":
        return _load_presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DEFAULT_KEPT_PAGES = SparseConfig().always_kept_pages  # the default SparseConfig's sink + recent pages


def parse_schedule(spec: str, page_size: int = 16,
                   always_kept_pages: int = DEFAULT_KEPT_PAGES) -> Schedule:
    """Build and validate a schedule from a command-line or config string (forms listed in the error below); its
    budgets must hold `always_kept_pages` whole pages (by default the default SparseConfig's sink + recent)."""
    schedule = _parse(str(spec).strip(), page_size, always_kept_pages)
    schedule.validate(page_size, always_kept_pages)
    return schedule


def read_schedule_file(path: str | os.PathLike, page_size: int = 16,
                       always_kept_pages: int = DEFAULT_KEPT_PAGES,
                       previous: tuple[Schedule, int] | None = None) -> tuple[Schedule, int | None]:
    """A JSON schedule file (the forms `parse_schedule` reads from a file), checked by `check_schedule_file` as
    every reader's is, whatever its name looks like, and its top-level "version" (None when it has none; the
    run-time file a vLLM plugin follows carries one). `previous`: the (schedule, version) in force for a followed
    file, which a new version must not go back from."""
    return _read_file(Path(path), page_size, always_kept_pages, previous)


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
    presets = _load_presets()
    if spec in presets:
        if page_size != PRESET_PAGE_SIZE:
            raise SparrowError(f"preset {spec!r} is defined for page size {PRESET_PAGE_SIZE}, not {page_size}")
        return presets[spec]
    if spec.endswith(".json") or os.sep in spec or "/" in spec or Path(spec).is_file():
        return _read_file(Path(spec), page_size, always_kept_pages)[0]
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


def _read_file(path: Path, page_size: int, always_kept_pages: int,
               previous: tuple[Schedule, int] | None = None) -> tuple[Schedule, int | None]:
    """A JSON schedule file, read and passed through `check_schedule_file`."""
    where = f"schedule file {str(path)!r}"
    require_file(path, "schedule file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SparrowError(f"{where} is not valid JSON: {err}") from None
    return check_schedule_file(data, where, page_size, always_kept_pages, path.stem, previous)


def check_schedule_file(data, where: str, page_size: int, always_kept_pages: int, name: str = "schedule",
                        previous: tuple[Schedule, int] | None = None) -> tuple[Schedule, int | None]:
    """The one check of a schedule file's content (`data`: its parsed JSON; `where`: how to name the file), for
    every reader: a list of {"start", "kv_budget"} bins, or {"bins": [...], "name"?, "page_size"?, "version"?}
    with no other key; at least one bin (an empty list only under the name "dense", as `write_schedule_json` writes
    the dense schedule); the bins as `Schedule.validate` wants them (starts ascending from 0, whole-page budgets
    holding the always-kept pages, everything below MAX_TOKENS). `previous`: the (schedule, version) in force
    where the file is followed at run time; a version below it, or other bins under the same version, is refused.
    Returns the schedule and the file's version (None without one); `name` when the file gives none."""
    version = None
    if isinstance(data, dict):
        unknown = [key for key in data if key not in FILE_KEYS]
        if unknown:
            raise SparrowError(f"{where}: unknown key {unknown[0]!r}; expected only {', '.join(FILE_KEYS)}")
        if "bins" not in data:
            raise SparrowError(f"{where} has no 'bins' key; expected a list of "
                               '{"start", "kv_budget"} objects or an object with "bins"')
        if "page_size" in data and data["page_size"] != page_size:
            raise SparrowError(f"{where} is for page size {data['page_size']!r}, "
                               f"but page size {page_size} was requested")
        name, version = data.get("name", name), data.get("version")
        if not isinstance(name, str):
            raise SparrowError(f"{where}: name {name!r} is not a string")
        if version is not None and (type(version) is not int or not 0 <= version <= MAX_TOKENS):
            raise SparrowError(f"{where}: version {version!r} is not an integer >= 0")
        data = data["bins"]
    if isinstance(data, list):
        for i, item in enumerate(data):
            extra = [key for key in item if key not in BIN_KEYS] if isinstance(item, dict) else []
            if extra:
                raise SparrowError(f"{where}: bin {i} has unknown key {extra[0]!r}; expected only start and "
                                   "kv_budget")
        if not data and name != "dense":
            raise SparrowError(f"{where}: bins is empty; expected at least one {{\"start\", \"kv_budget\"}} bin "
                               "(a dense schedule is 'dense', or a file named \"dense\" with no bins)")
    schedule = Schedule.from_json(name, data, where)
    try:
        schedule.validate(page_size, always_kept_pages)
    except SparrowError as err:
        raise SparrowError(f"{where}: {err}") from None
    if previous is not None and version is not None:
        held, held_version = previous
        if version < held_version:
            raise SparrowError(f"{where}: version {version} is below version {held_version} in force; versions only "
                               "go up: write the next one")
        if version == held_version and (schedule.starts, schedule.budgets) != (held.starts, held.budgets):
            raise SparrowError(f"{where}: bins differ from those of version {held_version} in force under the same "
                               f"version; a change of bins takes a version above {held_version}")
    return schedule, version


def _parse_int(text: str, what: str, spec: str) -> int:
    """An integer from a spec fragment, or an error naming the fragment and the whole spec."""
    text = text.strip()
    if not _INT.fullmatch(text):
        raise SparrowError(f"{what} {text!r} in schedule {spec!r} is not an integer")
    return int(text)


def _as_int(value, what: str) -> int:
    """Accept integers only (also numpy/torch ones; not bools, floats or strings), so nothing silently rounds."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise SparrowError(f"{what} {value!r} is not an integer") from None


def write_schedule_json(schedule: Schedule, path: str | os.PathLike, page_size: int = 16, *,
                        version: int | None = None, always_kept_pages: int = DEFAULT_KEPT_PAGES,
                        restart: bool = False) -> Path:
    """The one writer of schedule files: `{"name", "page_size", "version"?, "bins"}`, replaced atomically so a
    reader (the vLLM plugin following the file) never sees half of it. Refused, as its reader would refuse it, when
    a budget is not whole pages or holds fewer than `always_kept_pages` pages. With a `version` (the run-time file
    a plugin follows), a version below the one the file holds is refused unless `restart`: a new run starting the
    file over."""
    if version is not None:
        if type(version) is not int or version < 0:
            raise SparrowError(f"schedule version {version!r} is not an integer >= 0")
        held = None if restart else _version_held(Path(path))
        if held is not None and version < held:
            raise SparrowError(f"schedule file {str(path)!r} holds version {held}; refusing to write version "
                               f"{version} over it: versions only go up (the plugin reports the version in force), "
                               "so write the next one, or pass restart=True to start the file over for a new run")
    schedule.validate(page_size, always_kept_pages)
    data = {"name": schedule.name, "page_size": page_size}
    if version is not None:
        data["version"] = version
    return atomic_write_json(path, {**data, "bins": schedule.to_json()})


def _version_held(path: Path) -> int | None:
    """The version a schedule file holds now; None when it has none or cannot be read (nothing to go back from)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if type(version) is int else None
