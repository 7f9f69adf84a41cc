"""Rollout engine behaviour: sampling controls, stopping, shared prefills, records per token."""

import numpy as np
import pytest
import torch

from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine import sampling
from sparrow.engine.sampling import gumbel_noise, nucleus, sample
from sparrow.errors import SparrowError
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts


def test_same_seed_same_samples_and_other_seed_other_samples(llama):
    engine = RolloutEngine(*llama)
    prompts = random_prompts([30, 50], seed=1)
    run = lambda seed: engine.generate(prompts, SamplingParams(max_new_tokens=20, seed=seed, ignore_eos=True),
                                       const(48), num_samples=3)
    first, again, other = run(1), run(1), run(2)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_samples_of_one_prompt_share_the_prompt_but_differ(llama):
    engine = RolloutEngine(*llama)
    outs = engine.generate(random_prompts([40]), SamplingParams(max_new_tokens=16, seed=0, ignore_eos=True),
                           num_samples=4)
    assert [(c.prompt_index, c.sample_index) for c in outs] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert len({tuple(c.token_ids) for c in outs}) > 1
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in outs)


def test_more_rows_than_the_batch_limit_run_in_waves_with_the_same_result(llama):
    prompts = random_prompts([25, 35, 45], seed=2)
    sampling = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    wide = RolloutEngine(*llama, max_batch_size=64).generate(prompts, sampling, const(48), num_samples=2)
    narrow = RolloutEngine(*llama, max_batch_size=2).generate(prompts, sampling, const(48), num_samples=2)
    assert [c.token_ids for c in wide] == [c.token_ids for c in narrow]


def test_top_k_one_is_greedy_and_logprobs_are_before_truncation(llama):
    engine = RolloutEngine(*llama)
    prompts = random_prompts([33], seed=3)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=10, top_k=1, seed=5, ignore_eos=True))[0]
    assert greedy.token_ids == top1.token_ids
    assert all(lp < 0 for lp in top1.logprobs)  # the untruncated distribution, not the one-token one


def test_sampler_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 8000
    noise = gumbel_noise(torch.tensor([[3, 4]], dtype=torch.int32).expand(n, 2), torch.arange(n), 4)
    drawn = sample(logits.expand(n, -1), SamplingParams(top_p=0.7, seed=0), noise).tokens
    assert set(drawn.tolist()) == {0, 1}
    assert abs(float((drawn == 0).float().mean()) - 0.625) < 0.02  # the nucleus {0.5, 0.3} renormalized
    step = sample(logits, SamplingParams(num_logprobs=2), torch.zeros(1, 4))
    assert step.top_ids.tolist() == [[0, 1]]
    assert torch.allclose(step.top_logprobs.exp(), torch.tensor([[0.5, 0.3]]))


def _nucleus_by_sorting(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens the top-p nucleus keeps [B, V], the textbook way: float64, the whole row sorted."""
    ranked, order = logits.double().sort(dim=-1, descending=True)
    probs = ranked.softmax(-1)
    keep = probs.cumsum(-1) - probs <= top_p
    return torch.zeros_like(keep).scatter(-1, order, keep)


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_the_nucleus_is_the_same_whether_found_among_the_candidates_or_by_sorting(top_p, monkeypatch):
    # peaked rows end their nucleus within the 256 candidates; flat ones (scale 0.3 over 1000 tokens) past them
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * torch.tensor([8.0, 0.3, 8.0, 2.0, 0.3, 1.0])[:, None]
    kept = nucleus(logits, top_p)
    sizes = torch.isfinite(kept).sum(-1)
    assert (sizes < sampling.NUCLEUS_CANDIDATES).any() and (sizes > sampling.NUCLEUS_CANDIDATES).any()
    assert torch.equal(torch.isfinite(kept), _nucleus_by_sorting(logits, top_p))
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 1000)  # every row sorted: bit for bit the same
    assert torch.equal(nucleus(logits, top_p), kept)
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 1)  # every row past its candidates
    assert torch.equal(nucleus(logits, top_p), kept)


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=300),
                                    SamplingParams(top_k=5), SamplingParams()])
def test_noise_made_for_the_candidates_draws_the_tokens_of_the_whole_vocabularys_noise(params):
    # rows whose nucleus ends within the 256 candidates and rows sorted past them; tied logits in the first row
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 1000, generator=g) * torch.tensor([8.0, 0.3, 8.0, 2.0, 0.3, 1.0])[:, None]
    logits[0, :40] = logits[0].max()
    n = 300
    keys = torch.randint(-2**31, 2**31 - 1, (6, 2), dtype=torch.int32, generator=g)
    for position in range(n):
        lazy = sampling.GumbelNoise(keys, torch.full((6,), position), 1000)
        full = lazy.full()
        ids = torch.randint(0, 1000, (6, 7), generator=g)
        assert torch.equal(lazy.at(ids), full.gather(-1, ids))
        assert torch.equal(sampling.choose(logits, params, lazy), sampling.choose(logits, params, full))
    stacked = sampling.GumbelNoise.stack([sampling.GumbelNoise(keys[:2], torch.tensor([4, 9]) + j, 50)
                                          for j in range(3)])
    assert torch.equal(stacked.full().view(2, 3, 50),
                       torch.stack([gumbel_noise(keys[:2], torch.tensor([4, 9]) + j, 50) for j in range(3)], 1))


class _ZeroNoise(sampling.GumbelNoise):
    def full(self):
        return torch.zeros(len(self.keys), self.vocab)

    def at(self, ids):
        return torch.zeros(ids.shape)


def test_ties_inside_the_nucleus_go_to_the_lowest_token_id_as_the_vocabularys_argmax_does():
    logits = torch.zeros(1, 600)
    logits[0, [300, 7, 3]] = 50.0  # three tied tokens hold the whole nucleus, found among the candidates
    zero = _ZeroNoise(torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.long), 600)
    params = SamplingParams(top_p=0.5)
    assert sampling.choose(logits, params, zero).tolist() == [3]
    assert sampling.choose(logits, params, torch.zeros(1, 600)).tolist() == [3]


def test_top_p_after_top_k_renormalizes_over_the_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # over the top 2 (0.4, 0.3 -> 4/7, 3/7), top-p 0.5 keeps the first only; over all four it would keep two
    kept = sampling.truncate(logits, SamplingParams(top_k=2, top_p=0.5))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]
    assert torch.isfinite(sampling.truncate(logits, SamplingParams(top_p=0.5))).tolist() == [[True, True, False, False]]


def test_temperature_scales_the_reported_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    step = sample(logits, SamplingParams(temperature=0.5, num_logprobs=3), torch.zeros(1, 3))
    assert torch.allclose(step.top_logprobs, torch.log_softmax(logits / 0.5, -1).sort(descending=True).values)


def test_eos_stops_a_sequence_and_is_kept_as_its_last_token(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok)
    prompt = random_prompts([30], seed=4)
    free = engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))[0]
    engine.eos_ids = {free.token_ids[3]}
    stopped = engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))[0]
    first = free.token_ids.index(free.token_ids[3])
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_stop_strings_end_the_completion_and_are_cut_from_the_text(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok)
    prompt = random_prompts([30], seed=6)
    free = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = tok.decode(free.token_ids[5:7])
    out = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 7
    assert stop not in out.text and free.text.startswith(out.text)


def test_chat_prompts_use_the_chat_template(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok)
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.encode(messages)
    assert ids == engine.encode("hi", apply_chat_template=True)
    assert "<|im_start|>user" in tok.decode(ids, skip_special_tokens=False)


def test_a_final_assistant_message_is_continued_not_closed(llama):
    """As in TRL: a chat prompt ending with the assistant's message is the start of the answer."""
    model, tok = llama
    engine = RolloutEngine(model, tok)
    asked = [{"role": "user", "content": "hi"}]
    started = asked + [{"role": "assistant", "content": "1. "}]
    ids = engine.encode(started)
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(engine.encode(asked), skip_special_tokens=False) + "1. "
    assert "<|im_end|>" not in tok.decode(ids[len(engine.encode(asked)):], skip_special_tokens=False)
    out = engine.generate([started], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids

def test_too_long_a_request_and_bad_settings_fail_clearly(llama):
    engine = RolloutEngine(*llama)
    with pytest.raises(SparrowError, match="exceeds the model's 8192 positions"):
        engine.generate([[5] * 8000], SamplingParams(max_new_tokens=500))
    with pytest.raises(SparrowError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SparrowError, match="num_samples"):
        engine.generate(["x"], num_samples=0)
    with pytest.raises(SparrowError, match="not a positive multiple"):
        engine.generate(["x"], schedule=const(40))


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("inf"), "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ("temperature", -0.5, "temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    ("top_p", float("nan"), "top_p must be a number in (0, 1], got nan"),
    ("top_p", float("inf"), "top_p must be a number in (0, 1], got inf"),
    ("top_p", 0.0, "top_p must be a number in (0, 1], got 0.0"),
    ("top_k", float("inf"), "top_k must be an integer >= 0, got inf"),
    ("top_k", 2.5, "top_k must be an integer >= 0, got 2.5"),
    ("top_k", -1, "top_k must be an integer >= 0, got -1"),
    ("seed", -1, "seed must be an integer >= 0, got -1"),
    ("seed", 1.5, "seed must be an integer >= 0, got 1.5"),
    ("max_new_tokens", float("nan"), "max_new_tokens must be an integer >= 1, got nan"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("num_logprobs", -1, "num_logprobs must be an integer >= 0, got -1"),
])
def test_sampling_params_reject_values_naming_them_and_what_was_expected(field, value, message):
    with pytest.raises(SparrowError) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value) == message


def test_sampling_params_accept_numpy_integers_as_plain_ints():
    params = SamplingParams(seed=np.int64(2**40), top_k=np.int32(5), temperature=np.float32(0.5))
    assert type(params.seed) is int and params.seed == 2**40 and type(params.top_k) is int


def test_records_per_token_have_one_entry_per_generated_token(llama):
    engine = RolloutEngine(*llama)
    out = engine.generate(random_prompts([70]), SamplingParams(max_new_tokens=9, seed=0, num_logprobs=4,
                                                               ignore_eos=True), const(48))[0]
    assert len(out.logprobs) == len(out.kv_budget) == len(out.top_logprobs) == 9
    assert all(len(row) == 4 for row in out.top_token_ids)
    assert out.kv_budget == [70] + [48] * 8
    for lp, tops in zip(out.logprobs, out.top_logprobs):
        assert tops == sorted(tops, reverse=True) and lp <= tops[0] + 1e-6
    dense = engine.generate(random_prompts([70]), SamplingParams(max_new_tokens=3, seed=0), DENSE)[0]
    assert dense.kv_budget == [70, 71, 72][: len(dense.token_ids)]


def test_timing_says_where_a_generate_call_spent_its_time(llama):
    import time

    engine = RolloutEngine(*llama)
    sampling = SamplingParams(max_new_tokens=10, seed=0, ignore_eos=True)
    began = time.perf_counter()
    engine.generate(random_prompts([40, 60]), sampling, const(48), num_samples=2)
    wall = time.perf_counter() - began
    first = dict(engine.timing)
    assert set(first) == {"prefill", "decode", "verify", "sample"}
    assert first.pop("verify") == 0  # exact mode's phase
    assert all(v > 0 for v in first.values()) and sum(first.values()) <= wall
    engine.generate(random_prompts([40]), SamplingParams(max_new_tokens=2, seed=0, ignore_eos=True), num_samples=1)
    assert engine.timing["decode"] < first["decode"]  # each call starts from zero: 1 decode step against 9 x 4 rows


def test_rows_that_finish_early_leave_the_others_unchanged(llama):
    """Rows ending at different steps are compacted out of the cache in place (one row moved per finished row):
    every other row's tokens and log-probs equal those of the same seeded run in which no row stops."""
    model, tok = llama
    engine = RolloutEngine(model, tok)
    prompts = random_prompts([30, 55, 80], seed=5)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=3, ignore_eos=True), const(48),
                           num_samples=3)
    common = max({t for c in free for t in c.token_ids}, key=lambda t: sum(c.token_ids.count(t) for c in free))
    engine.eos_ids = {common}
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=3), const(48), num_samples=3)
    ends = []
    for a, b in zip(free, stopped, strict=True):
        end = a.token_ids.index(common) + 1 if common in a.token_ids else len(a.token_ids)
        ends.append(end)
        assert b.token_ids == a.token_ids[:end]
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs[:end]), atol=1e-4)
    assert len(set(ends)) >= 3  # rows really did finish at different steps


def test_compaction_order_keeps_rows_in_place_and_fills_holes_from_above():
    from sparrow.attention.kv_cache import compaction_order

    assert compaction_order([0, 1, 2]) == [0, 1, 2]
    assert compaction_order([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert compaction_order([4, 5]) == [4, 5]
    assert sorted(compaction_order([1, 3, 4, 6, 7])) == [1, 3, 4, 6, 7]


def test_a_cpu_engine_loads_the_kernel_when_made_so_a_first_build_stays_out_of_generate(llama, monkeypatch):
    from sparrow.cpu import kernel as cpu_kernel

    calls = []
    monkeypatch.setattr(cpu_kernel, "load", lambda: calls.append(1))
    model, tok = llama
    RolloutEngine(model, tok)
    assert calls == [1]
