"""Fused decoder layers: the transformers layers' logits to the bit in decode and span steps, on the three tiny
architectures; adapters, prefill and large steps run the layers' own forward."""

import copy

import pytest
import torch

from sparrow.cpu import fused_layers
from sparrow.cpu import kernel as cpu_kernel
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.lora import LoraSpec, attach_adapter
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not fused_layers.usable() or cpu_kernel.load() is None,
                                reason="the compiled CPU kernel or packed linear layers are not available here")


def _steps(engine, fused: bool, monkeypatch) -> list[torch.Tensor]:
    """Logits of a prefill, two sparse decode steps (budgets below the length) and a span of 3 tokens, 4 rows."""
    monkeypatch.setenv("SPARROW_FUSED_LAYERS", "1" if fused else "0")
    prompt = random_prompts([75], seed=3)[0]
    with engine.frozen_weights():
        cache = engine.new_cache(4, len(prompt) + 8)
        out = [engine.prefill(cache, prompt, torch.arange(4)).expand(4, -1)]
        for _ in range(2):
            out.append(engine.decode_step(cache, out[-1].argmax(-1), const(48))[0])
        span = torch.stack([out[-1].argmax(-1), out[-2].argmax(-1), out[0].argmax(-1)], dim=1)
        out.append(engine.span_step(cache, span))
        assert bool(engine.cpu.layers._layers) == fused  # while the scope is open
    return out


def test_fused_layers_give_the_transformers_layers_logits_to_the_bit(tiny, monkeypatch):
    engine = RolloutEngine(*tiny)
    calls = []
    forward = fused_layers.FusedLayer.forward
    monkeypatch.setattr(fused_layers.FusedLayer, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    fused = _steps(engine, True, monkeypatch)
    layers = engine.model.config.num_hidden_layers
    assert len(calls) == 3 * layers  # two decode steps and the span ran fused; the prefill did not
    own = _steps(engine, False, monkeypatch)
    for got, want in zip(fused, own, strict=True):
        assert torch.equal(got, want)
    assert not any("forward" in vars(m) for m in engine.model.modules())  # the layers' own forward is back


def test_generation_is_the_same_with_and_without_fused_layers(llama, monkeypatch):
    engine = RolloutEngine(*llama, max_batch_size=6)
    prompts = random_prompts([40, 90, 61], seed=4)
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, seed=2, ignore_eos=True)
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("SPARROW_FUSED_LAYERS", flag)
        runs.append([(c.token_ids, c.logprobs) for c in engine.generate(prompts, sampling, const(48), num_samples=2)])
        runs.append([c.token_ids for c in engine.generate(prompts, sampling, const(48), num_samples=2,
                                                         draft_tokens=3)])
    assert runs[0] == runs[2] and runs[1] == runs[3]


def test_layers_with_an_adapter_or_of_other_kinds_run_their_own_forward(llama):
    model, tok = llama
    assert all(fused_layers.supported(layer) for layer in model.model.layers)
    adapted = attach_adapter(copy.deepcopy(model), LoraSpec(rank=4, alpha=16.0)).eval()
    engine = RolloutEngine(adapted, tok)
    assert not any(fused_layers.supported(layer) for layer in adapted.get_base_model().model.layers)
    with engine.frozen_weights():
        assert engine.cpu.layers._layers == []
    other = copy.deepcopy(model.model.layers[0])
    other.mlp.act_fn = torch.nn.GELU()
    assert not fused_layers.supported(other)


def test_a_span_of_more_rows_than_small_linear_takes_runs_the_layers_own_forward(llama, monkeypatch):
    engine = RolloutEngine(*llama)
    monkeypatch.setattr(fused_layers, "SMALL_ROWS", 8)
    prompt = random_prompts([40], seed=1)[0]
    with engine.frozen_weights():
        cache = engine.new_cache(3, 60)
        engine.prefill(cache, prompt, torch.arange(3))
        calls, forward = [], fused_layers.FusedLayer.forward
        monkeypatch.setattr(fused_layers.FusedLayer, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
        engine.span_step(cache, torch.ones(3, 3, dtype=torch.long))  # 9 rows: the layers' own forward
        assert calls == []
        engine.decode_step(cache, torch.ones(3, dtype=torch.long), DENSE)
        assert calls  # 3 rows: fused
