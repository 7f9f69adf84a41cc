"""Exact mode inside stock vLLM (sparrow/vllm/exact_mode.py): the policy drafts under the plugin's sparse decode
through vLLM's speculative decoding, the dense policy verifies. Tiny Llama (head size 32, which vLLM's CPU backend
takes), one engine per configuration, shared by the tests."""

import functools
import tempfile

import numpy as np
import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.schedules import DENSE, const
from sparrow.vllm.exact_mode import draft_record, speculative_config
from tests.conftest import random_prompts, save_tiny_for_vllm

pytest.importorskip("vllm")

K = 3
PROMPTS = random_prompts([300, 517, 64, 700], seed=3)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, num_logprobs=5)


@functools.cache
def _model_dir() -> str:
    return save_tiny_for_vllm(tempfile.mkdtemp(prefix="sparrow-vllm-exact-") + "/tiny")


@functools.cache
def _backend(draft_tokens: int | None):
    from sparrow.models import load_model
    from sparrow.rollout.vllm_backend import VLLMBackend

    model, tok = load_model(_model_dir())
    return VLLMBackend(_model_dir(), tok, SparseConfig(), max_model_len=2048, kv_cache_gib=1, num_logprobs=300,
                       draft_tokens=draft_tokens, log=lambda _: None), model, tok


def test_the_speculative_config_and_the_record_of_drafts():
    assert speculative_config("/m", 4) == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 4,
                                           "draft_sample_method": "probabilistic"}
    for bad in (0, 65, True, "4", 2.5):
        with pytest.raises(SparrowError, match="integer from 1 to 64"):
            speculative_config("/m", bad)
    # the prefill's token, then per verification its accepted drafts and one token of the dense policy's own
    assert draft_record([2, 0, 3], 9) == (3, [False, True, True, False, False, True, True, True, False])
    assert draft_record([3, 3], 5) == (2, [False, True, True, True, False])
    assert draft_record(None, 2) == (0, [False, False])


def test_greedy_exact_returns_dense_greedy_tokens_while_the_sparse_drafts_are_rejected_at_times():
    """At temperature 0, vLLM exact returns vLLM dense greedy's tokens (the verification's argmax) on every
    sequence; the drafts at const:64 (4 of 19-45 pages) are sparse, so some are rejected, and plugin sparse decode's
    own tokens differ. At a budget covering every cache the draft is the dense policy and every draft is kept:
    together the test that fails if the draft is not sparse."""
    exact, _, _ = _backend(K)
    plain, _, _ = _backend(None)
    dense = plain.generate(PROMPTS, GREEDY, DENSE)
    sparse = plain.generate(PROMPTS, GREEDY, const(64))
    drafted = exact.generate(PROMPTS, GREEDY, const(64), draft_tokens=K)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in dense]
    assert [c.token_ids for c in sparse] != [c.token_ids for c in dense]
    for c, d in zip(drafted, dense):
        assert c.verifies >= len(c.token_ids) // (K + 1) and len(c.drafted) == len(c.token_ids)
        assert c.logprobs == pytest.approx(d.logprobs, abs=1e-4)  # the dense policy's
        assert c.kv_budget == d.kv_budget  # dense attention for every committed token
    assert sum(c.rejections for c in drafted) > 0 and sum(sum(c.drafted) for c in drafted) > 0
    covered = exact.generate(PROMPTS, GREEDY, const(4096), draft_tokens=K)
    assert [c.token_ids for c in covered] == [c.token_ids for c in dense]
    assert sum(c.rejections for c in covered) == 0
    assert all(sum(c.drafted) >= len(c.token_ids) * K // (K + 1) - K for c in covered)
    json = drafted[0].to_json()
    assert json["verifies"] == drafted[0].verifies and len(json["drafted"]) == len(drafted[0].token_ids)


def test_an_engine_generates_only_in_the_mode_it_started_in():
    exact, _, _ = _backend(K)
    with pytest.raises(SparrowError, match="exact mode drafting 3 tokens, and cannot generate without"):
        exact.generate(PROMPTS[:1], GREEDY, const(64))
    with pytest.raises(SparrowError, match="drafts under a sparse schedule"):
        exact.generate(PROMPTS[:1], GREEDY, DENSE, draft_tokens=K)


def _second_token_marginal(model, prompt: list[int]) -> np.ndarray:
    """The dense policy's distribution of the second generated token, summed over the first (float64)."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        vocab = first.shape[0]
        batch = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab).view(-1, 1)], 1)
        second = torch.softmax(model(batch).logits[:, -1].double(), -1)
    return (first.view(-1, 1) * second).sum(0).numpy()


def _chi_square_p(tokens: list[int], expected: np.ndarray) -> float:
    from scipy.stats import chisquare

    counts = np.bincount(tokens, minlength=expected.shape[0]).astype(float)
    expected = expected * len(tokens)
    big = expected >= 5
    observed, wanted = counts[big], expected[big]
    if (~big).any():  # the rare tokens pooled into one cell
        observed, wanted = np.append(observed, counts[~big].sum()), np.append(wanted, expected[~big].sum())
    return float(chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue)


def _vllm_rule(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, seed: int) -> torch.Tensor:
    """vLLM's standard rule as its CPU build runs it, one draft per row: keep the draft x with probability
    min(1, p(x)/q(x)), else vLLM's recovered token (drawn from max(0, p - q) by exponential races)."""
    import vllm._custom_ops  # noqa: F401 - registers the CPU kernels
    from vllm.utils import cpu_triton_utils as kernels

    rows, vocab = p.shape
    gen = torch.Generator().manual_seed(seed)
    inv_q = 1.0 / torch.empty(rows, vocab).exponential_(generator=gen)
    cu = torch.arange(1, rows + 1)
    recovered = torch.zeros(rows, dtype=torch.int64)
    kernels._sample_recovered_tokens_kernel_impl(recovered, cu, draft, q, p, inv_q, vocab)
    out = torch.full((rows, 2), -1, dtype=torch.int32)
    kernels._rejection_random_sample_kernel_impl(out, cu, draft, q, p, torch.zeros(rows, 1, dtype=torch.int64),
                                                 recovered, torch.rand(rows, dtype=torch.float64, generator=gen),
                                                 None, 1, vocab)
    return out[:, 0].long()


def test_at_temperature_one_the_rule_returns_the_dense_distribution_and_accepting_every_draft_does_not():
    """The rule vLLM verifies drafts with, on the tiny model's own distributions at the second token (draft: the
    sparse decode at const:64, 4 of 19 pages, as the plugin draws it; target: the dense policy): 30000 outcomes
    pass a chi-square test against the dense distribution, and a rule keeping every draft (the drafts themselves)
    fails it. The drafter's distribution comes from vLLM (plugin sparse decode, logprobs of the whole vocabulary)."""
    plain, model, tok = _backend(None)
    prompt = random_prompts([300], seed=5)[0]
    vocab = model.config.vocab_size
    first = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, num_logprobs=vocab)
    sparse = plain.generate([prompt], first, const(64))[0]
    dense = plain.generate([prompt], first, DENSE)[0]
    assert sparse.token_ids[0] == dense.token_ids[0]

    def probs(completion):
        out = torch.zeros(vocab, dtype=torch.float64)
        out[torch.tensor(completion.top_token_ids[1])] = torch.tensor(completion.top_logprobs[1]).double().exp()
        return (out / out.sum()).float()

    q, p = probs(sparse), probs(dense)
    assert 0.02 < 0.5 * (p - q).abs().sum() < 0.5  # the draft really differs from the target
    rows = 30000
    gen = torch.Generator().manual_seed(1)
    draft = torch.multinomial(q, rows, replacement=True, generator=gen)
    kept = _vllm_rule(draft, q.expand(rows, -1).contiguous(), p.expand(rows, -1).contiguous(), seed=2)
    assert _chi_square_p(kept.tolist(), p.double().numpy()) > 1e-3
    assert _chi_square_p(draft.tolist(), p.double().numpy()) < 1e-4
    assert (kept == draft).float().mean() == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.03)


def test_at_temperature_one_exact_samples_follow_the_dense_distribution_and_sparse_decodes_do_not():
    """End to end: the second token of 3000 exact-mode samples (a sparse draft at const:48, 3 of 19 pages, kept by
    vLLM's rule or redrawn) passes a chi-square test against the dense policy's distribution (the first token summed
    out). A rule keeping every draft would return the draft's own sample there, which is what the plugin's sparse
    decode draws (the same sparse step over the same cache); the test rejects those. On CPU this needs the plugin's
    fix of vLLM's expand kernel (cpu_fixes.py): without it the target's logits are divided by garbage."""
    exact, model, _ = _backend(1)
    plain, _, _ = _backend(None)
    prompt = random_prompts([300], seed=5)[0]
    expected = _second_token_marginal(model, prompt)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True, seed=0)
    p_values = {}
    for name, backend, drafts in (("exact", exact, 1), ("sparse", plain, None)):
        out = backend.generate([prompt], sampling, const(48), num_samples=3000, draft_tokens=drafts)
        p_values[name] = _chi_square_p([c.token_ids[1] for c in out], expected)
        if drafts:
            assert 0 < sum(sum(c.drafted) for c in out) < 3000  # drafts kept, and not all
    assert p_values["exact"] > 1e-3 and p_values["sparse"] < 1e-4, p_values


def test_the_expand_kernel_fix_writes_in_place_in_the_outputs_dtype():
    from sparrow.vllm.cpu_fixes import expand

    temperature = torch.tensor([1.0, 0.7, -1.0, 1.3])
    out = torch.full((7,), float("nan"))
    expand(out, temperature, torch.tensor([2, 3, 5, 6], dtype=torch.int32), -1.0, 1.0)
    assert out[:6].tolist() == pytest.approx([1.0, 1.0, 0.7, 1.0, 1.0, 1.3]) and out[6].isnan()
    top_k = torch.zeros(3, dtype=torch.int32)
    expand(top_k, torch.tensor([5, 0], dtype=torch.int32), torch.tensor([1, 3]), 0, 9)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 9, 9]


def test_a_weight_sync_reaches_the_drafter():
    """After `sync_weights` with other weights, exact mode at a covering budget keeps every draft (the drafter
    drafts with the new weights: with the old ones most drafts would be rejected) and returns the new dense
    policy's greedy tokens."""
    exact, model, _ = _backend(K)
    plain, _, _ = _backend(None)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    before = exact.generate(PROMPTS, GREEDY, const(4096), draft_tokens=K)
    exact.sync_weights(model)
    plain.sync_weights(model)
    after = exact.generate(PROMPTS, GREEDY, const(4096), draft_tokens=K)
    dense = plain.generate(PROMPTS, GREEDY, DENSE)
    assert [c.token_ids for c in after] == [c.token_ids for c in dense]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert sum(c.rejections for c in after) == 0


def test_generate_in_exact_mode_with_backend_vllm_records_verifications_and_drafts(tmp_path, capsys):
    """`sparrow generate --backend vllm --rollout-mode exact --draft-tokens K`: the engine starts drafting K, and
    each `--json` record carries `verifies` and `drafted` as our engine's do; auto is refused before vLLM starts."""
    from sparrow.cli import main

    base = ["generate", "--backend", "vllm", "--model", _model_dir(), "--rollout-mode", "exact", "--schedule",
            "const:64", "--prompt", "the quick brown fox " * 60, "--max-new-tokens", "12"]
    assert main(base + ["--draft-tokens", "auto"]) == 2
    assert "fixes the draft length when the engine starts" in capsys.readouterr().err
    assert main(base + ["--draft-tokens", "2", "--temperature", "0", "--json"]) == 0
    import json

    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["verifies"] >= 1 and len(row["drafted"]) == len(row["token_ids"]) == 12


def test_grpo_steps_in_exact_mode_with_the_vllm_backend(tmp_path):
    """`sparrow train --backend vllm --rollout-mode exact`: two GRPO steps whose rollouts vLLM drafts under
    const:64 and verifies densely; the log carries what the verifications kept and the importance weights are 1
    (the rollouts' log-probs are the dense policy's, to float rounding)."""
    import json

    from sparrow.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abc " * (40 + 9 * i), "answer": str(i)}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    assert main(["train", "--model", _model_dir(), "--data", str(data), "--output-dir", str(out),
                 "--backend", "vllm", "--rollout-mode", "exact", "--draft-tokens", "2",
                 "--reward", "tests.rl.test_trainer:byte_mean", "--steps", "2", "--prompts-per-step", "2",
                 "--num-generations", "2", "--max-new-tokens", "12", "--learning-rate", "1e-3",
                 "--schedule", "const:64", "--micro-batch-size", "4", "--bin-size", "64", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    for row in rows:
        assert 1 <= row["rollout/tokens_per_verify"] <= 3 and 0 <= row["rollout/kept_first_1"] <= 1
        assert row["time/monitor_s"] == 0
        for bound in ("min", "max"):  # vLLM's log-probs are the dense policy's: the importance weights are 1
            assert row[f"sampling/importance_sampling_ratio/{bound}"] == pytest.approx(1, abs=1e-3)
