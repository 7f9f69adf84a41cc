"""Sparse attention end to end on tiny models: against a loop reference, dense, transformers, and itself."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from sparrow.attention import KVCache, SparseConfig
from sparrow.attention.kernels import decode_attention
from sparrow.attention.landmarks import LANDMARKS
from sparrow.attention.teacher_forced import sparse_completion_logits, sparse_forward
from sparrow.cpu import kernel as cpu_kernel
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.schedules import DENSE, const, steps
from tests.conftest import pad_sequences, random_prompts

GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


def reference_decode(q, keys, values, length, budget_pages, sparse, scaling):
    """One row's sparse decode written as plainly as possible: q [Hq, D], keys/values [Hkv, length, D]."""
    ps, kv_heads = sparse.page_size, keys.shape[0]
    group = q.shape[0] // kv_heads
    n_pages = -(-length // ps)
    out = []
    for h in range(kv_heads):
        qs = q[h * group:(h + 1) * group]
        keep = set(range(n_pages))
        if n_pages > budget_pages:
            forced = {p for p in range(n_pages) if p < sparse.sink_pages or p >= n_pages - sparse.recent_pages}
            scores = {}
            for p in set(range(n_pages)) - forced:
                page = keys[h, p * ps:(p + 1) * ps]
                if sparse.landmark == "centroid":
                    scores[p] = float(qs.mean(0) @ page.mean(0))
                else:
                    lo, hi = page.min(0).values, page.max(0).values
                    scores[p] = max(float(torch.maximum(qh * lo, qh * hi).sum()) for qh in qs)
            keep = forced | set(sorted(scores, key=scores.get, reverse=True)[: budget_pages - len(forced)])
        idx = torch.tensor([t for p in sorted(keep) for t in range(p * ps, min((p + 1) * ps, length))])
        weights = torch.softmax(qs @ keys[h, idx].T * scaling, dim=-1)
        out.append(weights @ values[h, idx])
    return torch.cat(out)


@pytest.fixture(params=["compiled", "pytorch"])
def decode_path(request, monkeypatch):
    """Run a test with the compiled CPU kernel and with the pure-PyTorch path."""
    if request.param == "compiled" and cpu_kernel.load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    monkeypatch.setenv("SPARROW_CPU_KERNEL", "1" if request.param == "compiled" else "0")
    return request.param


# (page size, query heads, KV heads, head dim): the compiled kernel's generic loops, then its register-blocked ones
# (head dims 64 and 128; pages of 16 in vLLM's layout) with groups of 3 and 5 query heads per KV head.
SHAPES = [(4, 4, 2, 8), (16, 9, 3, 64), (16, 10, 2, 128)]


def _cache_of_rows(layers: int, layer: int, lengths: list[int], hkv: int, dim: int, sparse: SparseConfig):
    """A cache whose rows hold random prompts of `lengths` tokens in `layer` (room for 16 pages a row): returns
    (cache, keys, values [rows, Hkv, T, D], and each row's next key and value [rows, Hkv, 1, D])."""
    page, rows = sparse.page_size, len(lengths)
    cache = KVCache(layers, rows, hkv, dim, 16 * page, sparse, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(rows, hkv, 61 * page // 4, dim), torch.randn(rows, hkv, 61 * page // 4, dim)
    for row, n in enumerate(lengths):
        cache.write_prompt(layer, torch.tensor([row]), keys[row, :, :n], values[row, :, :n])
    cache.lengths = torch.tensor(lengths)
    new_k = torch.stack([keys[r, :, n] for r, n in enumerate(lengths)]).unsqueeze(2)
    new_v = torch.stack([values[r, :, n] for r, n in enumerate(lengths)]).unsqueeze(2)
    return cache, keys, values, new_k, new_v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("landmark", LANDMARKS)
def test_decode_kernel_matches_the_loop_reference_in_a_mixed_batch(landmark, shape, decode_path):
    torch.manual_seed(0)
    page, hq, hkv, dim = shape
    sparse = SparseConfig(page_size=page, landmark=landmark, dense_layers=(0,))
    lengths = [37 * page // 4, 13 * page // 4, 60 * page // 4]
    cache, keys, values, new_k, new_v = _cache_of_rows(2, 1, lengths, hkv, dim, sparse)
    q = torch.randn(3, hq, 1, dim)
    budget = torch.tensor([5, 5, 6])  # row 1 (4 pages) falls back to dense, the others are sparse
    out = decode_attention(q, new_k, new_v, cache, 1, cache.begin_step(budget), 0.3)
    for row, n in enumerate(lengths):
        want = reference_decode(q[row, :, 0], keys[row, :, : n + 1], values[row, :, : n + 1], n + 1,
                                int(budget[row]), sparse, 0.3)
        assert torch.allclose(out[row, 0], want.view(hq, dim), atol=1e-5)


def test_dense_layers_attend_to_every_token_whatever_the_budget(decode_path):
    torch.manual_seed(1)
    sparse = SparseConfig(page_size=4)
    cache = KVCache(1, 1, 1, 4, 64, sparse, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(1, 41, 4), torch.randn(1, 41, 4)
    cache.write_prompt(0, torch.tensor([0]), keys[:, :40], values[:, :40])
    cache.lengths[:] = 40
    q = torch.randn(1, 1, 1, 4)
    out = decode_attention(q, keys[None, :, 40:], values[None, :, 40:], cache, 0, cache.begin_step(torch.tensor([3])),
                           0.5)
    want = torch.softmax(q[0, 0] @ keys[0].T * 0.5, -1) @ values[0]
    assert torch.allclose(out.flatten(), want.flatten(), atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_dense_step_attends_every_cached_token_of_each_row(shape, decode_path):
    """A step without budgets (a dense schedule): rows of different lengths, partial last pages."""
    torch.manual_seed(2)
    page, hq, hkv, dim = shape
    lengths = [37 * page // 4, 3, 60 * page // 4]
    cache, keys, values, new_k, new_v = _cache_of_rows(1, 0, lengths, hkv, dim, SparseConfig(page_size=page))
    q = torch.randn(3, hq, 1, dim)
    out = decode_attention(q, new_k, new_v, cache, 0, cache.begin_step(None), 0.3)
    group = hq // hkv
    for row, n in enumerate(lengths):
        k, v = keys[row, :, : n + 1].repeat_interleave(group, 0), values[row, :, : n + 1].repeat_interleave(group, 0)
        want = torch.softmax(q[row, :, 0, None] @ k.transpose(1, 2) * 0.3, -1) @ v
        assert torch.allclose(out[row, 0], want.squeeze(1), atol=1e-5)


def _continuations(engine, prompts, schedule, sampling=GREEDY, n=1):
    return engine.generate(prompts, sampling, schedule, num_samples=n)


def test_dense_greedy_equals_transformers_generate(tiny, decode_path):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    prompts = random_prompts([70, 23, 130])
    outs = _continuations(engine, prompts, DENSE, SamplingParams(max_new_tokens=40, temperature=0))
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        assert ref[0, len(prompt):].tolist() == out.token_ids


def _logits_of(model, seqs, prompt_lens, schedule, sparse):
    with torch.no_grad():
        return sparse_forward(model, pad_sequences(seqs), torch.tensor(prompt_lens), schedule, sparse).logits


def test_a_budget_covering_the_sequence_gives_the_dense_logits(tiny):
    model, tok = tiny
    sparse = SparseConfig()
    prompts = random_prompts([150, 90], seed=3)
    outs = _continuations(RolloutEngine(model, tok, sparse), prompts, const(256))
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    dense = model(input_ids=pad_sequences(seqs)).logits  # transformers' own SDPA path, no Sparrow context
    sparse_logits = _logits_of(model, seqs, [150, 90], const(256), sparse)
    for row, seq in enumerate(seqs):
        assert (sparse_logits[row, : len(seq)] - dense[row, : len(seq)]).abs().max() <= 1e-4
    # and the decode path's log-probs are the dense ones
    dense_lp = torch.log_softmax(dense.float(), -1)
    for row, out in enumerate(outs):
        p = len(out.prompt_token_ids)
        got = dense_lp[row, p - 1: p - 1 + len(out.token_ids)].gather(-1, torch.tensor(out.token_ids)[:, None])
        assert torch.allclose(got.squeeze(-1), torch.tensor(out.logprobs), atol=1e-4)


@pytest.mark.parametrize("landmark", LANDMARKS)
def test_teacher_forced_reproduces_decode_time_sparse_logprobs(tiny, landmark, decode_path):
    model, tok = tiny
    sparse = SparseConfig(landmark=landmark)
    schedule = steps(100, [64, 80, 96])  # the budget changes while decoding
    prompts = random_prompts([120, 47, 181], seed=5)
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0, seed=7, ignore_eos=True, num_logprobs=5)
    outs = _continuations(RolloutEngine(model, tok, sparse), prompts, schedule, sampling, n=2)
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    logits = _logits_of(model, seqs, [len(o.prompt_token_ids) for o in outs], schedule, sparse)
    logp = torch.log_softmax(logits.float(), -1)
    for row, out in enumerate(outs):
        p, n = len(out.prompt_token_ids), len(out.token_ids)
        rows = logp[row, p - 1: p - 1 + n]
        got = rows.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert (got - torch.tensor(out.logprobs)).abs().max() <= 1e-3
        top = rows.gather(-1, torch.tensor(out.top_token_ids))
        assert (top - torch.tensor(out.top_logprobs)).abs().max() <= 1e-3


def test_an_aggressive_budget_changes_the_logits(llama):
    model, tok = llama
    prompts = random_prompts([300], seed=2)
    outs = _continuations(RolloutEngine(model, tok), prompts, DENSE)
    seqs = [outs[0].prompt_token_ids + outs[0].token_ids]
    dense = _logits_of(model, seqs, [300], DENSE, SparseConfig())
    sparse = _logits_of(model, seqs, [300], const(64), SparseConfig())
    assert (dense[0, :300] - sparse[0, :300]).abs().max() < 1e-4  # the prefill stays dense
    assert (dense[0, 300:] - sparse[0, 300:]).abs().max() > 1e-2


def test_rows_of_a_mixed_batch_equal_each_row_alone(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok)
    schedule = steps(64, [48, 64, 96, 128])
    prompts = random_prompts([20, 200, 75], seed=4)
    together = _continuations(engine, prompts, schedule)
    for prompt, out in zip(prompts, together):
        alone = _continuations(engine, [prompt], schedule)[0]
        assert alone.token_ids == out.token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(out.logprobs), atol=1e-4)
        cached = torch.arange(len(prompt) + 1, len(prompt) + len(out.token_ids))
        assert out.kv_budget == [len(prompt)] + schedule.budget_for(cached).tolist()


def test_peft_lora_wrapped_models_decode_sparsely_and_agree_with_teacher_forcing():
    from sparrow.models import load_model

    model, tok = load_model("tiny-qwen3")
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    schedule = const(64)
    outs = _continuations(RolloutEngine(lora, tok), random_prompts([150], seed=6), schedule)
    seq = outs[0].prompt_token_ids + outs[0].token_ids
    logp = torch.log_softmax(_logits_of(lora, [seq], [150], schedule, SparseConfig()).float(), -1)
    got = logp[0, 149:149 + 40].gather(-1, torch.tensor(outs[0].token_ids)[:, None]).squeeze(-1)
    assert (got - torch.tensor(outs[0].logprobs)).abs().max() <= 1e-3
    with lora.disable_adapter():
        base = _continuations(RolloutEngine(lora, tok), random_prompts([150], seed=6), schedule)
    assert base[0].logprobs != outs[0].logprobs  # the adapter is really in the forward


@pytest.mark.parametrize("landmark", LANDMARKS)
def test_shared_prompt_sparse_forward_equals_the_full_one_in_values_and_gradients(landmark):
    """The prompt run once for a group, then the completions teacher-forced against its cache, is sparse_forward."""
    from sparrow.models import load_model

    torch.manual_seed(0)
    model, _ = load_model("tiny-qwen3")
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    sparse, schedule, p = SparseConfig(landmark=landmark), steps(100, [48, 64, 80]), 130
    prompt = torch.randint(3, 250, (1, p))
    ids = torch.cat([prompt.expand(3, -1), torch.randint(3, 250, (3, 70))], dim=1)
    params = [q for name, q in lora.named_parameters() if "lora_" in name]

    full = sparse_forward(lora, ids, torch.full((3,), p), schedule, sparse).logits[:, p - 1:-1]
    full.square().mean().backward()
    want = [q.grad.clone() for q in params]
    lora.zero_grad()
    shared = sparse_completion_logits(lora, ids, p, schedule, sparse)
    shared.square().mean().backward()
    assert shared.shape == full.shape
    assert (shared - full).abs().max() <= 1e-4
    assert all(torch.allclose(q.grad, w, atol=1e-5, rtol=1e-4) for q, w in zip(params, want))
    dense = sparse_completion_logits(lora, ids, p, DENSE, sparse)
    assert (dense - shared).abs().max() > 1e-2  # the budget really bites
