"""Optional compiled CPU kernel for one decode step of one layer (see csrc/sparse_decode.cpp): sparse, and dense
as the case where every page is kept (no page is scored then), which beats PyTorch's SDPA on the strided cache.
The same module holds `small_linear` (csrc/small_linear.cpp), the decode step's linear layers for a few rows
(packed_linear.py, fused_layers.py).

The PyTorch path scores pages, selects them, gathers the selected keys and values into new tensors and then
attends: a dozen small ops per layer, and the selected pages read twice and written once. The kernel does the
same in one call, reading the pages once in place; on a CPU that is most of the time of a sparse layer.
It is built on first use (a float32 CPU RolloutEngine loads it when made) with the C++ compiler torch uses (cached
by torch under ~/.cache/torch_extensions, compiled for this CPU with -march=native, under a name of its own per CPU
model and instruction set, so that machines sharing a home directory never load each other's build: AVX-512 code
dies on an AVX2-only CPU). Anything that stops it from building leaves the pure-PyTorch path in charge, with one
warning of one line saying why (sources missing from the installed package, no compiler, no ninja, a failed build).
SPARROW_CPU_KERNEL=0 turns it off (`switches.kernel`).

Torch guards a build with a `lock` file that its waiters poll forever, so a build killed midway would hang every
later run. Builds here also hold an OS lock (flock, released when its holder dies): whoever holds it and
still finds torch's `lock` knows the build that made it is dead, and starts over from an empty build directory.
Waiting for another process's build is bounded (`BUILD_WAIT_S`), after which this process uses the PyTorch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from . import switches

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("sparse_decode.cpp", "small_linear.cpp")]
_NAME = "sparrow_sparse_decode"
_GUARD = "sparrow-build.lock"
BUILD_WAIT_S = 300.0  # a build takes about 30 s; far longer means the builder is stuck
_module = None
_tried = False
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
LDFLAGS = ["-fopenmp", "-lmvec"]


def load():
    """The compiled module, or None when it is disabled or cannot be built here."""
    global _module, _tried
    if _tried or not switches.kernel():
        return _module
    _tried = True
    missing = cannot_build()
    if missing is not None:
        warnings.warn(f"sparrow: CPU sparse-decode kernel unavailable, using the PyTorch path ({missing})")
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as build

        name = build_name()
        build_dir = Path(_get_build_directory(name, verbose=False))
        with build_guard(build_dir, BUILD_WAIT_S) as free:
            if not free:
                raise TimeoutError(f"another process has held the build lock of {build_dir} for over "
                                   f"{BUILD_WAIT_S:g} s")
            if needs_build(build_dir):
                _say("building the CPU sparse-decode kernel (once per checkout and CPU, about 30 s)")
            _module = build(name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build_dir),
                            extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)
    except Exception as err:  # a failed build must not break generation
        reason = " ".join(str(err).split())
        reason = reason if len(reason) <= 300 else reason[:300] + " ..."
        warnings.warn(f"sparrow: CPU sparse-decode kernel unavailable, using the PyTorch path ({reason})")
        _module = None
    return _module


def cannot_build() -> str | None:
    """Why the kernel cannot be built here, in a few words (its sources missing from the installed package, no C++
    compiler, no ninja), or None when nothing is known to be missing."""
    from torch.utils.cpp_extension import is_ninja_available

    absent = [source.name for source in _SOURCES if not source.is_file()]
    if absent:
        return (f"the installed package lacks its kernel sources {', '.join(absent)} in {_SOURCES[0].parent}; "
                "reinstall sparrow-rl from a wheel or checkout that has them")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX to one)"
    if not is_ninja_available():
        return "ninja, which torch builds extensions with, is not installed (pip install ninja)"
    return None


def needs_build(build_dir: Path) -> bool:
    """Whether loading will compile: no library yet, or one built from sources at another path (another checkout
    of the repository), which torch rebuilds silently."""
    ninja = build_dir / "build.ninja"
    if not any(build_dir.glob("*.so")) or not ninja.is_file():
        return True
    return not all(str(source) in ninja.read_text(errors="replace") for source in _SOURCES)


def build_name(cpuinfo: str | None = None) -> str:
    """The build's name for this CPU: the kernel's name and a digest of the CPU's model and feature flags
    (`cpuinfo`: the text of /proc/cpuinfo; read here on Linux, elsewhere the platform's processor name)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86 and ARM spellings
    lines = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            lines.setdefault(key.strip(), " ".join(sorted(value.split())))  # the first CPU's
    described = "\n".join(f"{k}: {v}" for k, v in sorted(lines.items())) or cpuinfo
    return f"{_NAME}_{hashlib.sha256(described.encode()).hexdigest()[:12]}"


def _say(message: str) -> None:
    print(f"sparrow: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_guard(build_dir: Path, wait_s: float, log=_say) -> Iterator[bool]:
    """Hold the build lock of `build_dir` for the body; yields False instead if another process held it for
    `wait_s` seconds. With the lock held, a torch `lock` file left in `build_dir` is a killed build's: it and the
    build's partial outputs are removed (with a message) so that torch builds afresh instead of waiting forever."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / _GUARD, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                if not told:
                    pid = os.pread(fd, 32, 0).decode("ascii", "replace")
                    log(f"waiting for {f'pid {pid}' if pid else 'another process'} to finish building the CPU "
                        f"kernel in {build_dir} (at most {wait_s:g} s)")
                    told = True
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode("ascii"), 0)
        if (build_dir / "lock").exists():
            log(f"removing {build_dir / 'lock'} and the partial build of a kernel build that was killed; building "
                "again")
            for path in build_dir.iterdir():
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.name != _GUARD:
                    path.unlink()
        yield True
    finally:
        os.close(fd)  # releases the lock


def usable(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype == torch.float32 and switches.kernel() and load() is not None


def sparse_decode(queries, keys, values, landmarks, n_pages, budget_pages, total, sparse, scaling: float):
    """queries [B, Hkv, G, D]; keys/values [B, Hkv, P, page, D]; landmarks: the cache's tensors of a landmark the
    registry marks `compiled`, [B, Hkv, P, D] each, in its order ([centroid] or [kmin, kmax]: the kernel tells
    them apart by count) -> [B, Hkv, G, D]."""
    return _module.sparse_decode(queries, keys, values, landmarks, n_pages, budget_pages, total,
                                 sparse.sink_pages, sparse.recent_pages, float(scaling))


def span_decode(queries, keys, values, landmarks, n_pages, total, span: int, sparse, scaling: float):
    """Dense attention of `span` new tokens per row: queries [B, Hkv, G * span, D] (row g * span + s is token s of
    the span for query head g), the tokens' keys/values already the last `span` of each row's `total` -> the same
    shape. Token s attends to the row's first total - (span - 1 - s) tokens."""
    return _module.span_decode(queries, keys, values, landmarks, n_pages, n_pages, total, sparse.sink_pages,
                               sparse.recent_pages, float(scaling), int(span))


def paged_sparse_decode(queries, kv_cache, phys, landmarks, n_pages, budget_pages, total, sparse, scaling: float):
    """The same step over vLLM's CPU paged cache [blocks, Hkv, block, 2 D] (sparrow/vllm/cpu_attention.py):
    queries [R, Hkv, G, D]; phys [R, P] physical pages of each request's pages; landmarks per physical page
    [pages, Hkv, D] each -> [R, Hkv, G, D]."""
    return _module.paged_sparse_decode(queries, kv_cache, phys, landmarks, n_pages, budget_pages, total,
                                       sparse.page_size, sparse.sink_pages, sparse.recent_pages, float(scaling))


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias for small M, float32 on CPU; each output independent of M (see the source)."""
    return load().small_linear(x, weight, bias)
