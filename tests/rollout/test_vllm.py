"""Sparrow's vLLM plugin and backend: the paged rule against our engine's, and vLLM's rollouts against our forward.

The engine tests share one vLLM engine per model (start-up takes seconds); tiny models with head size 32, which
vLLM's CPU backend takes (our usual tiny models have 16).
"""

import functools
import json
import subprocess
import sys

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.attention.kernels import decode_attention
from sparrow.attention.kv_cache import KVCache
from sparrow.attention.teacher_forced import sparse_completion_logits
from sparrow.cpu import kernel as cpu_kernel
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.errors import SparrowError
from sparrow.schedules import const, parse_schedule
from sparrow.vllm import env as plugin_env
from sparrow.vllm.paged import PageLandmarks, physical_pages, reference_decode
from tests.conftest import random_prompts, save_tiny_for_vllm

# -- the rule over a paged cache, without vLLM -------------------------------------------------------------------


def _cpu_layout_cache(keys, values, blocks_of, block_size, num_blocks):
    """A vLLM CPU cache [blocks, Hkv, block, 2 D] holding each row's keys/values [Hkv, T, D] in the blocks
    `blocks_of[row]`: keys channel-major per (block, head), then values."""
    kv_heads, dim = keys[0].shape[0], keys[0].shape[-1]
    cache = torch.zeros(num_blocks, kv_heads, 2, block_size * dim)
    k_view = cache[:, :, 0].view(num_blocks, kv_heads, dim, block_size)
    v_view = cache[:, :, 1].view(num_blocks, kv_heads, block_size, dim)
    for k, v, blocks in zip(keys, values, blocks_of):
        for t in range(k.shape[1]):
            b, o = blocks[t // block_size], t % block_size
            k_view[b, :, :, o] = k[:, t]
            v_view[b, :, o] = v[:, t]
    return cache.view(num_blocks, kv_heads, block_size, 2 * dim)


@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_paged_decode_equals_the_engines_decode_in_the_reference_and_the_kernel(landmark):
    """Three requests of different lengths in scattered blocks: the paged reference and the paged kernel attend
    as our engine's decode step does on its own cache, with the budget below and above the pages held."""
    sparse = SparseConfig(landmark=landmark)
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, dim, block = 2, 2, 32, 64
    lengths = [300, 97, 513]
    keys = [torch.randn(kv_heads, n, dim, generator=gen) for n in lengths]
    values = [torch.randn(kv_heads, n, dim, generator=gen) for n in lengths]
    queries = torch.randn(len(lengths), kv_heads, group, dim, generator=gen)
    order = torch.randperm(40, generator=gen).tolist()
    blocks_of, start = [], 0
    for n in lengths:
        need = -(-n // block)
        blocks_of.append(order[start:start + need])
        start += need
    cache = _cpu_layout_cache(keys, values, blocks_of, block, 40)
    table = torch.tensor([b + [0] * (10 - len(b)) for b in blocks_of])
    seq = torch.tensor(lengths)
    n_pages = (seq + 15) // 16
    phys = physical_pages(table, int(n_pages.max()), block, 16)
    marks = PageLandmarks(sparse, 40 * block // 16, kv_heads, dim, torch.float32, "cpu")
    for k, blocks in zip(keys, blocks_of):
        full = k.shape[1] // 16
        pages = physical_pages(torch.tensor([blocks]), full, block, 16)[0]
        marks.update(pages, k[:, : full * 16].reshape(kv_heads, full, 16, dim).transpose(0, 1))

    from sparrow.vllm.cpu_attention import cpu_page_reader

    for budget in (torch.tensor([64, 64, 96]), torch.tensor([2000, 48, 128])):
        ref = reference_decode(queries, cpu_page_reader(cache, 16), phys, marks, seq, budget // 16, sparse, 0.2)
        # our engine: the same tokens in a per-row cache, the last one written by the decode step itself
        engine_cache = KVCache(3, len(lengths), kv_heads, dim, 600, sparse, torch.float32, "cpu")
        for r, (k, v) in enumerate(zip(keys, values)):
            engine_cache.write_prompt(2, torch.tensor([r]), k[:, :-1], v[:, :-1])
            engine_cache.lengths[r] = k.shape[1] - 1
        step = engine_cache.begin_step(budget // 16)
        last_k = torch.stack([k[:, -1] for k in keys])[:, :, None]
        last_v = torch.stack([v[:, -1] for v in values])[:, :, None]
        q = queries.reshape(len(lengths), kv_heads * group, 1, dim)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPARROW_CPU_KERNEL", "0")
            engine = decode_attention(q, last_k, last_v, engine_cache, 2, step, 0.2)
        engine = engine.view(len(lengths), kv_heads, group, dim)
        torch.testing.assert_close(ref, engine, atol=1e-5, rtol=1e-5)
        if cpu_kernel.usable(queries):
            kernel = cpu_kernel.paged_sparse_decode(queries, cache, phys, marks.tensors, n_pages, budget // 16, seq,
                                                    sparse, 0.2)
            torch.testing.assert_close(kernel, engine, atol=1e-5, rtol=1e-5)


def test_the_plugin_is_configured_from_the_environment_and_refuses_bad_values():
    assert plugin_env.from_environment({}) is None
    config = plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": "0:512,3584:1024",
                                             "SPARROW_VLLM_LANDMARK": "quest", "SPARROW_VLLM_DENSE_LAYERS": "0"})
    assert config.schedule.starts == (0, 3584) and config.schedule.budgets == (512, 1024)
    assert config.sparse.landmark == "quest" and config.sparse.dense_layers == (0,)
    env = plugin_env.environment_for(config.sparse, config.schedule)
    assert plugin_env.from_environment(env) == plugin_env.PluginConfig(config.sparse,
                                                                             parse_schedule("0:512,3584:1024"))
    for bad, named in ((("SPARROW_VLLM_SCHEDULE", "const:20"), "SPARROW_VLLM_SCHEDULE='const:20'"),
                       (("SPARROW_VLLM_LANDMARK", "median"), "unknown landmark 'median'"),
                       (("SPARROW_VLLM_PAGE_SIZE", "x"), "SPARROW_VLLM_PAGE_SIZE='x'")):
        with pytest.raises(SparrowError, match=named.replace("(", r"\(")):
            plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": "const:256", bad[0]: bad[1]})


def test_a_page_size_that_does_not_divide_the_block_size_is_refused():
    pytest.importorskip("vllm")
    from sparrow.vllm.cpu_attention import check_sparse_config

    check_sparse_config(SparseConfig(page_size=16), 128, "auto")
    with pytest.raises(SparrowError, match="page size 48 does not divide vLLM's KV block size 128"):
        check_sparse_config(SparseConfig(page_size=48), 128, "auto")
    with pytest.raises(SparrowError, match="unquantized KV cache"):
        check_sparse_config(SparseConfig(), 128, "fp8")


def test_the_cpu_block_holds_one_page_where_vllm_allows():
    assert [plugin_env.cpu_block_size(p) for p in (16, 32, 8, 4, 48)] == [16, 32, 16, 16, 48]


def test_missing_vllm_is_one_message(monkeypatch):
    from sparrow.rollout import vllm_backend

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(SparrowError, match=r"--backend vllm needs vLLM.*pip install 'sparrow-rl\[vllm\]'"):
        vllm_backend.check_vllm()


# -- vLLM engines --------------------------------------------------------------------------------------------------

vllm = pytest.importorskip("vllm")


@functools.cache
def _backend(architecture: str, landmark: str, **engine_args):
    from sparrow.models import load_model
    from sparrow.rollout.vllm_backend import VLLMBackend

    path = save_tiny_for_vllm(f"{_tmp()}/tiny-{architecture}", architecture)
    model, tok = load_model(path)
    return VLLMBackend(path, tok, SparseConfig(landmark=landmark), max_model_len=2048, kv_cache_gib=1,
                       **engine_args), model, tok


@functools.cache
def _tmp():
    import tempfile

    return tempfile.mkdtemp(prefix="sparrow-vllm-")


@pytest.fixture(scope="module")
def llama_vllm():
    backend, model, tok = _backend("llama", "centroid")
    yield backend, model, tok


PROMPTS = random_prompts([300, 517, 64, 700], seed=3)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, num_logprobs=5)


def test_greedy_sparse_rollouts_equal_our_engine_on_concurrent_requests_of_different_lengths(llama_vllm):
    backend, model, tok = llama_vllm
    schedule = const(64)
    ours = RolloutEngine(model, tok, SparseConfig()).generate(PROMPTS, GREEDY, schedule)
    theirs = backend.generate(PROMPTS, GREEDY, schedule)
    dense = backend.generate(PROMPTS, GREEDY, parse_schedule("dense"))
    assert backend.llm.llm_engine.vllm_config.cache_config.block_size == 16  # one page per block (cpu_block_size)
    for a, b, d in zip(ours, theirs, dense):
        assert b.token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3  # matmuls differ
        assert b.kv_budget == a.kv_budget
        assert [t[:3] for t in b.top_token_ids[:5]] == [t[:3] for t in a.top_token_ids[:5]]
    # sparse decode really ran: at 64 of 300+ tokens the distributions differ from dense
    assert max(abs(x - y) for a, d in zip(theirs[:2], dense[:2]) for x, y in zip(a.logprobs, d.logprobs)) > 1e-3


def test_sparse_rollouts_after_dense_steps_use_landmarks_rebuilt_for_the_cached_prompts(llama_vllm):
    """Dense steps keep no landmarks; the prompts' blocks they left in the prefix cache get theirs rebuilt at the
    first sparse step, so the sparse rollouts still equal our engine's."""
    backend, model, tok = llama_vllm
    prompts = random_prompts([400, 620], seed=11)
    backend.generate(prompts, GREEDY, parse_schedule("dense"))
    theirs = backend.generate(prompts, GREEDY, const(64))
    ours = RolloutEngine(model, tok, SparseConfig()).generate(prompts, GREEDY, const(64))
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    assert max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def _teacher_forced_agreement(backend, model, schedule, prompts, samples, sparse=None):
    sparse = sparse or SparseConfig()
    rollouts = backend.generate(prompts, SamplingParams(max_new_tokens=32, seed=5, ignore_eos=True), schedule,
                                samples)
    close = total = 0
    for c in rollouts:
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        logits = sparse_completion_logits(model, ids, len(c.prompt_token_ids), schedule, sparse)[0]
        ours = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        diff = (ours - torch.tensor(c.logprobs)).abs()
        close += int((diff < 1e-3).sum())
        total += diff.numel()
    return close / total, rollouts


def test_sampled_sparse_rollouts_teacher_force_to_the_same_log_probs_with_prefix_caching(llama_vllm):
    """Four samples per prompt: the later ones reuse the prompt's cached blocks (and their landmarks)."""
    backend, model, _ = llama_vllm
    share, rollouts = _teacher_forced_agreement(backend, model, const(64), PROMPTS[:2], 4)
    assert share >= 0.99
    assert len({tuple(c.token_ids) for c in rollouts[:4]}) == 4  # the samples differ


def test_samples_do_not_depend_on_the_other_requests(llama_vllm):
    backend, _, _ = llama_vllm
    sampling = SamplingParams(max_new_tokens=12, seed=9)
    both = backend.generate(PROMPTS[:2], sampling, const(64), 2)
    alone = backend.generate([PROMPTS[1]], sampling, const(64), 2, prompt_keys=[1])
    assert [c.token_ids for c in alone] == [c.token_ids for c in both[2:]]


def test_sync_weights_changes_the_rollouts_and_restoring_restores_them(llama_vllm):
    backend, model, _ = llama_vllm
    before = backend.generate(PROMPTS[:1], GREEDY, const(64))[0]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.05)
        backend.sync_weights(model)
        changed = backend.generate(PROMPTS[:1], GREEDY, const(64))[0]
        assert changed.logprobs != before.logprobs
    finally:
        model.load_state_dict(original)
        backend.sync_weights(model)
    assert backend.generate(PROMPTS[:1], GREEDY, const(64))[0].logprobs == before.logprobs


def test_quest_landmarks_and_qwen3_q_k_norms_teacher_force_to_the_same_log_probs(llama_vllm):
    backend, _, _ = llama_vllm
    backend.close()  # one engine at a time
    _backend.cache_clear()
    backend, model, _ = _backend("qwen3", "quest")
    try:
        share, _ = _teacher_forced_agreement(backend, model, const(64), PROMPTS[:3], 2, SparseConfig(landmark="quest"))
        assert share >= 0.99
    finally:
        backend.close()


def test_chunked_prefill_and_mixed_prefill_decode_batches_give_our_engines_rollouts():
    """At most 96 tokens per engine step: long prompts are prefilled in chunks while other requests decode."""
    _backend.cache_clear()
    backend, model, tok = _backend("llama", "centroid", max_num_batched_tokens=96, max_num_seqs=4,
                                   enable_chunked_prefill=True)
    try:
        ours = RolloutEngine(model, tok, SparseConfig()).generate(PROMPTS, GREEDY, const(64))
        theirs = backend.generate(PROMPTS, GREEDY, const(64))
        for a, b in zip(ours, theirs):
            assert b.token_ids == a.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    finally:
        backend.close()
        _backend.cache_clear()


def test_grpo_steps_with_the_vllm_backend_sync_weights_and_train(tmp_path):
    """Two GRPO steps from the CLI with rollouts from vLLM: the second step's rollouts come from the updated
    weights (synced through reload_weights), and the exact monitor measures vLLM's sparse tokens."""
    from sparrow.cli import main

    _backend.cache_clear()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abc " * (40 + 9 * i), "answer": str(i)}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    model_dir = save_tiny_for_vllm(tmp_path / "tiny", "llama")
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out),
                 "--backend", "vllm", "--reward", "tests.rl.test_trainer:byte_mean", "--steps", "2",
                 "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "12",
                 "--learning-rate", "1e-3", "--schedule", "const:64", "--micro-batch-size", "4", "--bin-size", "64",
                 "--seed", "3", "--monitor", "exact"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[1]["time/sync_s"] > 0
    assert 0 < rows[0]["mismatch/exact/p5"] < 1 and rows[0]["mismatch/exact/tokens"] > 0


def test_bench_times_stock_vllm_in_a_child_and_passes_its_progress_on():
    """`sparrow bench --backend vllm --stock`: stock vLLM's rate from a child process, whose prefill and repeats are
    reported as they come, the plugin's dense and sparse rates in the command's process, and the dtype every engine
    ran in; both engines prefill one prompt and copy it into the other's blocks. The command runs in a process of
    its own: vLLM keeps one KV connector per process."""
    path = save_tiny_for_vllm(f"{_tmp()}/tiny-llama", "llama")
    run = subprocess.run([sys.executable, "-m", "sparrow.cli", "bench", "--model", str(path), "--backend", "vllm",
                          "--stock", "--context", "256", "--batch", "2", "--steps", "4", "--repeats", "1",
                          "--warmup", "1", "--schedule", "const:64", "--no-hf", "--json"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    rates = json.loads(run.stdout)["vllm"]
    for key in ("stock_dense_tokens_per_s", "dense_tokens_per_s", "sparse_tokens_per_s"):
        assert rates[key] > 0, key
    copied = "2 distinct prompts of 256 tokens (the first computed, its K and V copied into the others' blocks)"
    assert f" stock: prefill: {copied}" in run.stderr and rates["prefill_copied"] is True
    assert " stock: repeat 1/1: 4 tokens x 2 requests" in run.stderr
    assert "in float32 (--dtype), weights and KV cache, in every engine" in run.stderr
