"""Shared fixtures: tiny random models (seconds to build) and helpers to pad sequences; and how the suite runs in
two pytest-xdist workers (one torch thread each, the slowest files first)."""

import functools

import pytest
import torch

from sparrow.models import load_model


# The slowest files (`--durations` on 2 cores), sent to the xdist workers first so that none is left running alone
# at the end; the others follow in collection order.
SLOWEST_FIRST = ["rollout/test_vllm.py", "rollout/test_ray.py", "rl/test_ray_train.py", "rollout/test_vllm_exact.py",
                 "rollout/test_vllm_schedule_file.py", "rollout/test_vllm_triton.py", "rl/test_trainer.py",
                 "rollout/test_vllm_copied_prefill.py", "integrations/test_trl_setup.py",
                 "integrations/test_trl_exact.py", "integrations/test_gather.py", "vllm/test_check_vllm_release.py",
                 "rl/test_distill.py", "test_docs.py", "rollout/test_vllm_wrapped.py",
                 "integrations/test_trl_weight_sync.py", "engine/test_determinism.py"]


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker beside another on two cores: one thread each
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    missing = [p for p in SLOWEST_FIRST if not (config.rootpath / "tests" / p).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: SLOWEST_FIRST names files that do not exist: {missing}")
    rank = {f"tests/{path}": i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@functools.cache
def _tiny(name):
    return load_model(name)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def tiny(request):
    """(model, tokenizer) for each tiny architecture; cached, so tests must not train it."""
    return _tiny(request.param)


@pytest.fixture
def llama():
    return _tiny("tiny-llama")


def pad_sequences(sequences: list[list[int]]) -> torch.Tensor:
    """Right-pad token lists with 0 into one [B, T] tensor."""
    width = max(len(s) for s in sequences)
    out = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq)
    return out


def random_prompts(lengths, vocab=250, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def save_tiny_for_vllm(path, architecture: str = "llama", tied: bool = False):
    """A tiny random Llama or Qwen3 with head size 32 (vLLM's CPU backend refuses our usual 16) and the byte-level
    chat tokenizer, saved as a Hugging Face directory at `path`; `tied`: the LM head is the token embedding (as in
    SmolLM2)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from sparrow.models import tiny_tokenizer

    tok = tiny_tokenizer()
    shape = {"vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "max_position_embeddings": 4096,
             "tie_word_embeddings": tied, "initializer_range": 0.1, "eos_token_id": tok.eos_token_id,
             "pad_token_id": tok.pad_token_id, "bos_token_id": None}
    config = (LlamaConfig if architecture == "llama" else Qwen3Config)(**shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
