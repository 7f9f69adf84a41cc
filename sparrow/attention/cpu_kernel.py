"""Optional compiled CPU kernel for one sparse decode step of one layer (see csrc/sparse_decode.cpp).

The PyTorch path scores pages, selects them, gathers the selected keys and values into new tensors and then
attends: a dozen small ops per layer, and the selected pages read twice and written once. The kernel does the
same in one call, reading the pages once in place; on a CPU that is most of the time of a sparse layer.
It is built on first use with the C++ compiler torch uses (cached by torch under ~/.cache/torch_extensions,
compiled for this CPU with -march=native). Anything that stops it from building leaves the pure-PyTorch path
in charge, with one warning. SPARROW_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "sparse_decode.cpp"
_NAME = "sparrow_sparse_decode"
_module = None
_tried = False


def enabled() -> bool:
    return os.environ.get("SPARROW_CPU_KERNEL", "1") != "0"


def load():
    """The compiled module, or None when it is disabled or cannot be built here."""
    global _module, _tried
    if _tried or not enabled():
        return _module
    _tried = True
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as build

        if not any(Path(_get_build_directory(_NAME, verbose=False)).glob("*.so")):
            print("sparrow: building the CPU sparse-decode kernel (once, about 30 s)", file=sys.stderr)
        _module = build(name=_NAME, sources=[str(_SOURCE)],
                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
                        extra_ldflags=["-fopenmp", "-lmvec"], verbose=False)
    except Exception as err:  # a missing compiler or ninja must not break generation
        warnings.warn(f"sparrow: CPU sparse-decode kernel unavailable, using the PyTorch path ({err})")
        _module = None
    return _module


def usable(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype == torch.float32 and enabled() and load() is not None


def sparse_decode(queries, keys, values, landmarks, n_pages, budget_pages, total, sparse, scaling: float):
    """queries [B, Hkv, G, D]; keys/values [B, Hkv, P, page, D]; landmarks [B, Hkv, P, D] each -> [B, Hkv, G, D]."""
    return _module.sparse_decode(queries, keys, values, landmarks, n_pages, budget_pages, total,
                                 sparse.sink_pages, sparse.recent_pages, float(scaling))
