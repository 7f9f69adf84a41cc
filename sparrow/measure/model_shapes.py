"""Model shapes for the cost model: published configs of the models it prices, by name, or a local config.json.

Nothing here loads weights or reaches the Hub: `sparrow cost` and `sparrow calibrate` price models that are not
on this machine.
"""

from __future__ import annotations

from pathlib import Path

from sparrow.errors import SparrowError

from .cost_model import ModelDims

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
    """The cost model's dimensions of a model name or directory."""
    return ModelDims.from_config(model_config(spec))
