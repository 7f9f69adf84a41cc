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


def test_speculative_decoding_other_than_exact_mode_or_replicated_kv_heads_is_refused():
    def engine(kv_heads, tp, speculative=None):
        parallel = SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1,
                                   prefill_context_parallel_size=1)
        model = SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads, model="/models/policy")
        return SimpleNamespace(parallel_config=parallel, model_config=model, speculative_config=speculative)

    def spec(method, draft):
        return SimpleNamespace(method=method, draft_model_config=draft and SimpleNamespace(model=draft))

    assert check_engine(engine(4, 2)) is False
    with pytest.raises(SparrowError, match="split evenly"):
        check_engine(engine(4, 8))
    assert check_engine(engine(4, 1, spec("draft_model", "/models/policy"))) is True  # exact mode
    for other in (spec("ngram", None), spec("eagle", "/models/eagle"), spec("draft_model", "/models/small")):
        with pytest.raises(SparrowError, match="speculative decoding only as exact mode"):
            check_engine(engine(4, 1, other))


def test_a_drafters_steps_decode_the_sampled_from_token_sparsely():
    """Exact mode's drafter: in its first pass a request's sparse token is the last one with a slot (the verified
    tokens, then the sampled one, then rejected drafts' padding), its cached length ending there; the rest of the
    request goes to vLLM's kernel one token shorter. A draft step's one token is sparse even where vLLM still
    flags the request as prefilling, with the device's cached lengths (the host copy counts rejected drafts)."""
    schedule = parse_schedule("const:64")
    query_lens, seq_lens = [5, 2, 3], [900, 1000, 40]
    first = step(query_lens, seq_lens, [True, False, False])
    first.slot_mapping = torch.tensor([11, 12, 13, -1, -1, 20, 21, 30, 31, 32])  # request 0: two drafts rejected
    first.seq_lens_cpu_upper_bound = torch.tensor([905, 1004, 44], dtype=torch.int32)
    plan = plan_step(first, schedule, PS, 32, drafting=True)
    assert plan.tokens.tolist() == [2, 6]  # request 2 (40 cached) is covered by the budget
    assert plan.seq_lens.tolist() == [898, 1000] and plan.budget_pages.tolist() == [4, 4]
    assert plan.n_pages.tolist() == [-(-898 // PS), -(-1000 // PS)]
    assert plan.stock.rows.tolist() == [0, 1, 2]
    assert plan.stock.tokens.tolist() == [0, 1, 3, 4, 5, 7, 8, 9]
    assert plan.stock.query_start_loc.tolist() == [0, 4, 5, 8]
    assert plan.stock.seq_lens.tolist() == [899, 999, 40]
    assert plan.stock_seq_lens_cpu.tolist() == [900, 1000, 40]  # CUDA: the wrapped kernel attends them whole
    assert plan_step(first, schedule, PS, 32) is None  # the same step as the target's: no one-token decode
    draft = step([1, 1], [898, 1000], [True, False])
    draft.seq_lens_cpu_upper_bound = torch.tensor([901, 1001], dtype=torch.int32)
    plan = plan_step(draft, schedule, PS, 32, drafting=True)
    assert plan.tokens.tolist() == [0, 1] and plan.seq_lens.tolist() == [898, 1000] and plan.stock is None
