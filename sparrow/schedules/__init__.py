"""KV-budget schedules: step functions from a sequence's total cached length to its KV budget in tokens.

The cached length counts prompt plus generated tokens, including the token being decoded. A schedule raises the
budget as the sequence grows so the tail acceptance rate stays roughly constant (SPEC section 4). Budgets include
the always-kept pages (`SparseConfig.always_kept_pages`: 1 sink page + 2 most recent pages by default), so
top-k pages = budget / page_size - always-kept pages.

User schedules (`const:`, `steps:`, explicit pairs, files) give their bin starts in tokens. The published presets
are keyed by page count as the release's planner keys them (`page_bin_starts`): bin i starts at cached length
2000 i - 15, not 2000 i.

The package: the type, `const`, `steps` and the presets (schedule.py), parsing (parse.py), schedule files
(files.py); a schedule file at run time, written under versions, followed and reported (runtime.py); the
controllers that pick each training step's schedule (controllers.py: fixed, adaptive on adaptive.py's state and
rule, DistillSparse's switch). The last three are imported by name (`sparrow.schedules.runtime`, ...), so that
importing the package (as the vLLM plugin does in every engine process) loads no more than it needs.
"""

from __future__ import annotations

from .files import BIN_KEYS, FILE_KEYS, check_schedule_file, read_schedule_file, write_schedule_json
from .parse import parse_schedule, split_schedules
from .schedule import (DEFAULT_KEPT_PAGES, DENSE, MAX_TOKENS, PRESET_PAGE_SIZE, Schedule, const, load_presets,
                       page_bin_starts, steps)

__all__ = ["BIN_KEYS", "DEFAULT_KEPT_PAGES", "DENSE", "FILE_KEYS", "MAX_TOKENS", "PRESET_PAGE_SIZE", "Schedule",
           "check_schedule_file", "const", "page_bin_starts", "parse_schedule", "read_schedule_file",
           "split_schedules", "steps", "write_schedule_json"]


def __getattr__(name: str):
    """Lazy module attribute PRESETS: the JSON is read on first use, not at import."""
    if name == "PRESETS":
        return load_presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
