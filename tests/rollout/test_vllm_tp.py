"""Tensor parallelism at the level of the head partition: a rank holding half the KV heads (whole query groups)
decodes its heads as the whole model does, so the halves concatenated are the whole, in the paged PyTorch reference
and in the compiled CPU kernel. (The Triton kernel's partition is in test_vllm_graph.py; the refusals of layouts
that cannot be exact in test_vllm_plan.py.)"""

import copy

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.cpu import kernel as cpu_kernel
from sparrow.vllm.paged import PageLandmarks, physical_pages, reference_decode
from tests.rollout.test_vllm import _cpu_layout_cache

KV_HEADS, GROUP, DIM, BLOCK = 4, 2, 32, 64


def head_slice(landmarks: PageLandmarks, heads: slice) -> PageLandmarks:
    part = copy.copy(landmarks)
    part.tensors = [m[:, heads].contiguous() for m in landmarks.tensors]
    return part


def paged_batch(landmark, seed=0):
    sparse = SparseConfig(landmark=landmark)
    gen = torch.Generator().manual_seed(seed)
    lengths = [300, 97, 513]
    keys = [torch.randn(KV_HEADS, n, DIM, generator=gen) for n in lengths]
    values = [torch.randn(KV_HEADS, n, DIM, generator=gen) for n in lengths]
    order = torch.randperm(40, generator=gen).tolist()
    blocks_of = [order[0:5], order[5:7], order[7:16]]
    cache = _cpu_layout_cache(keys, values, blocks_of, BLOCK, 40)
    table = torch.tensor([b + [0] * (9 - len(b)) for b in blocks_of])
    seq = torch.tensor(lengths)
    phys = physical_pages(table, int(((seq + 15) // 16).max()), BLOCK, 16)
    marks = PageLandmarks(sparse, 40 * BLOCK // 16, KV_HEADS, DIM, torch.float32, "cpu")
    for k, blocks in zip(keys, blocks_of):
        full = k.shape[1] // 16
        pages = physical_pages(torch.tensor([blocks]), full, BLOCK, 16)[0]
        marks.update(pages, k[:, : full * 16].reshape(KV_HEADS, full, 16, DIM).transpose(0, 1))
    queries = torch.randn(len(lengths), KV_HEADS, GROUP, DIM, generator=gen)
    return sparse, cache, phys, marks, seq, queries


@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_two_ranks_of_whole_groups_decode_as_the_whole_model(landmark):
    from sparrow.vllm.cpu_attention import cpu_page_reader

    sparse, cache, phys, marks, seq, queries = paged_batch(landmark)
    budget = torch.tensor([4, 3, 6])
    halves = (slice(0, 2), slice(2, 4))
    whole = reference_decode(queries, cpu_page_reader(cache, 16), phys, marks, seq, budget, sparse, 0.2)
    parts = [reference_decode(queries[:, h], cpu_page_reader(cache[:, h].contiguous(), 16), phys,
                              head_slice(marks, h), seq, budget, sparse, 0.2) for h in halves]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-6, rtol=1e-6)
    dense = reference_decode(queries, cpu_page_reader(cache, 16), phys, marks, seq, (seq + 15) // 16, sparse, 0.2)
    assert (whole - dense).abs().max() > 1e-3  # the budgets really select
    if cpu_kernel.usable(queries) and sparse.page_landmark.compiled:
        n_pages = (seq + 15) // 16
        kernel = [cpu_kernel.paged_sparse_decode(queries[:, h].contiguous(), cache[:, h].contiguous(), phys,
                                                 head_slice(marks, h).tensors, n_pages, budget, seq, sparse, 0.2)
                  for h in halves]
        torch.testing.assert_close(torch.cat(kernel, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_a_split_group_would_not_be_exact():
    """Why replicated KV heads (more ranks than KV heads) are refused: a rank with half of a group's query heads
    scores the pages with half the queries and selects other pages."""
    sparse, cache, phys, marks, seq, queries = paged_batch("quest", seed=1)
    from sparrow.vllm.cpu_attention import cpu_page_reader

    read = cpu_page_reader(cache, 16)
    budget = torch.tensor([4, 3, 6])
    whole = reference_decode(queries, read, phys, marks, seq, budget, sparse, 0.2)
    half_group = reference_decode(queries[:, :, :1].contiguous(), read, phys, marks, seq, budget, sparse, 0.2)
    assert (half_group - whole[:, :, :1]).abs().max() > 1e-3
