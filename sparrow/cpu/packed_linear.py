"""The rollout engine's linear layers on CPU (float32): Sparrow's kernel for decode-sized inputs, oneDNN's
prepacked weights for the rest.

A decode step multiplies a few rows by each weight: memory-bound work, yet PyTorch's default path (MKL's sgemm)
repacks a large weight on every call, so a small-batch step reads the weights far below the memory's bandwidth.
Up to `SMALL_ROWS` rows (decode steps, and exact mode's verifications of that many rows) the compiled
`small_linear` streams each weight once from memory for all rows, and gives every row the same bits whatever the
other rows (a verification and a one-token step then agree in these layers). Larger
inputs (prefill) take oneDNN's prepacked weights (the path torch.compile's CPU freezing takes), read as they are.
Figures: BENCHMARKS.md, "Decode speed in our engine".

Packs are valid within a scope (`PackedLinears.packed`, one `generate` call) in which the weights do not change;
they are made on first use and dropped at its end, so a training step's update is never missed (no version
counter to trust: `param.data.copy_` does not bump it). Off under MKL's reproducible mode (`MKL_CBWR` set: oneDNN
does not follow it, and the README promises bits across thread counts there) and with SPARROW_PACKED_LINEAR=0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from . import kernel, switches

SMALL_ROWS = 64  # inputs of at most this many rows take small_linear


def usable() -> bool:
    """Whether this process may pack: oneDNN present, not turned off, MKL's reproducible mode not asked for."""
    return (switches.packed_linear() and "MKL_CBWR" not in os.environ
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and weight is not None and weight.device.type == "cpu"
            and weight.dtype == torch.float32)


class PackedLinears:
    """The float32 CPU `nn.Linear` layers of a model (peft's base layers and adapter matrices included), run with
    prepacked weights while a `packed()` scope is open (the engine opens one per `generate` call)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._packs: dict[nn.Linear, torch.Tensor] | None = None  # None: no scope open
        self._layers: list[nn.Linear] = []

    @contextlib.contextmanager
    def packed(self) -> Iterator[None]:
        """A scope in which the model's weights do not change and its linear layers run packed (nested scopes share
        the outer one's packs); each layer's own forward is back at its end."""
        if self._packs is not None or not usable():
            yield
            return
        self._packs, self._layers = {}, [m for m in self.model.modules() if _packable(m)]
        for layer in self._layers:
            layer.forward = self._forward_of(layer)
        try:
            yield
        finally:
            for layer in self._layers:
                del layer.forward
            self._packs, self._layers = None, []

    def _forward_of(self, layer: nn.Linear):
        small = kernel.usable(layer.weight) and layer.weight.is_contiguous()

        def forward(x: torch.Tensor) -> torch.Tensor:
            if small and x.numel() <= SMALL_ROWS * x.shape[-1]:
                out = kernel.small_linear(x.reshape(-1, x.shape[-1]), layer.weight.detach(), layer.bias)
                return out.view(*x.shape[:-1], -1)
            pack = self._packs.get(layer)
            if pack is None:
                rows = x.numel() // x.shape[-1]
                pack = self._packs[layer] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows)
            return torch.ops.mkldnn._linear_pointwise(x, pack, layer.bias, "none", [], "")
        return forward
