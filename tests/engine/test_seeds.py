"""Per-sequence randomness (a sample depends on (seed, prompt key, sample index) only), the Gumbel-max sampler and
its counter-based noise, and non-finite logits stopping generation with a message naming the sequence and token."""

import copy

import numpy as np
import pytest
import torch

from sparrow.cpu import kernel as cpu_kernel
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine.sampling import UNIT_MAX, _unit, choose, gumbel_noise, hash32, sample, sequence_key
from sparrow.errors import SparrowError
from sparrow.schedules import DENSE, const
from tests.conftest import _tiny, random_prompts

SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
PROMPTS = random_prompts([70, 130, 45], seed=11)


@pytest.fixture(params=[("tiny-llama", "dense"), ("tiny-qwen2", "sparse-compiled"), ("tiny-qwen3", "sparse-pytorch"),
                        ("tiny-llama", "sparse-compiled")], ids=lambda p: "-".join(p))
def model_and_schedule(request, monkeypatch):
    """Each tiny architecture once, under dense decode or a 4-page budget (sink, two recent, one selected) through
    the compiled kernel or the pure-PyTorch sparse path."""
    name, path = request.param
    if path == "sparse-compiled" and cpu_kernel.load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    monkeypatch.setenv("SPARROW_CPU_KERNEL", "0" if path == "sparse-pytorch" else "1")
    return _tiny(name), DENSE if path == "dense" else const(64)


def _by_key(completions):
    return {(c.prompt_key, c.sample_index): c for c in completions}


def test_a_sample_is_the_same_whatever_the_batch_the_other_prompts_and_num_samples(model_and_schedule):
    (model, tok), schedule = model_and_schedule
    run = lambda batch, prompts, n, keys=None: _by_key(
        RolloutEngine(model, tok, max_batch_size=batch).generate(prompts, SAMPLED, schedule, n, prompt_keys=keys))
    base = run(64, PROMPTS, 2)
    variants = {
        "one row per wave": run(1, PROMPTS, 1),
        "one prompt per wave": run(2, PROMPTS, 2),
        "prompt 0 dropped, the others reordered, 4 samples": run(64, [PROMPTS[2], PROMPTS[1]], 4, [2, 1]),
        "a prompt added": run(64, [random_prompts([90], seed=12)[0]] + PROMPTS, 2, [9, 0, 1, 2]),
    }
    if not schedule.is_dense:  # the budget really bites: prompt 1 decodes sparsely from its first step
        assert base[(1, 0)].kv_budget == [130] + [64] * 15
    for name, run_ in variants.items():
        shared = set(run_) & set(base)
        assert len(shared) >= 3, name
        for key in shared:
            got, want = run_[key], base[key]
            assert got.token_ids == want.token_ids, (name, key)
            assert np.abs(np.subtract(got.logprobs, want.logprobs)).max() <= 1e-5, (name, key)
            assert got.prompt_token_ids == want.prompt_token_ids and got.kv_budget == want.kv_budget
    grown = variants["prompt 0 dropped, the others reordered, 4 samples"]
    assert [c.prompt_index for c in grown.values()] == [0] * 4 + [1] * 4  # the index stays the one in the call
    assert len({tuple(grown[(1, s)].token_ids) for s in range(4)}) == 4  # the samples of a prompt differ


def test_the_key_not_the_position_picks_the_stream_and_no_seed_stays_random(llama):
    engine = RolloutEngine(*llama)
    prompt = PROMPTS[:1]
    as_key = lambda key, sampling=SAMPLED: engine.generate(
        prompt, sampling, prompt_keys=[key])[0].token_ids
    assert as_key(0) == engine.generate(prompt, SAMPLED)[0].token_ids
    assert as_key(5) != as_key(0)
    assert engine.generate([PROMPTS[1], PROMPTS[0]], SAMPLED, prompt_keys=[1, 0])[1].token_ids == as_key(0)
    unseeded = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert as_key(0, unseeded) != as_key(0, unseeded)


def test_sequence_keys_depend_on_the_three_integers_only():
    assert sequence_key(7, 2, 1) == sequence_key(7, 2, 1)
    keys = {(s, k, i): sequence_key(s, k, i) for s, k, i in
            [(7, 2, 1), (7, 1, 2), (2, 7, 1), (7, 2, 0), (0, 0, 0), (2**40, 0, 0), (0, 2**32 - 1, 0)]}
    assert len(set(keys.values())) == len(keys)
    assert all(-2**31 <= w < 2**31 for key in keys.values() for w in key)  # int32 words
    with pytest.raises(SparrowError, match=r"prompt key must be in \[0, 2\*\*32\), got 4294967296"):
        sequence_key(0, 2**32, 0)


def _lowbias32(x: int) -> int:
    """The reference hash in plain Python integers (unsigned 32-bit)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_equals_the_reference_bit_for_bit():
    values = [0, 1, 123456789, 2**31 - 1, -1, -5, -2**31, 0x7FEB352D]
    got = hash32(torch.tensor(values, dtype=torch.int32)).tolist()
    assert [g & 0xFFFFFFFF for g in got] == [_lowbias32(v) for v in values]


def test_gumbel_noise_is_counter_based_and_gives_exact_draws():
    keys = torch.tensor([sequence_key(1, k, 0) for k in range(3)], dtype=torch.int32)
    noise = gumbel_noise(keys, torch.tensor([0, 5, 9]), 50)
    alone = gumbel_noise(keys[1:2], torch.tensor([5]), 50)
    assert torch.equal(noise[1:2], alone)  # a row's noise depends on its key and position only
    assert not torch.equal(noise[0], gumbel_noise(keys[:1], torch.tensor([1]), 50)[0])  # another position
    # a pinned value: the noise (so every seeded sample) is the same on any machine
    assert round(float(noise[0, 0]), 5) == round(float(-np.log(-np.log(((_lowbias32(
        _lowbias32(0) ^ int(_row_hash(keys[0], 0))) >> 8) + 0.5) * 2.0**-24))), 5)
    # Gumbel-max over 20000 independent positions draws each token with its probability
    n = 20000
    probs = torch.tensor([0.1, 0.6, 0.3, 0.0])
    many = gumbel_noise(keys[:1].expand(n, 2), torch.arange(n), 4)
    tokens = sample(probs.log().expand(n, -1), SamplingParams(), many).tokens
    freq = torch.bincount(tokens, minlength=4) / n
    assert torch.allclose(freq, probs, atol=0.015) and freq[3] == 0


def test_the_largest_random_word_gives_finite_noise_so_a_truncated_token_is_never_drawn():
    # bits whose top 24 are all ones: (2**24 - 0.5) / 2**24 rounds to 1.0 in float32, whose Gumbel noise was +inf;
    # on a token outside top-p (-inf) that made NaN, which argmax took (SmolLM2 drew such tokens in ~2% of steps)
    bits = torch.tensor([-1, -256, 0], dtype=torch.int32)
    u = _unit(bits)
    assert u.tolist() == [UNIT_MAX, UNIT_MAX, 2.0**-25]
    noise = -torch.log(-torch.log(u))
    assert torch.isfinite(noise).all() and float(noise.max()) < 16.7
    scaled = torch.tensor([[0.0, 5.0, -1.0]])
    params = SamplingParams(top_p=0.5)  # keeps token 1 alone
    assert choose(scaled, params, noise[None]).tolist() == [1]


def _row_hash(key: torch.Tensor, position: int) -> int:
    k0, k1 = (int(w) & 0xFFFFFFFF for w in key)
    return _lowbias32(k0 ^ _lowbias32((k1 + position * 0x9E3779B9) & 0xFFFFFFFF))


@pytest.mark.parametrize("keys, message", [
    ([0], "1 keys for 2 prompts"),
    ([3, 3], "prompt key 3 is given twice"),
    ([0, -1], "got -1"),
    ([0, 2**32], "got 4294967296"),
    ([0, 1.5], "got 1.5"),
    ([True, 2], "got True"),
])
def test_bad_prompt_keys_fail_clearly(llama, keys, message):
    with pytest.raises(SparrowError, match=message):
        RolloutEngine(*llama).generate(PROMPTS[:2], SAMPLED, prompt_keys=keys)


def test_sampling_draws_each_row_with_its_own_noise_after_truncation():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    params = SamplingParams(top_k=2, num_logprobs=3)
    noise = torch.tensor([[9.0, 0.0, 0.8], [0.0, 0.0, 9.0]])
    step = sample(logits, params, noise)
    # row 0: token 0 is outside the top 2, so its large noise is ignored; log 0.3 + 0.8 beats log 0.6
    assert step.tokens.tolist() == [2, 2]
    assert sample(logits, params, torch.zeros(2, 3)).tokens.tolist() == [1, 0]
    assert torch.allclose(step.logprobs.exp(), torch.tensor([0.3, 0.3]))
    alone = sample(logits[1:], params, noise[1:])
    assert alone.tokens.tolist() == [2] and torch.equal(alone.logprobs, step.logprobs[1:])
    assert step.finite.tolist() == [True, True]


def _broken(poison):
    """A private copy of tiny-llama with some weights replaced (the cached fixture must stay intact)."""
    model, tok = _tiny("tiny-llama")
    model = copy.deepcopy(model)
    with torch.no_grad():
        poison(model)
    return model, tok


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=8, temperature=0),
                                      SamplingParams(max_new_tokens=8, seed=0)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_stop_generation_naming_the_sequence(sampling, value):
    model, tok = _broken(lambda m: m.model.layers[2].mlp.down_proj.weight.fill_(value))
    with pytest.raises(SparrowError, match=r"the model's logits contain NaN \(before sampling\) at prompt 0 "
                                           r"\(key 7\), sample 0, generated token 1 \(position 30, logits of the "
                                           r"prefill\); 1 other sequence"):
        RolloutEngine(model, tok).generate(random_prompts([30, 40]), sampling, prompt_keys=[7, 8])


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
                                      SamplingParams(max_new_tokens=8, seed=0, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_logits_turning_infinite_mid_decode_name_the_row_and_the_token(llama, sampling):
    model, tok = llama
    calls = 0

    def poison(module, args, output):  # the 4th decode step's logits of the batch's last row become +inf
        nonlocal calls
        calls += 1
        if calls == 2 + 4:  # two prefills, then decode steps
            output[-1, :, 5] = float("inf")
        return output

    handle = model.lm_head.register_forward_hook(poison)
    try:
        want = (r"logits contain inf \(before sampling\) at prompt 1 \(key 1\), sample 2, generated token 5 "
                r"\(position 44, logits of decode step 4\); expected")
        with pytest.raises(SparrowError, match=want):
            RolloutEngine(model, tok).generate(random_prompts([30, 40]), sampling, const(48), num_samples=3)
    finally:
        handle.remove()


def test_a_temperature_too_small_for_the_logits_is_named(llama):
    with pytest.raises(SparrowError, match=r"temperature 1e-40 is too small: .* overflow float32"):
        RolloutEngine(*llama).generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=1e-40, seed=0))
