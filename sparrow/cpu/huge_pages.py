"""Transparent huge pages for KV caches on Linux CPUs.

A decode step reads every sequence's cache, page by page: GBs at long contexts, spread over memory. With 4 KiB
memory pages nearly every 4 KiB read of the cache needs a new TLB entry; with 2 MiB pages almost none does, and
both sparse and dense attention read faster (BENCHMARKS). Linux's usual setting ("madvise") gives huge pages only
to memory that asks for them:

- `zeros` allocates a tensor whose memory asks before it is first touched (our engine's cache);
- `collapse` turns the memory of a tensor someone else allocated and already touched (vLLM's cache) into huge
  pages in place, with MADV_COLLAPSE (Linux 6.1+).

Both are best effort: where the kernel refuses (another OS, THP "never", an old kernel) memory stays as it was.
SPARROW_HUGE_PAGES=0 (or false/no/off) turns both off (`switches.huge_pages`); a value not understood is refused.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import torch

from . import switches

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def enabled() -> bool:
    """Whether to ask for huge pages: on Linux unless SPARROW_HUGE_PAGES turns them off (a SparrowError naming a
    value that is not a yes or no)."""
    return switches.huge_pages() and _libc is not None


def _advise(start: int, end: int, advice: int) -> bool:
    """madvise over the whole huge pages inside [start, end); whether the kernel accepted it."""
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if not enabled() or last <= first:
        return False
    return _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice) == 0


def last_refusal() -> str:
    """Why the kernel refused the last advice (its errno's text: e.g. no free memory to make huge pages of)."""
    return os.strerror(ctypes.get_errno()) if _libc is not None else "not Linux"


def zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on Linux CPUs backed by transparent huge pages where the kernel allows it."""
    if not enabled() or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    raw = torch.empty(numel + HUGE_PAGE // itemsize, dtype=dtype)
    offset = (-raw.data_ptr()) % HUGE_PAGE // itemsize
    flat = raw[offset: offset + numel]
    _advise(flat.data_ptr(), flat.data_ptr() + numel * itemsize, _MADV_HUGEPAGE)
    return flat.zero_().view(shape)


def collapse(start: int, nbytes: int) -> bool:
    """Back the whole 2 MiB pages of CPU memory [start, start + nbytes) by huge pages now, keeping its contents;
    whether the kernel did. Copies the memory once: seconds per GiB, more where free memory must first be made into
    huge pages."""
    return _advise(start, start + nbytes, _MADV_HUGEPAGE) and _advise(start, start + nbytes, _MADV_COLLAPSE)
