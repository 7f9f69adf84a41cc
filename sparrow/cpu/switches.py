"""The environment switches of the CPU speed paths, each on unless its variable says 0 (or false/no/off); a value
not understood is a SparrowError naming it. The command line reads them all before any model loads
(`check_all`)."""

from __future__ import annotations

from sparrow.io import env_flag

KERNEL = "SPARROW_CPU_KERNEL"
PACKED_LINEAR = "SPARROW_PACKED_LINEAR"
FUSED_LAYERS = "SPARROW_FUSED_LAYERS"
HUGE_PAGES = "SPARROW_HUGE_PAGES"


def kernel() -> bool:
    """The compiled CPU kernel (attention and `small_linear`)."""
    return env_flag(KERNEL, True, "the compiled CPU decode kernel")


def packed_linear() -> bool:
    """The engine's linear layers through `small_linear` and oneDNN packs."""
    return env_flag(PACKED_LINEAR, True, "oneDNN-packed linear weights")


def fused_layers() -> bool:
    """The engine's fused decoder layers."""
    return env_flag(FUSED_LAYERS, True, "the fused decoder layers")


def huge_pages() -> bool:
    """Huge pages for KV caches."""
    return env_flag(HUGE_PAGES, True, "huge pages for KV caches")


def check_all() -> None:
    """Read every switch, so that a value not understood is refused by name."""
    huge_pages()
    kernel()
    packed_linear()
    fused_layers()
