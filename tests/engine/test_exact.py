"""Exact rollouts: the sparse actor drafts, the dense policy verifies, and the tokens are dense sampling's own."""

import copy

import numpy as np
import pytest
import torch

from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine.exact import exact_summary
from sparrow.errors import SparrowError
from sparrow.lora import LoraSpec, adapter_parameters, attach_adapter, without_adapter
from sparrow.metrics import acceptance_rate
from sparrow.schedules import DENSE, const
from tests.conftest import _tiny, random_prompts

SCHEDULE = const(48)  # sink + two recent pages: layers 2-3 of the tiny models attend 3 pages, so drafts often miss
PROMPTS = random_prompts([70, 130, 45, 200, 96], seed=11)
SAMPLED = SamplingParams(max_new_tokens=37, temperature=1.0, seed=5, ignore_eos=True)


def _same(exact, dense, tol=2e-5):
    assert [c.token_ids for c in exact] == [c.token_ids for c in dense]
    worst = max(np.abs(np.subtract(e.logprobs, d.logprobs)).max() for e, d in zip(exact, dense))
    assert worst <= tol
    assert [c.finish_reason for c in exact] == [c.finish_reason for c in dense]


@pytest.mark.parametrize("draft_tokens", [1, 4, 8])
def test_exact_tokens_equal_dense_sampling_for_the_same_seed(tiny, draft_tokens):
    model, tok = tiny
    engine = RolloutEngine(model, tok, max_batch_size=10)
    dense = engine.generate(PROMPTS, SAMPLED, DENSE, num_samples=2)
    sparse = engine.generate(PROMPTS, SAMPLED, SCHEDULE, num_samples=2)
    assert [c.token_ids for c in sparse] != [c.token_ids for c in dense]  # the schedule alone changes tokens
    exact = engine.generate(PROMPTS, SAMPLED, SCHEDULE, num_samples=2, draft_tokens=draft_tokens)
    _same(exact, dense)
    summary = exact_summary(exact)
    assert 1 < summary["tokens_per_verify"] <= draft_tokens + 1 and 0 < summary["drafted_share"] < 1
    for c in exact:
        assert len(c.drafted) == len(c.draft_acceptance) == len(c.token_ids) == len(c.kv_budget)
        assert c.kv_budget == list(range(len(c.prompt_token_ids), len(c.prompt_token_ids) + len(c.token_ids)))
        alphas = [a for a in c.draft_acceptance if a is not None]
        assert alphas and all(0 < a <= 1 + 1e-6 for a in alphas)


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_exact_tokens_do_not_depend_on_the_batch(llama, batch):
    model, tok = llama
    sampling = SamplingParams(max_new_tokens=23, temperature=0.8, top_k=40, top_p=0.9, seed=2, ignore_eos=True)
    dense = RolloutEngine(model, tok, max_batch_size=64).generate(PROMPTS, sampling, DENSE, num_samples=2)
    exact = RolloutEngine(model, tok, max_batch_size=batch).generate(PROMPTS, sampling, SCHEDULE, num_samples=2,
                                                                     draft_tokens=4)
    _same(exact, dense)


def test_sequences_that_stop_mid_draft_stop_where_dense_sampling_stops(llama):
    """EOS and stop strings end sequences at different rounds, in the middle of accepted drafts."""
    model, tok = llama
    engine = RolloutEngine(model, tok, max_batch_size=8)
    free = engine.generate(PROMPTS, SAMPLED, DENSE)
    engine.eos_ids = {free[0].token_ids[9], free[2].token_ids[14]}
    sampling = SamplingParams(max_new_tokens=37, temperature=1.0, seed=5, stop=(tok.decode(free[1].token_ids[5:7]),))
    dense = engine.generate(PROMPTS, sampling, DENSE, num_samples=2)
    assert {c.finish_reason for c in dense} == {"stop", "length"}
    assert len({len(c.token_ids) for c in dense}) >= 4
    for k in (3, 8):
        exact = engine.generate(PROMPTS, sampling, SCHEDULE, num_samples=2, draft_tokens=k)
        _same(exact, dense)
        assert [c.text for c in exact] == [c.text for c in dense]


def test_greedy_exact_equals_greedy_dense(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    _same(engine.generate(PROMPTS, greedy, SCHEDULE, draft_tokens=5), engine.generate(PROMPTS, greedy, DENSE))


def test_a_distill_adapter_drafts_but_the_dense_policy_without_it_decides():
    model, tok = _tiny("tiny-qwen3")
    model = attach_adapter(copy.deepcopy(model), LoraSpec(rank=4, alpha=16.0)).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    engine = RolloutEngine(model, tok)
    with without_adapter(model):
        dense = engine.generate(PROMPTS, SAMPLED, DENSE)
    with_adapter = engine.generate(PROMPTS, SAMPLED, DENSE)
    assert [c.token_ids for c in with_adapter] != [c.token_ids for c in dense]  # the adapter changes the actor
    exact = engine.generate(PROMPTS, SAMPLED, SCHEDULE, draft_tokens=4)
    _same(exact, dense)


def test_the_check_fails_if_verification_is_skipped_or_the_drafts_keys_are_kept(llama, monkeypatch):
    """Mutations of exact mode that the equality with dense sampling must catch."""
    model, tok = llama
    engine = RolloutEngine(model, tok)
    dense = engine.generate(PROMPTS, SAMPLED, DENSE)
    from sparrow.attention.kv_cache import KVCache

    write = KVCache.write_span

    def keep_draft_keys(self, layer, key, value, step):  # write only the span's last token (the drafts' K/V stay)
        saved = [t.clone() for t in (self.keys[layer], self.values[layer])]
        write(self, layer, key, value, step)
        last = self.lengths + key.shape[2] - 1
        for fresh, old in zip((self.keys[layer], self.values[layer]), saved):
            flat, flat_old = fresh.view(self.rows, key.shape[1], self.capacity, -1), old.view_as(
                fresh.view(self.rows, key.shape[1], self.capacity, -1))
            for r in range(self.rows):
                flat[r, :, self.lengths[r]:last[r]] = flat_old[r, :, self.lengths[r]:last[r]]

    with monkeypatch.context() as patch:
        patch.setattr(KVCache, "write_span", keep_draft_keys)
        kept = engine.generate(PROMPTS, SAMPLED, SCHEDULE, draft_tokens=4)
    assert max(np.abs(np.subtract(k.logprobs, d.logprobs)).max() for k, d in zip(kept, dense)) > 1e-3

    def sparse_verifier(self, cache, tokens):  # "verify" with the sparse actor: no dense check at all
        out = []
        for j in range(tokens.shape[1]):
            logits, _ = self.decode_step(cache, tokens[:, j], SCHEDULE)
            out.append(logits)
        return torch.stack(out, 1)

    with monkeypatch.context() as patch:
        patch.setattr(RolloutEngine, "span_step", sparse_verifier)
        unverified = engine.generate(PROMPTS, SAMPLED, SCHEDULE, draft_tokens=4)
    assert [c.token_ids for c in unverified] != [c.token_ids for c in dense]


def _span_and_steps(engine, prompts, length):
    """Two caches prefilled with `prompts`; `length` random tokens fed to one as one-token dense steps and to the
    other as one span step. Returns (stepped cache, spanned cache, the steps' logits, the span's logits)."""
    span = torch.randint(3, 250, (len(prompts), length), generator=torch.Generator().manual_seed(1))
    caches = [engine.new_cache(len(prompts), 100) for _ in range(2)]
    for cache in caches:
        for row, prompt in enumerate(prompts):
            engine.prefill(cache, prompt, torch.tensor([row]))
    one = torch.stack([engine.decode_step(caches[0], span[:, j], DENSE)[0] for j in range(length)], 1)
    return caches[0], caches[1], one, engine.span_step(caches[1], span)


def test_a_dense_span_step_equals_one_token_steps(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    stepped, spanned, one, many = _span_and_steps(engine, random_prompts([45, 78, 31], seed=3), 7)
    assert (many - one).abs().max() < 1e-4
    assert torch.equal(stepped.lengths, spanned.lengths)
    for layer in range(engine.num_layers):  # same keys, values and page landmarks (pages 2 and 4 fill in the span)
        assert (stepped.keys[layer] - spanned.keys[layer]).abs().max() < 1e-5
        assert (stepped.values[layer] - spanned.values[layer]).abs().max() < 1e-5
        for a, b in zip(stepped.landmarks[layer], spanned.landmarks[layer]):
            assert (a - b).abs().max() < 1e-5


def test_the_free_monitor_equals_a_token_by_token_reference(llama):
    """Exact mode's recorded alpha of a drafted token is the acceptance of the sparse actor's next-token
    distribution on the dense policy's cache of the same prefix; the reference recomputes each one from a fresh
    dense prefill of the prefix, one sparse and one dense step."""
    model, tok = llama
    engine = RolloutEngine(model, tok)
    exact = engine.generate(PROMPTS[:3], SAMPLED, SCHEDULE, draft_tokens=1)
    checked = 0
    for c in exact:
        for n, alpha in enumerate(c.draft_acceptance):
            if alpha is None:
                continue
            prefix = c.prompt_token_ids + c.token_ids[: n - 1]
            caches = [engine.new_cache(1, len(prefix) + 1) for _ in range(2)]
            for cache in caches:
                engine.prefill(cache, prefix, torch.tensor([0]))
            fed = torch.tensor([c.token_ids[n - 1]])
            actor, _ = engine.decode_step(caches[0], fed, SCHEDULE)
            dense, _ = engine.decode_step(caches[1], fed, DENSE)
            assert abs(float(acceptance_rate(actor, dense)[0]) - alpha) < 1e-4, (c.prompt_index, n)
            checked += 1
    assert checked >= 30


@pytest.mark.parametrize("value", [-1, 65, 2.0, True, "4"])
def test_bad_draft_tokens_fail_clearly(llama, value):
    with pytest.raises(SparrowError, match=r"draft_tokens must be an integer in \[1, 64\] or 0 \(auto\)"):
        RolloutEngine(*llama).generate(PROMPTS[:1], SAMPLED, SCHEDULE, draft_tokens=value)


def test_exact_summary_refuses_completions_of_other_modes(llama):
    with pytest.raises(SparrowError, match="not generated in exact mode"):
        exact_summary(RolloutEngine(*llama).generate(PROMPTS[:1], SAMPLED, SCHEDULE))


def test_the_compiled_span_step_equals_one_token_steps_at_head_dim_64():
    """The CPU kernel's span path (query rows of G heads x S tokens, the span's future cut) runs at head dims it
    compiles for (64, 128); the tiny models' 16 take the generic path, so this model has SmolLM2's head dim."""
    from sparrow.cpu import kernel as cpu_kernel

    if cpu_kernel.load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparrow.models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
                         num_key_value_heads=1, head_dim=64, intermediate_size=256, max_position_embeddings=1024,
                         initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    engine = RolloutEngine(model, tok)
    # spans that fill and cross pages at different offsets
    _, _, one, many = _span_and_steps(engine, random_prompts([45, 78, 33], seed=3), 9)
    assert (many - one).abs().max() < 1e-4


def test_auto_draft_length_follows_the_acceptance_and_the_verification_cost():
    from sparrow.engine.exact import choose_draft_length

    flat = {5: 0.10}  # a verification costing the same whatever its span (memory-bound, as on a GPU)
    assert choose_draft_length(0.95, 0.02, {5: 0.10, 9: 0.10}) > choose_draft_length(0.95, 0.02, {5: 0.10, 9: 0.18})
    assert choose_draft_length(0.95, 0.02, flat) > choose_draft_length(0.5, 0.02, flat)
    assert choose_draft_length(0.0, 0.02, flat) == 1
    assert 1 <= choose_draft_length(0.999, 0.001, {2: 0.1, 3: 0.1}, max_k=16) == 16


def test_auto_draft_length_keeps_the_tokens_dense_samplings(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok, max_batch_size=10)
    dense = engine.generate(PROMPTS, SAMPLED, DENSE, num_samples=2)
    _same(engine.generate(PROMPTS, SAMPLED, SCHEDULE, num_samples=2, draft_tokens=0), dense)


def test_the_rounds_of_a_completion_and_what_the_verifications_kept():
    """From the per-token record alone (all vLLM reports of its drafts): after the prefill's token each round
    commits its kept drafts and one dense token; a round cut by the end is left out. K 3 here: rounds keeping
    3, 0, 2 drafts, then 1 kept draft of a round the sequence ended in."""
    from sparrow.engine import Completion
    from sparrow.engine.exact import draft_rounds
    from sparrow.rl.step_metrics import exact_rollout_metrics

    drafted = [False, True, True, True, False, False, True, True, False, True]
    c = Completion(0, 0, list(range(100)), token_ids=list(range(len(drafted))), verifies=4, rejections=2,
                   drafted=drafted)
    assert draft_rounds(c, 3) == [(101, 3), (105, 0), (106, 2)]
    metrics = exact_rollout_metrics([c], draft_tokens=3, bin_size=104)
    assert metrics["rollout/kept_first_1"] == pytest.approx(2 / 3)
    assert metrics["rollout/kept_first_3"] == pytest.approx(1 / 3)
    assert metrics["mismatch/bin_0/drafts_kept"] == 1.0 and metrics["mismatch/bin_0/rounds"] == 1  # 3 of 3 judged
    assert metrics["mismatch/bin_104/drafts_kept"] == pytest.approx(2 / 4)  # judged: the 0 + 1 rejected, 2 + 1
    assert metrics["rollout/tokens_per_verify"] == pytest.approx(9 / 4)
    assert "rollout/kept_first_1" not in exact_rollout_metrics([c])  # the draft length varied (auto)
