"""The one place that knows how a LoRA adapter is switched off: the dense policy is the model without it."""

from __future__ import annotations

import contextlib


def has_adapter(model) -> bool:
    return hasattr(model, "disable_adapter")


def without_adapter(model) -> contextlib.AbstractContextManager:
    """peft's `disable_adapter()` for a model with a LoRA adapter, else a no-op context."""
    return model.disable_adapter() if has_adapter(model) else contextlib.nullcontext()
