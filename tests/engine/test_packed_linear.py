"""Decode's linear layers with oneDNN-packed weights: the same logits to float rounding, packs that never outlive a
change of the weights, and plain PyTorch where the README promises MKL's bits."""

import pytest
import torch

from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine import packed_linear
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not packed_linear.usable(), reason="oneDNN packing is not available here")


def _step_logits(engine, prompt, rows: int, packed: bool) -> torch.Tensor:
    cache = engine.new_cache(rows, len(prompt) + 1)
    logits = engine.prefill(cache, prompt, torch.arange(rows)).expand(rows, -1)
    tokens = logits.argmax(-1)
    if not packed:
        return engine.decode_step(cache, tokens, const(48))[0]
    with engine.linears.packed():
        out = engine.decode_step(cache, tokens, const(48))[0]
        assert len(engine.linears._packs) == len(engine.linears._layers) > 0  # every layer ran packed
    return out


def test_packed_decode_gives_the_plain_logits_to_rounding(tiny):
    engine = RolloutEngine(*tiny)
    prompt = random_prompts([90], seed=5)[0]
    plain, packed = _step_logits(engine, prompt, 4, False), _step_logits(engine, prompt, 4, True)
    assert (packed - plain).abs().max() < 1e-4
    assert not any("forward" in vars(m) for m in engine.model.modules())  # the layers' own forward is back


def test_a_weight_changed_between_calls_is_used_even_without_a_version_bump(llama):
    model, tok = llama
    prompts = random_prompts([40, 70], seed=8)
    sampling = SamplingParams(max_new_tokens=16, temperature=0)
    engine = RolloutEngine(model, tok)
    before = engine.generate(prompts, sampling, DENSE, num_samples=2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data.copy_(torch.randn_like(module.weight) * 0.2)  # `.data`: no version bump
    after = engine.generate(prompts, sampling, DENSE, num_samples=2)
    fresh = RolloutEngine(model, tok).generate(prompts, sampling, DENSE, num_samples=2)
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_mkl_reproducible_mode_keeps_plain_pytorch(llama, monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2,STRICT")
    engine = RolloutEngine(*llama)
    with engine.linears.packed():
        assert engine.linears._packs is None
    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setenv("SPARROW_PACKED_LINEAR", "0")
    assert not packed_linear.usable()
