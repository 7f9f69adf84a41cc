"""The GPU path of the vLLM plugin, on CPU: the Triton kernel under Triton's interpreter against its PyTorch
reference and against `paged.reference_decode` (the CUDA backend that runs it: test_vllm_wrapped.py).

Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors with numpy, but only if the variable is set
before `triton.language` is imported: its own helpers (tl.zeros, tl.max, tl.sum) are decorated then. The suite's
conftest imports our models, hence torch._dynamo, which imports triton; so when this module finds triton already
imported without the interpreter, the tests marked `triton_interpreter` here and in test_vllm_graph.py and
test_vllm_wrapped.py run in one child pytest started with TRITON_INTERPRET=1
(`test_the_triton_tests_under_the_interpreter`) and are skipped here.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # for a triton imported from here on
triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from sparrow.attention import SparseConfig
from sparrow.vllm.paged import (
    PageLandmarks,
    filled_pages,
    physical_pages,
    reference_decode,
    select_decode_pages,
)
from tests.reference import reference_paged_attention

INTERPRETED = isinstance(triton.language.standard.zeros, InterpretedFunction)
_SKIP_HERE = pytest.mark.skipif(not INTERPRETED, reason="triton was imported before TRITON_INTERPRET was set; "
                                                        "run in a child by test_the_triton_tests_under_the_interpreter")
if INTERPRETED:
    from sparrow.vllm.triton_decode import page_reader, paged_sparse_attention, sparse_decode

INTERPRETER_FILES = ["test_vllm_triton.py", "test_vllm_graph.py", "test_vllm_wrapped.py"]


def interpreted(test):
    """Mark a test that needs Triton's interpreter: skipped in a process that imported triton without it."""
    return pytest.mark.triton_interpreter(_SKIP_HERE(test))


@pytest.mark.skipif(INTERPRETED, reason="this process runs them itself")
def test_the_triton_tests_under_the_interpreter():
    """The interpreted tests of the three files in one child process with TRITON_INTERPRET=1 (it must be set before
    triton is imported); they must all pass."""
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m",
                          "triton_interpreter", *(str(here / f) for f in INTERPRETER_FILES)],
                         cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-1000:]


PS = 16
GARBAGE = 50.0  # what unwritten cache slots hold: a kernel reading past a request's length would be far off


class Batch:
    """R requests of different lengths (a partial last page each) written into scattered blocks of a vLLM CUDA
    cache [blocks, Hkv, block, 2 D] (`layout` NHD: physical [blocks, block, Hkv, 2 D], vLLM's default; HND:
    contiguous), the landmarks of the full pages kept as the backend keeps them."""

    def __init__(self, lengths, kv_heads, group, dim, block, landmark="centroid", layout="NHD", seed=0,
                 dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.sparse = SparseConfig(landmark=landmark)
        self.lengths, self.kv_heads, self.group, self.dim, self.block = lengths, kv_heads, group, dim, block
        need = [-(-n // block) for n in lengths]
        self.num_blocks = sum(need) + 3
        order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.blocks_of = [order[sum(need[:r]):sum(need[: r + 1])] for r in range(len(lengths))]
        width = max(need)
        self.block_table = torch.tensor([b + [0] * (width - len(b)) for b in self.blocks_of], dtype=torch.int32)
        if layout == "NHD":
            physical = torch.full((self.num_blocks, block, kv_heads, 2 * dim), GARBAGE, dtype=dtype)
            self.kv_cache = physical.transpose(1, 2)
        else:
            self.kv_cache = torch.full((self.num_blocks, kv_heads, block, 2 * dim), GARBAGE, dtype=dtype)
        self.key_cache, self.value_cache = self.kv_cache.transpose(1, 2).split(dim, dim=-1)
        self.keys = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in lengths]
        self.values = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in lengths]
        self.slot_mapping = torch.cat([self.slots(r, torch.arange(n)) for r, n in enumerate(lengths)])
        self.key_cache[self.slot_mapping // block, self.slot_mapping % block] = torch.cat(self.keys)
        self.value_cache[self.slot_mapping // block, self.slot_mapping % block] = torch.cat(self.values)
        self.landmarks = PageLandmarks(self.sparse, self.num_blocks * block // PS, kv_heads, dim, dtype, "cpu")
        pages = filled_pages(self.slot_mapping, PS)
        self.landmarks.update(pages, page_reader(self.key_cache, self.value_cache, PS)(pages)[0])
        self.seq_lens = torch.tensor(lengths)
        self.n_pages = (self.seq_lens + PS - 1) // PS
        self.page_table = physical_pages(self.block_table, int(self.n_pages.max()), block, PS)
        self.queries = torch.randn(len(lengths), kv_heads, group, dim, generator=gen).to(dtype)
        self.scale = dim ** -0.5

    def slots(self, request: int, tokens: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor(self.blocks_of[request])
        return blocks[tokens // self.block] * self.block + tokens % self.block

    def selected(self, budget_pages):
        marks = self.landmarks.gather(self.page_table)
        pages, valid = select_decode_pages(self.queries, marks, self.n_pages, budget_pages, self.sparse)
        return torch.where(valid, pages, -1)


@interpreted
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_the_kernel_equals_its_reference_on_selected_pages(group, dim, block):
    """Centroid and quest selections from `select_decode_pages`, one split and several."""
    for landmark in ("centroid", "quest"):
        batch = Batch([150, 37, 261], 2, group, dim, block, landmark=landmark, seed=group * dim + block)
        budget = torch.tensor([5, 5, 7])
        pages = batch.selected(budget)
        assert (pages >= 0).sum(-1).tolist() == [[5, 5], [3, 3], [7, 7]]  # sparse, and dense where it fits
        ref = reference_paged_attention(batch.queries, batch.key_cache, batch.value_cache, batch.page_table, pages,
                                        batch.seq_lens, PS, batch.scale)
        for splits in (1, 3):
            out = paged_sparse_attention(batch.queries, batch.key_cache, batch.value_cache, batch.page_table, pages,
                                         batch.seq_lens, PS, batch.scale, num_splits=splits)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_sparse_step_equals_the_paged_reference_decode(landmark, layout):
    """Selection + kernel against `paged.reference_decode` reading the same cache: budgets below and above the
    pages held, in either of vLLM's physical layouts."""
    batch = Batch([300, 97, 513, 40], 2, 2, 64, 32, landmark=landmark, layout=layout)
    read = page_reader(batch.key_cache, batch.value_cache, PS)
    dense = reference_decode(batch.queries, read, batch.page_table, batch.landmarks, batch.seq_lens,
                             batch.n_pages, batch.sparse, batch.scale)
    for budget in (torch.tensor([4, 4, 6, 4]), torch.tensor([128, 3, 8, 3])):
        ref = reference_decode(batch.queries, read, batch.page_table, batch.landmarks, batch.seq_lens, budget,
                               batch.sparse, batch.scale)
        out = sparse_decode(batch.queries, batch.key_cache, batch.value_cache, batch.page_table, batch.landmarks,
                            batch.seq_lens, budget, batch.sparse, batch.scale)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        sparse_rows = budget < batch.n_pages
        assert (out[sparse_rows] - dense[sparse_rows]).abs().max() > 1e-3  # sparse rows really attend fewer pages
        torch.testing.assert_close(out[~sparse_rows], dense[~sparse_rows], atol=1e-5, rtol=1e-5)


@interpreted
def test_the_kernel_takes_half_precision():
    batch = Batch([150, 70], 2, 4, 64, 16, dtype=torch.float16)
    pages = batch.selected(torch.tensor([4, 4]))
    out = paged_sparse_attention(batch.queries, batch.key_cache, batch.value_cache, batch.page_table, pages,
                                 batch.seq_lens, PS, batch.scale)
    ref = reference_paged_attention(batch.queries.float(), batch.key_cache.float(), batch.value_cache.float(),
                                    batch.page_table, pages, batch.seq_lens, PS, batch.scale)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


# -- vLLM's per-step metadata, for the CUDA backend's tests -------------------------------------------------


def _common_metadata(query_lens, seq_lens, block_table, slot_mapping):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens), num_actual_tokens=int(starts[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=slot_mapping)
