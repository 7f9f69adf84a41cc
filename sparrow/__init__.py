"""Sparrow: sparse-attention rollouts for stable, efficient RL of language models.

The names below are loaded on first use, so that importing one layer (e.g. `sparrow.schedules`) does not import
the layers above it (the engine, torch's model code); tests/test_layers.py holds that.
"""

from importlib import import_module

_EXPORTS = {
    "DENSE": "sparrow.schedules",
    "Completion": "sparrow.engine",
    "RolloutEngine": "sparrow.engine",
    "SamplingParams": "sparrow.engine",
    "Schedule": "sparrow.schedules",
    "SparrowError": "sparrow.errors",
    "SparseConfig": "sparrow.attention",
    "load_model": "sparrow.models",
    "parse_schedule": "sparrow.schedules",
    "sparse_forward": "sparrow.attention.teacher_forced",
}

__all__ = ["DENSE", "Completion", "RolloutEngine", "SamplingParams", "Schedule", "SparrowError", "SparseConfig",
           "load_model", "parse_schedule", "sparse_forward"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparrow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
