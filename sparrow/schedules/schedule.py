"""The schedule type: bins of cached length, each with a KV budget in tokens; the dense schedule, `const` and
`steps`; the published presets (read once from data/); the always-kept pages every budget must hold by default."""

from __future__ import annotations

import bisect
import functools
import json
import operator
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError

PRESET_PAGE_SIZE = 16

MAX_TOKENS = 2**53
"""Bin starts and budgets stay below this: exact as float64 (the cost model) and far inside int64 (the kernels)."""

DEFAULT_KEPT_PAGES = SparseConfig().always_kept_pages  # the default SparseConfig's sink + recent pages


@dataclass(frozen=True)
class Schedule:
    """Bin i covers cached lengths in [starts[i], starts[i+1]) and gets budgets[i] tokens; empty means dense."""

    name: str
    starts: tuple[int, ...]
    budgets: tuple[int, ...]

    def __post_init__(self):
        starts = tuple(as_int(s, f"schedule {self.name!r} start") for s in self.starts)
        budgets = tuple(as_int(b, f"schedule {self.name!r} budget") for b in self.budgets)
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
            starts.append(as_int(item["start"], f"{where} bin {i} start"))
            budgets.append(as_int(item["kv_budget"], f"{where} bin {i} kv_budget"))
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
    bin_size = as_int(bin_size, "steps bin size")
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
def load_presets() -> dict[str, Schedule]:
    """The release's published schedules, read once from the packaged JSON (see its "about" field)."""
    data = json.loads((resources.files("sparrow") / "data" / "sparrow_schedules.json").read_text(encoding="utf-8"))
    page_size, bin_pages = data["page_size"], data["bin_pages"]
    kept = data["sink_pages"] + data["local_pages"]
    presets = {}
    for name, topk in data["topk_pages"].items():
        starts = page_bin_starts(bin_pages, page_size, len(topk))
        presets[name] = Schedule(name, starts, tuple(page_size * (v + kept) for v in topk))
    return presets



def as_int(value, what: str) -> int:
    """Accept integers only (also numpy/torch ones; not bools, floats or strings), so nothing silently rounds."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise SparrowError(f"{what} {value!r} is not an integer") from None
