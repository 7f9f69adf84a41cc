"""The CUDA backend's fixed-shape decode path (graph_decode.py), which vLLM captures in CUDA graphs, on CPU under
Triton's interpreter: it equals the eager path and the PyTorch reference request for request, and its landmark
update the eager update (the backend's forward on this path: test_vllm_wrapped.py).

The interpreter needs TRITON_INTERPRET=1 before triton.language is imported; test_vllm_triton.py sets it and, when
triton was imported earlier, runs this module's `interpreted` tests with its own in one child process.
"""


import pytest
import torch

from sparrow.attention.selection import select_pages
from sparrow.errors import SparrowError
from sparrow.schedules import const, parse_schedule
from sparrow.vllm.paged import PageLandmarks, filled_pages, reference_decode
from tests.rollout.test_vllm_triton import (
    INTERPRETED,
    PS,
    Batch,
    _common_metadata,
    interpreted,
)

if INTERPRETED:
    from sparrow.vllm.graph_decode import (
        graph_sparse_decode,
        page_scores,
        reference_page_scores,
    )
    from sparrow.vllm.triton_decode import page_reader, sparse_decode


@interpreted
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_scoring_kernel_equals_the_landmarks_scores(landmark, group):
    batch = Batch([300, 97, 513], 2, group, 64, 32, landmark=landmark)
    table = torch.cat([batch.page_table, batch.page_table[:, :5]], dim=1)  # slots past every request's pages
    n_pages = batch.n_pages
    ref = reference_page_scores(batch.queries, batch.landmarks, table, n_pages, batch.sparse)
    out = page_scores(batch.queries, batch.landmarks, table, n_pages, batch.sparse)
    assert out.shape == (3, 2, 38)
    assert torch.isinf(out[1, :, 7:]).all() and torch.isfinite(out[1, :, :6]).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


@interpreted
def test_fixed_slots_select_the_pages_of_the_largest_count():
    """The graph path's selection (`slots` fixed, no host read) keeps the pages the count read from the device
    keeps, then only slots marked invalid."""
    batch = Batch([300, 97, 513, 40], 2, 2, 64, 32)
    budget = torch.tensor([4, 5, 6, 9])
    scores = reference_page_scores(batch.queries, batch.landmarks, batch.page_table, batch.n_pages, batch.sparse)
    args = (scores, batch.n_pages[:, None], budget[:, None], batch.sparse.sink_pages, batch.sparse.recent_pages)
    pages, valid = select_pages(*args)
    fixed, fixed_valid = select_pages(*args, slots=12)
    assert fixed.shape == (4, 2, 12) and pages.shape == (4, 2, 6)
    assert fixed_valid.sum(-1).tolist() == [[4, 4], [5, 5], [6, 6], [3, 3]]
    assert torch.equal(fixed_valid[..., :6], valid) and not fixed_valid[..., 6:].any()
    def kept(chosen, marked):  # as sets: pages tied at +inf (sinks, recent pages) come in any order
        return chosen.masked_fill(~marked, -1).sort(-1).values

    assert torch.equal(kept(fixed[..., :6], valid), kept(pages, valid))


@interpreted
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_graph_decode_equals_the_eager_decode(landmark):
    """Over every slot of the block table with 8 slots kept, the requests of budget > 0 get the eager path's output;
    budgets of 5 and 8 pages, one request covered (budget 0 there)."""
    batch = Batch([300, 97, 513, 40], 2, 2, 64, 32, landmark=landmark)
    budget = torch.tensor([5, 8, 8, 0])
    eager = sparse_decode(batch.queries, batch.key_cache, batch.value_cache, batch.page_table, batch.landmarks,
                          batch.seq_lens, budget.clamp(min=1), batch.sparse, batch.scale)
    graph = graph_sparse_decode(batch.queries, batch.key_cache, batch.value_cache, batch.block_table,
                                batch.landmarks, batch.seq_lens, budget, batch.sparse, batch.scale, 8)
    torch.testing.assert_close(graph[:3], eager[:3], atol=1e-5, rtol=1e-5)
    read = page_reader(batch.key_cache, batch.value_cache, PS)
    ref = reference_decode(batch.queries, read, batch.page_table, batch.landmarks, batch.seq_lens, budget,
                           batch.sparse, batch.scale)
    torch.testing.assert_close(graph[:3], ref[:3], atol=1e-5, rtol=1e-5)


@interpreted
def test_the_fixed_shape_landmark_update_equals_the_eager_one():
    batch = Batch([300, 97, 513], 2, 2, 64, 32, landmark="quest")
    read = page_reader(batch.key_cache, batch.value_cache, PS)
    eager = PageLandmarks(batch.sparse, batch.landmarks.num_pages, 2, 64, torch.float32, "cpu")
    fixed = PageLandmarks(batch.sparse, batch.landmarks.num_pages, 2, 64, torch.float32, "cpu")
    slots = torch.cat([batch.slot_mapping, torch.full((5,), -1)])  # vLLM pads with -1
    for part in slots.split(37):
        pages = filled_pages(part, PS)
        if pages.numel():
            eager.update(pages, read(pages)[0])
        fixed.update_slots(part, read, PS)
    for a, b, c in zip(eager.tensors, fixed.tensors, batch.landmarks.tensors):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert fixed.tensors[0].shape[0] == batch.landmarks.num_pages


def test_the_graph_buffers_mark_sparse_requests_and_refuse_a_larger_budget():
    pytest.importorskip("vllm")
    block_table = torch.arange(40, dtype=torch.int32).view(4, 10)
    cm = _common_metadata([1, 1, 1, 1], [300, 40, 100, 80], block_table, torch.arange(4))
    cm.is_prefilling = torch.tensor([False, False, False, True])  # a one-token prompt tail
    from sparrow.vllm.graph_decode import DecodeGraphBuffers

    buffers = DecodeGraphBuffers(8, 4, "cpu")
    plan = buffers.fill(cm, const(64), PS)
    assert plan.budget_pages.tolist() == [4, 0, 4, 0] and plan.stock_seq_lens.tolist() == [1, 40, 1, 80]
    assert plan.budget_pages.data_ptr() == buffers.budget_pages.data_ptr()  # the captured addresses
    assert buffers.fill(cm, parse_schedule("dense"), PS).budget_pages.tolist() == [0, 0, 0, 0]
    with pytest.raises(SparrowError, match="captured for 64"):
        buffers.fill(cm, const(128), PS)


@interpreted
def test_the_triton_paths_on_half_the_kv_heads_are_half_the_whole():
    """Tensor parallelism at the head partition: each half of the KV heads (whole groups) decoded alone, eager and
    fixed-shape, concatenated, is the whole."""
    batch = Batch([300, 97, 513], 4, 2, 64, 32, landmark="quest")
    budget = torch.tensor([4, 3, 6])
    whole = graph_sparse_decode(batch.queries, batch.key_cache, batch.value_cache, batch.block_table,
                                batch.landmarks, batch.seq_lens, budget, batch.sparse, batch.scale, 6)
    halves = []
    for heads in (slice(0, 2), slice(2, 4)):
        marks = PageLandmarks(batch.sparse, batch.landmarks.num_pages, 2, 64, torch.float32, "cpu")
        for mine, full in zip(marks.tensors, batch.landmarks.tensors):
            mine.copy_(full[:, heads])
        args = (batch.queries[:, heads], batch.key_cache[:, :, heads], batch.value_cache[:, :, heads])
        eager = sparse_decode(*args, batch.page_table, marks, batch.seq_lens, budget, batch.sparse, batch.scale)
        graph = graph_sparse_decode(*args, batch.block_table, marks, batch.seq_lens, budget, batch.sparse,
                                    batch.scale, 6)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
        halves.append(graph)
    torch.testing.assert_close(torch.cat(halves, dim=1), whole, atol=1e-5, rtol=1e-5)
