"""The step plan shared by the vLLM backends (sparrow/vllm/plan.py) against the rule written per request, and the
engine checks (sparrow/vllm/checks.py)."""

from types import SimpleNamespace

import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.schedules import parse_schedule
from sparrow.vllm.checks import check_engine, check_parallel
from sparrow.vllm.paged import physical_pages
from sparrow.vllm.plan import plan_step

PS = 16


def step(query_lens, seq_lens, prefilling, block=32, host_only=False):
    """vLLM's CommonAttentionMetadata as the plan reads it; `host_only`: the device cached lengths are unreadable
    (a meta tensor), so the plan must use the host copy."""
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    width = max(seq_lens) // block + 1
    table = torch.arange(len(seq_lens) * width, dtype=torch.int32).view(len(seq_lens), width).flip(1).contiguous()
    return SimpleNamespace(num_reqs=len(query_lens), query_start_loc=starts, query_start_loc_cpu=starts,
                           seq_lens=torch.empty(len(seq_lens), device="meta") if host_only else seq,
                           seq_lens_cpu_upper_bound=seq, is_prefilling=torch.tensor(prefilling),
                           block_table_tensor=table)


def rule_per_request(query_lens, seq_lens, prefilling, schedule):
    """Our engine's rule, one request at a time."""
    sparse = []
    for q, n, p in zip(query_lens, seq_lens, prefilling):
        budget = schedule.budget_at(n)
        sparse.append(q == 1 and not p and budget is not None and budget // PS < -(-n // PS))
    return sparse


def random_step(seed, requests=200):
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 4, (requests,), generator=gen).tolist()  # decode, prefill chunk, prompt tail, padding
    seq_lens = torch.randint(1, 4000, (requests,), generator=gen).tolist()
    query_lens = [{0: 1, 1: min(n, 37), 2: 1, 3: 0}[k] for k, n in zip(kind, seq_lens)]
    return query_lens, seq_lens, [k == 2 for k in kind]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_plan_is_the_rule_per_request(seed):
    schedule = parse_schedule("0:256,1024:512,3000:2048")
    query_lens, seq_lens, prefilling = random_step(seed)
    plan = plan_step(step(query_lens, seq_lens, prefilling, host_only=True), schedule, PS, 32)
    sparse = rule_per_request(query_lens, seq_lens, prefilling, schedule)
    rows = [r for r, s in enumerate(sparse) if s]
    starts = [sum(query_lens[:r]) for r in range(len(query_lens) + 1)]
    assert 20 < len(rows) < 150
    assert plan.tokens.tolist() == [starts[r] for r in rows]
    assert plan.seq_lens.tolist() == [seq_lens[r] for r in rows]
    assert plan.n_pages.tolist() == [-(-seq_lens[r] // PS) for r in rows]
    assert plan.budget_pages.tolist() == [schedule.budget_at(seq_lens[r]) // PS for r in rows]
    table = step(query_lens, seq_lens, prefilling).block_table_tensor
    for i, r in enumerate(rows):
        pages = -(-seq_lens[r] // PS)
        assert plan.page_table[i, :pages].tolist() == [int(table[r, p // 2]) * 2 + p % 2 for p in range(pages)]
    assert plan.stock_seq_lens_cpu.tolist() == [1 if s else n for s, n in zip(sparse, seq_lens)]
    others = [r for r, s in enumerate(sparse) if not s]
    stock = plan.stock
    assert stock.rows.tolist() == others
    assert stock.tokens.tolist() == [t for r in others for t in range(starts[r], starts[r + 1])]
    assert stock.query_start_loc.dtype == torch.int32
    assert stock.query_start_loc.tolist() == [sum(query_lens[r] for r in others[:i]) for i in range(len(others) + 1)]
    whole = plan_step(step(query_lens, seq_lens, prefilling, host_only=True), schedule, PS, 32, sub_batch=False)
    assert whole.stock is None  # the CUDA backend's plan: the same decision, no sub-batch
    for name in ("tokens", "page_table", "seq_lens", "n_pages", "budget_pages", "stock_seq_lens_cpu"):
        assert torch.equal(getattr(whole, name), getattr(plan, name)), name


def test_no_sparse_request_or_a_dense_schedule_is_no_plan():
    covered = step([1, 5, 1], [40, 900, 3000], [False, False, True])
    assert plan_step(covered, parse_schedule("const:1024"), PS, 32) is None  # request 2 is a prompt tail
    assert plan_step(covered, parse_schedule("dense"), PS, 32) is None
    only_sparse = plan_step(step([1, 1], [900, 3000], [False, False]), parse_schedule("const:64"), PS, 32)
    assert only_sparse.stock is None and only_sparse.budget_pages.tolist() == [4, 4]


@pytest.mark.parametrize("block", [16, 32, 128])
def test_physical_pages_are_each_blocks_pages_in_order(block):
    table = torch.tensor([[7, 3, 9, 1], [2, 0, 5, 6]], dtype=torch.int32)
    per = block // PS
    num = 4 * per - 1
    pages = physical_pages(table, num, block, PS)
    assert pages.dtype == torch.int64 and pages.shape == (2, num)
    assert pages.tolist() == [[int(table[r, p // per]) * per + p % per for p in range(num)] for r in range(2)]


def test_tensor_parallel_layouts_that_cannot_be_exact_are_refused():
    for kv_heads, ranks in ((8, 1), (8, 2), (8, 8), (2, 2)):
        check_parallel(kv_heads, ranks)
    for kv_heads, ranks in ((2, 4), (8, 3), (1, 2)):
        with pytest.raises(SparrowError, match=f"the {kv_heads} KV heads split evenly over the {ranks} ranks"):
            check_parallel(kv_heads, ranks)
    with pytest.raises(SparrowError, match="context parallelism"):
        check_parallel(8, 2, context_parallel=2)


def test_an_engine_with_speculative_decoding_or_replicated_kv_heads_is_refused():
    def engine(kv_heads, tp, speculative=None):
        parallel = SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1,
                                   prefill_context_parallel_size=1)
        model = SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads)
        return SimpleNamespace(parallel_config=parallel, model_config=model, speculative_config=speculative)

    check_engine(engine(4, 2))
    with pytest.raises(SparrowError, match="split evenly"):
        check_engine(engine(4, 8))
    with pytest.raises(SparrowError, match="speculative decoding"):
        check_engine(engine(4, 1, speculative=object()))
