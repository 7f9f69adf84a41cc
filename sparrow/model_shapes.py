"""A model's shapes without its weights (`ModelDims`: layers, heads, head size, parameters), from a Hugging Face
config: the published configs of the models Sparrow prices, by name, or a local config.json.

Nothing here loads weights or reaches the Hub: `sparrow cost` and `sparrow calibrate` price models that are not
on this machine, and the vLLM backend checks a model's head size and KV bytes before vLLM starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sparrow.errors import SparrowError

_CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelDims:
    """The shapes of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 style) that the cost depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config) -> ModelDims:
        """Read a Hugging Face config; params = embeddings + attention + gated MLP + norms (+ untied lm_head).

        Biases (always on q/k/v for Qwen2; `attention_bias` / `mlp_bias` elsewhere) and Qwen3's per-head q/k norms
        are counted too, so params equals the model's parameter count.
        """
        for name in _CONFIG_FIELDS:
            if getattr(config, name, None) is None:
                kind = type(config).__name__
                raise SparrowError(f"model config ({kind}) has no {name!r}; expected a Llama/Qwen2/Qwen3-style "
                                   f"config with {', '.join(_CONFIG_FIELDS)}")
        if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
            raise SparrowError(f"model config ({type(config).__name__}) is a mixture of experts; "
                               "the cost model covers dense models only")
        layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        intermediate, vocab = int(config.intermediate_size), int(config.vocab_size)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        model_type = getattr(config, "model_type", "")
        q, kv = heads * head_dim, kv_heads * head_dim
        attn = hidden * q + 2 * hidden * kv + q * hidden
        if model_type == "qwen2":
            attn += q + 2 * kv
        elif getattr(config, "attention_bias", False):
            attn += q + 2 * kv + hidden
        mlp = 3 * hidden * intermediate + (2 * intermediate + hidden if getattr(config, "mlp_bias", False) else 0)
        norms = 2 * hidden + (2 * head_dim if model_type == "qwen3" else 0)
        params = vocab * hidden * (1 if tied else 2) + layers * (attn + mlp + norms) + hidden
        return cls(layers, hidden, heads, kv_heads, int(head_dim), intermediate, vocab, params, tied)

    @property
    def kv_width(self) -> int:
        """D of SPEC 6: K (or V) elements cached per token over all layers = layers * kv_heads * head_dim."""
        return self.layers * self.kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> float:
        """r of SPEC 6: query heads per KV head."""
        return self.heads / self.kv_heads

    @property
    def step_params(self) -> int:
        """Parameters a decode step reads and multiplies by: all but an untied input embedding table.

        The input embedding is a gather of one row per token; with tied embeddings the same table is read whole
        as the lm_head, so it stays in.
        """
        return self.params - (0 if self.tied_embeddings else self.vocab * self.hidden)


SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
"""SmolLM2-135M(-Instruct)'s published config.json (HuggingFaceTB/SmolLM2-135M-Instruct)."""


def _qwen3(layers, hidden, heads, kv_heads, intermediate, tied):
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": 128, "intermediate_size": intermediate,
            "vocab_size": 151936, "tie_word_embeddings": tied}


QWEN3 = {
    "qwen3-1.7b": _qwen3(28, 2048, 16, 8, 6144, True),
    "qwen3-4b": _qwen3(36, 2560, 32, 8, 9728, True),
    "qwen3-8b": _qwen3(36, 4096, 32, 8, 12288, False),
    "qwen3-14b": _qwen3(40, 5120, 40, 8, 17408, False),
}
"""Shapes from the published config.json of Qwen/Qwen3-{1.7B,4B,8B,14B}."""


def model_config(spec: str):
    """A Hugging Face config for a model name or a local directory; never loads weights or reaches the Hub."""
    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    from sparrow.models import LOAD_ERRORS, TINY_MODELS, load_error_text, tiny_tokenizer

    if spec == "smollm2-135m":
        return LlamaConfig(**SMOLLM2_135M)
    if spec in QWEN3:
        return Qwen3Config(**QWEN3[spec])
    if spec in TINY_MODELS:
        tiny = TINY_MODELS[spec]
        return tiny.config_class(vocab_size=len(tiny_tokenizer()), **tiny.kwargs)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except LOAD_ERRORS as err:
            raise SparrowError(f"cannot read the config of model directory {str(path)!r}: "
                               f"{load_error_text(err)}") from None
    names = ", ".join(["smollm2-135m", *QWEN3, *TINY_MODELS])
    raise SparrowError(f"unknown model {spec!r}: expected one of {names} or a local directory with a config.json")


def model_dims(spec: str) -> ModelDims:
    """The cost model's dimensions of a model name or directory (whose config.json must give every shape field:
    transformers fills a missing one with its default Llama's, which would price another model)."""
    config = model_config(spec)
    path = Path(spec).expanduser() / "config.json"
    if path.is_file():
        try:
            given = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise SparrowError(f"cannot read {str(path)!r}: {err}") from None
        missing = [name for name in _CONFIG_FIELDS if name not in given and name != "num_key_value_heads"]
        if missing:  # (no num_key_value_heads: every head has its own, which the default says)
            raise SparrowError(f"{str(path)!r} has no {', '.join(map(repr, missing))}: the cost model would price "
                               "transformers' default sizes instead of this model's")
    return ModelDims.from_config(config)
