"""Decode's linear layers: Sparrow's small_linear for decode-sized inputs (PyTorch's results to rounding, each row's
bits independent of the batch), oneDNN-packed weights for prefill, packs that never outlive a change of the
weights, and plain PyTorch where the README promises MKL's bits."""

import pytest
import torch

from sparrow.cpu import kernel as cpu_kernel
from sparrow.cpu import packed_linear
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not packed_linear.usable(), reason="oneDNN packing is not available here")
needs_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason="the compiled CPU kernel cannot be built here")


def _step_logits(engine, prompt, rows: int, packed: bool) -> torch.Tensor:
    cache = engine.new_cache(rows, len(prompt) + 1)
    if not packed:
        logits = engine.prefill(cache, prompt, torch.arange(rows)).expand(rows, -1)
        return engine.decode_step(cache, logits.argmax(-1), const(48))[0]
    with engine.cpu.linears.packed():
        logits = engine.prefill(cache, prompt, torch.arange(rows)).expand(rows, -1)
        unpacked = [m for m in engine.cpu.linears._layers if m not in engine.cpu.linears._packs]
        head = [engine.model.get_output_embeddings()] if cpu_kernel.load() is not None else []
        assert unpacked == head  # the prompt's rows ran packed; its one row of logits took small_linear
        return engine.decode_step(cache, logits.argmax(-1), const(48))[0]


def test_packed_decode_gives_the_plain_logits_to_rounding(tiny):
    engine = RolloutEngine(*tiny)
    prompt = random_prompts([90], seed=5)[0]
    plain, packed = _step_logits(engine, prompt, 4, False), _step_logits(engine, prompt, 4, True)
    assert (packed - plain).abs().max() < 1e-4
    assert not any("forward" in vars(m) for m in engine.model.modules())  # the layers' own forward is back


@needs_kernel
@pytest.mark.parametrize("rows, inner, outer", [(1, 64, 96), (5, 576, 1536), (8, 37, 11), (40, 128, 250),
                                                (64, 96, 7), (7, 64, 1)])
def test_small_linear_is_pytorchs_linear_and_gives_each_row_its_own_bits(rows, inner, outer):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, inner), torch.randn(outer, inner), torch.randn(outer)
    for b in (None, bias):
        got = cpu_kernel.small_linear(x, weight, b)
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert (got.double() - exact).abs().max() < 1e-6 * inner  # float32 rounding of an inner-length sum
        alone = torch.cat([cpu_kernel.small_linear(x[r:r + 1], weight, b) for r in range(rows)])
        assert torch.equal(got, alone)  # what a row gets does not depend on the other rows
        flipped = cpu_kernel.small_linear(x.flip(0), weight, b)
        assert torch.equal(flipped.flip(0), got)


@needs_kernel
def test_a_decode_step_gives_a_row_the_same_logits_alone_or_in_a_batch(tiny):
    engine = RolloutEngine(*tiny)
    prompt = random_prompts([90], seed=5)[0]
    batch, alone = _step_logits(engine, prompt, 4, True), _step_logits(engine, prompt, 1, True)
    assert torch.equal(batch[:1], alone)


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
    with engine.cpu.linears.packed():
        assert engine.cpu.linears._packs is None
    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setenv("SPARROW_PACKED_LINEAR", "0")
    assert not packed_linear.usable()
