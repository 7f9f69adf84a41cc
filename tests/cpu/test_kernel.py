"""The compiled kernel's build lock: a build killed midway (torch's `lock` file left behind) is detected and redone
instead of hanging every later run; waiting for a live build is bounded. No real compile: torch's build is faked.
The last test builds the kernel for real: its two page readers (contiguous, vLLM's paged) agree on one cache."""

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from sparrow.attention import SparseConfig
from sparrow.attention.landmarks import LANDMARKS
from sparrow.cpu import kernel as cpu_kernel

_fork = multiprocessing.get_context("fork")


def _killed_build(build_dir: Path) -> None:
    """What a kill during torch's first build leaves: its baton and partial outputs."""
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    (build_dir / "sparse_decode.o").write_bytes(b"\x7fELF partial")
    (build_dir / "build.ninja").write_text("rule cxx\n")


def test_a_killed_builds_lock_is_detected_and_its_partial_build_removed(tmp_path):
    build_dir = tmp_path / "sparrow_sparse_decode"
    _killed_build(build_dir)
    messages = []
    with cpu_kernel.build_guard(build_dir, wait_s=1.0, log=messages.append) as free:
        assert free and sorted(p.name for p in build_dir.iterdir()) == ["sparrow-build.lock"]
    assert len(messages) == 1 and messages[0].startswith(f"removing {build_dir / 'lock'} and the partial build")
    with cpu_kernel.build_guard(build_dir, wait_s=1.0, log=messages.append) as free:
        assert free
    assert len(messages) == 1  # an intact build directory is left alone


def _hold_build_lock(build_dir, ready):
    with cpu_kernel.build_guard(build_dir, wait_s=1.0, log=lambda _: None):
        (build_dir / "lock").touch()  # torch's baton of this live build
        ready.send(True)
        time.sleep(60)


def test_waiting_for_a_live_build_is_bounded_and_says_who_builds(tmp_path):
    receive, send = _fork.Pipe(duplex=False)
    holder = _fork.Process(target=_hold_build_lock, args=(tmp_path, send), daemon=True)
    holder.start()
    try:
        assert receive.poll(10)
        messages = []
        began = time.perf_counter()
        with cpu_kernel.build_guard(tmp_path, wait_s=0.3, log=messages.append) as free:
            assert not free
        assert 0.3 <= time.perf_counter() - began < 2
        assert messages == [f"waiting for pid {holder.pid} to finish building the CPU kernel in {tmp_path} "
                            "(at most 0.3 s)"]
        assert (tmp_path / "lock").exists()  # a live build's baton is not touched
    finally:
        holder.kill()
        holder.join()
    with cpu_kernel.build_guard(tmp_path, wait_s=0.3, log=messages.append) as free:
        assert free and not (tmp_path / "lock").exists()  # the holder died: now its baton is stale


def test_each_cpu_model_and_feature_set_gets_a_build_of_its_own():
    avx512 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\n"
    same = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: avx512f avx2 fpu sse2\nbogomips\t: 4000\n"
    avx2 = avx512.replace(" avx512f", "")
    other_model = avx512.replace("AMD EPYC", "Intel Xeon")
    names = {cpu_kernel.build_name(text) for text in (avx512, same, avx2, other_model)}
    assert cpu_kernel.build_name(avx512) == cpu_kernel.build_name(same) and len(names) == 3
    assert all(name.startswith("sparrow_sparse_decode_") and name.isidentifier() for name in names)


def test_load_builds_past_a_stale_lock_instead_of_waiting_forever(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SPARROW_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_module", None)
    _killed_build(tmp_path / cpu_kernel.build_name())
    built = object()

    def torch_load(name, build_directory, **_):
        if os.path.exists(os.path.join(build_directory, "lock")):  # torch's FileBaton.wait() would spin forever
            raise AssertionError("torch would wait forever on the stale lock")
        return built

    monkeypatch.setattr(torch.utils.cpp_extension, "load", torch_load)
    assert cpu_kernel.load() is built


def test_a_build_lock_held_too_long_falls_back_to_pytorch_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SPARROW_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "BUILD_WAIT_S", 0.2)
    receive, send = _fork.Pipe(duplex=False)
    holder = _fork.Process(target=_hold_build_lock, args=(tmp_path / cpu_kernel.build_name(), send), daemon=True)
    (tmp_path / cpu_kernel.build_name()).mkdir()
    holder.start()
    try:
        assert receive.poll(10)
        with pytest.warns(UserWarning, match=r"using the PyTorch path \(another process has held the build lock of "
                                             r".*sparrow_sparse_decode_[0-9a-f]+ for over 0.2 s\)"):
            assert cpu_kernel.load() is None
    finally:
        holder.kill()
        holder.join()


def _as_paged(keys, values, marks, block):
    """The native cache (keys/values [R, H, P, S, D], marks [R, H, P, D]) laid out as vLLM's CPU cache
    [blocks, H, block, 2 D] (per (block, head) keys channel-major, then values), its pages scattered."""
    rows, heads, pages, size, dim = keys.shape
    per = block // size
    phys = torch.randperm(rows * pages).view(rows, pages)
    cache = torch.zeros(rows * pages // per, heads, 2 * block * dim)
    paged_marks = [torch.zeros(rows * pages, heads, dim) for _ in marks]
    for r in range(rows):
        for p in range(pages):
            b, at = divmod(int(phys[r, p]), per)
            slab = cache[b].view(heads, 2, block * dim)
            slab[:, 0].view(heads, dim, block)[:, :, at * size:(at + 1) * size] = keys[r, :, p].transpose(-1, -2)
            slab[:, 1].view(heads, block, dim)[:, at * size:(at + 1) * size] = values[r, :, p]
            for store, mark in zip(paged_marks, marks):
                store[phys[r, p]] = mark[r, :, p]
    return cache.view(-1, heads, block, 2 * dim), phys, paged_marks


@pytest.mark.parametrize("landmark", LANDMARKS)
@pytest.mark.parametrize("dim", [64, 24, 128])
@pytest.mark.parametrize("page, group", [(4, 2), (16, 3), (16, 5)])  # pages of 16: the paged reader's fast path
def test_the_paged_and_contiguous_readers_decode_one_cache_alike(landmark, dim, page, group):
    if cpu_kernel.load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    torch.manual_seed(0)
    sparse = SparseConfig(page_size=page, landmark=landmark)
    rows, heads, pages = 3, 2, 10
    keys, values = torch.randn(rows, heads, pages, page, dim), torch.randn(rows, heads, pages, page, dim)
    marks = sparse.page_landmark.build(keys)
    # full, a partial last page, a row of 4 pages (dense: within its budget)
    total = torch.tensor([10 * page, 9 * page + 1, 3 * page + 1])
    n_pages, budget = (total + page - 1) // page, torch.tensor([5, 6, 5])
    queries = torch.randn(rows, heads, group, dim)
    want = cpu_kernel.sparse_decode(queries, keys, values, marks, n_pages, budget, total, sparse, 0.3)
    cache, phys, paged_marks = _as_paged(keys, values, marks, block=2 * page)
    got = cpu_kernel.paged_sparse_decode(queries, cache, phys, paged_marks, n_pages, budget, total, sparse, 0.3)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("page, group, span", [(16, 3, 5), (16, 3, 9), (16, 4, 17), (4, 3, 5)])
def test_the_span_step_is_causal_attention_over_each_rows_cache(dim, page, group, span):
    """The verification's attention (group x span query rows per KV head; more than 16 rows take several passes)
    equals softmax attention of token s of the span over the row's first total - (span - 1 - s) tokens."""
    if cpu_kernel.load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    torch.manual_seed(0)
    sparse = SparseConfig(page_size=page)
    rows, heads, pages = 3, 2, 9
    keys, values = torch.randn(rows, heads, pages, page, dim), torch.randn(rows, heads, pages, page, dim)
    total = torch.tensor([9 * page, 7 * page + 3, span + 1])  # full, a partial last page, little more than the span
    n_pages = (total + page - 1) // page
    queries = torch.randn(rows, heads, group * span, dim)
    got = cpu_kernel.span_decode(queries, keys, values, sparse.page_landmark.build(keys), n_pages, total, span,
                                 sparse, 0.3)
    flat_k, flat_v = keys.flatten(2, 3), values.flatten(2, 3)  # [rows, heads, tokens, dim]
    for r in range(rows):
        for row in range(group * span):
            seen = int(total[r]) - (span - 1 - row % span)
            weights = torch.softmax(0.3 * queries[r, :, row, None] @ flat_k[r, :, :seen].transpose(-1, -2), dim=-1)
            want = (weights @ flat_v[r, :, :seen])[:, 0]  # [heads, dim]
            assert torch.allclose(got[r, :, row], want, atol=1e-5), (r, row)


@pytest.mark.parametrize("landmark", LANDMARKS)
@pytest.mark.parametrize("dim, page, group, offset", [(64, 16, 3, 0), (24, 4, 2, 37), (64, 16, 5, 100)])
def test_teacher_forcing_through_the_kernel_equals_the_masked_pytorch_path(landmark, dim, page, group, offset,
                                                                         monkeypatch):
    """Every position one decode step through the page-table reader: the same pages and outputs as the masked
    SDPA path, prompt positions dense, with the first `offset` positions given only as keys (a shared prompt)."""
    from sparrow.attention.kernels import teacher_forced_attention

    if cpu_kernel.load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    torch.manual_seed(1)
    sparse = SparseConfig(page_size=page, landmark=landmark, dense_layers=[])
    rows, kv_heads, length = 3, 2, 230
    query = torch.randn(rows, kv_heads * group, length - offset, dim)
    key, value = torch.randn(rows, kv_heads, length, dim), torch.randn(rows, kv_heads, length, dim)
    budget = torch.randint(3, 9, (rows, length - offset))
    prompts = torch.tensor([offset + 20, 120, 0])
    calls, kernel = [], cpu_kernel.paged_sparse_decode
    monkeypatch.setattr(cpu_kernel, "paged_sparse_decode", lambda *args: calls.append(1) or kernel(*args))
    outputs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARROW_CPU_KERNEL", flag)
        outputs[flag] = teacher_forced_attention(query, key, value, 3, sparse, budget, prompts, 0.2, chunk=64)
        assert bool(calls) == (flag == "1")
    assert outputs["1"].shape == (rows, length - offset, kv_heads * group, dim)
    assert (outputs["1"] - outputs["0"]).abs().max() <= 1e-5


def test_a_build_from_another_checkouts_sources_is_announced_as_a_build(tmp_path):
    assert cpu_kernel.needs_build(tmp_path)  # nothing built
    (tmp_path / "kernel.so").write_bytes(b"\x7fELF")
    ours = "\n".join(f"build x.o: compile {source}" for source in cpu_kernel._SOURCES)
    (tmp_path / "build.ninja").write_text(ours.replace(str(Path(cpu_kernel.__file__).parent), "/tmp/other/checkout"))
    assert cpu_kernel.needs_build(tmp_path)  # torch would rebuild it silently: paths differ
    (tmp_path / "build.ninja").write_text(ours)
    assert not cpu_kernel.needs_build(tmp_path)
