"""What the rollout engine holds of the CPU backend: the compiled kernel loaded when an engine is made (so that a
first build, ~30 s, happens there and not inside a generate call), and the scope of a call in which the model's
linear layers run packed (`packed_linear`) and its decoder layers fused (`fused_layers`). On other devices and
dtypes each of them leaves the model as it is."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from . import kernel
from .fused_layers import FusedLayers
from .packed_linear import PackedLinears


class CpuBackend:
    """The CPU speed paths of one engine's model."""

    def __init__(self, model: nn.Module):
        self.linears = PackedLinears(model)  # linear layers with packed weights for the span of a generate call
        self.layers = FusedLayers(model)  # decoder layers in a few ops for decode steps, the same span
        kernel.usable(next(model.parameters()))  # loads the kernel where it applies

    @contextlib.contextmanager
    def frozen_weights(self) -> Iterator[None]:
        """A scope in which the model's weights do not change: its linear layers run packed and its decoder layers
        fused, from copies made on first use and dropped at the end."""
        with self.linears.packed(), self.layers.fused():
            yield
