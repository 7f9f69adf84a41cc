"""The rollout engine's decoder layers in a few ops for decode and verification steps (Llama, Qwen2, Qwen3 on CPU).

A decode step of a small model on a CPU spends a fifth of its time outside attention and the linear layers: the
transformers layer runs some sixty small ops (norms, rotary embedding, reshapes, residual adds), each a few
microseconds of dispatch on a handful of rows. Here a layer's query/key/value and gate/up projections are one
`small_linear` each (their weights concatenated), and the rest follows transformers' formulas op for op, so the
logits are the transformers layer's to the bit (tests/cpu/test_fused_layers.py). Figures: BENCHMARKS.md,
"Decode speed in our engine".

Fused within a scope (`FusedLayers.fused`, one `generate` call) in which the weights do not change, like the packs
of `packed_linear`: the concatenated weights are made on a layer's first step and dropped at the scope's end.
Layers with an adapter (peft's LoRA wraps the projections), other architectures, prefill and teacher-forced
forwards, and steps of more than `SMALL_ROWS` rows run transformers' own layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.attention.interface import CONTEXT_KEY, base_model, sparrow_attention

from . import kernel, packed_linear, switches
from .packed_linear import SMALL_ROWS

LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
SILU = ("SiLUActivation", "SiLU")
MODES = ("decode", "span")


def usable() -> bool:
    """Off with SPARROW_FUSED_LAYERS=0, and wherever the linear layers may not run packed (`packed_linear.usable`:
    the fused layers' projections are `small_linear`)."""
    return switches.fused_layers() and packed_linear.usable()


def _plain(*linears: nn.Module) -> bool:
    """Plain float32 CPU linear layers (not an adapter's wrapper), all with a bias or all without."""
    return (all(type(m) is nn.Linear and kernel.usable(m.weight) for m in linears)
            and len({m.bias is None for m in linears}) == 1)


def supported(layer: nn.Module) -> bool:
    """Whether `layer` is a decoder layer this module runs: a known class, RMSNorms, SiLU, plain linear layers."""
    if type(layer).__name__ not in LAYERS:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *filter(None, (getattr(attn, "q_norm", None),
                                                                                   getattr(attn, "k_norm", None)))]
    return (all(type(n).__name__ in NORMS for n in norms) and type(mlp.act_fn).__name__ in SILU
            and _plain(attn.q_proj, attn.k_proj, attn.v_proj) and _plain(attn.o_proj)
            and _plain(mlp.gate_proj, mlp.up_proj) and _plain(mlp.down_proj))


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (float32): the same ops in the same order, so the same bits."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [B, T, H, D] at cos/sin [B, T, D], as transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _concat(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    return weight, bias


class FusedLayer:
    """One decoder layer's forward for decode and span steps; every other call goes to the layer's own forward."""

    def __init__(self, layer: nn.Module, own_forward):
        self.layer, self.own_forward = layer, own_forward
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # made on the first fused step
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, hidden_states: torch.Tensor, *args, position_embeddings=None, **kwargs) -> torch.Tensor:
        ctx = kwargs.get(CONTEXT_KEY)
        rows = hidden_states.numel() // hidden_states.shape[-1]
        if (ctx is None or ctx.mode not in MODES or rows > SMALL_ROWS or position_embeddings is None or args
                or torch.is_grad_enabled()):
            return self.own_forward(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
        return self.forward(hidden_states, position_embeddings, ctx)

    def forward(self, hidden: torch.Tensor, position_embeddings, ctx) -> torch.Tensor:
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        if self.qkv is None:
            self.qkv = _concat(attn.q_proj, attn.k_proj, attn.v_proj)
            self.gate_up = _concat(mlp.gate_proj, mlp.up_proj)
        batch, tokens, width = hidden.shape
        dim = attn.head_dim
        q_width, kv_width = attn.q_proj.out_features, attn.k_proj.out_features

        x = rms_norm(layer.input_layernorm, hidden).view(-1, width)
        qkv = kernel.small_linear(x, *self.qkv).view(batch, tokens, -1, dim)
        heads, cos, sin = q_width // dim, *position_embeddings
        value = qkv[:, :, (q_width + kv_width) // dim:]
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's query and key before the rotation
            query = rotate(rms_norm(attn.q_norm, qkv[:, :, :heads]), cos, sin)
            key = rotate(rms_norm(attn.k_norm, qkv[:, :, heads:(q_width + kv_width) // dim]), cos, sin)
        else:  # one rotation for the query and key heads together (elementwise: the same bits)
            query_key = rotate(qkv[:, :, :(q_width + kv_width) // dim], cos, sin)
            query, key = query_key[:, :, :heads], query_key[:, :, heads:]
        out, _ = sparrow_attention(attn, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None,
                                   scaling=attn.scaling, **{CONTEXT_KEY: ctx})
        out = kernel.small_linear(out.reshape(batch * tokens, -1), attn.o_proj.weight.detach(), attn.o_proj.bias)
        hidden = hidden + out.view(batch, tokens, width)

        x = rms_norm(layer.post_attention_layernorm, hidden).view(-1, width)
        gate, up = kernel.small_linear(x, *self.gate_up).chunk(2, dim=-1)
        down = mlp.down_proj
        out = kernel.small_linear(F.silu(gate) * up, down.weight.detach(), down.bias)
        return hidden + out.view(batch, tokens, width)


class FusedLayers:
    """The supported decoder layers of a model, run by `FusedLayer` while a `fused()` scope is open."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._layers: list[nn.Module] | None = None  # None: no scope open

    @contextlib.contextmanager
    def fused(self) -> Iterator[None]:
        """A scope in which the model's weights do not change and its supported decoder layers run fused (nested
        scopes share the outer one); each layer's own forward is back at its end."""
        if self._layers is not None or not usable():  # `supported` asks for the kernel only for CPU weights
            yield
            return
        layers = getattr(getattr(base_model(self.model), "model", None), "layers", [])
        self._layers = [layer for layer in layers if supported(layer)]
        for layer in self._layers:
            layer.forward = FusedLayer(layer, layer.forward)
        try:
            yield
        finally:
            for layer in self._layers:
                del layer.forward
            self._layers = None
