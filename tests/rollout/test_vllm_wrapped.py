"""The wrapper of vLLM's CUDA backends (wrapped.py) on CPU: the registration and selection logic with vLLM's registry
(no CUDA-only module imported), the builder's plan and the metadata it gives the wrapped builder, the impl's
refusals and landmarks, and, under Triton's interpreter, vLLM's Triton backend wrapped against the PyTorch
references (`paged.reference_decode` for the sparse rows, dense causal attention for the others and for dense
layers) on steps with sparse, covered, prefill-chunk and prompt-tail requests, eager and fixed-shape.

vLLM's Triton kernel does not run on CPU; a dense causal reference reading the metadata it is given (query starts,
cached lengths, block table) stands in for it.
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.schedules import const
from sparrow.vllm import env as plugin_env
from sparrow.vllm import state as plugin_state
from sparrow.vllm.paged import reference_decode
from tests.rollout.test_vllm_triton import (
    PS,
    Batch,
    _common_metadata,
    interpreted,
)

vllm = pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from sparrow.vllm import plugin, wrapped
from sparrow.vllm.graph_decode import DecodeGraphBuffers
from sparrow.vllm.triton_decode import page_reader


@pytest.fixture
def active():
    plugin_state.activate(plugin_env.PluginConfig(SparseConfig(), const(64)))
    yield plugin_state.active()
    plugin_state.activate(None)


# -- selection: which backend is wrapped for which vLLM choice -----------------------------------------------------


def test_the_plugin_registers_a_wrapper_over_each_backend_vllm_picks_on_cuda(monkeypatch, active):
    from vllm.platforms import current_platform

    monkeypatch.setattr(plugin, "from_environment", lambda: active)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    try:
        plugin.register()
        for member in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
            assert AttentionBackendEnum[member].get_path() == f"sparrow.vllm.wrapped.Sparrow_{member}"
        backend = AttentionBackendEnum.TRITON_ATTN.get_class()
    finally:
        for member in wrapped.WRAPPED:
            AttentionBackendEnum[member].clear_override()
    assert issubclass(backend, TritonAttentionBackend) and backend.wrapped is TritonAttentionBackend
    assert backend.get_name() == "TRITON_ATTN"  # what vLLM compares names against stays vLLM's
    module, name = backend.full_cls_name()
    assert getattr(sys.modules[module], name) is backend  # vLLM resolves the path it returns
    assert issubclass(backend.get_builder_cls(), TritonAttentionMetadataBuilder)
    assert issubclass(backend.get_impl_cls(), TritonAttentionImpl)
    assert backend.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_each_wrapper_wraps_vllms_class_for_its_member_and_validates_as_it(monkeypatch):
    """The wrapper of a member wraps the class at the member's own path (not the override: ours), made only when
    asked for; it validates as the wrapped class, so vLLM's priority order picks the backend it would have."""
    asked = []

    def resolve(path):
        asked.append(path)
        return _stub_backend(AttentionCGSupport.ALWAYS)

    monkeypatch.setattr(wrapped, "resolve_obj_by_qualname", resolve)
    wrapped._wrapper.cache_clear()
    try:
        for member in ("FLASH_ATTN", "FLASHINFER"):
            backend = getattr(wrapped, f"Sparrow_{member}")
            assert asked[-1] == AttentionBackendEnum[member].value
            assert backend.validate_configuration.__func__ is backend.wrapped.validate_configuration.__func__
            assert getattr(wrapped, f"Sparrow_{member}") is backend
    finally:
        wrapped._wrapper.cache_clear()
    assert len(asked) == 2
    with pytest.raises(AttributeError):
        wrapped.Sparrow_CPU_ATTN  # noqa: B018
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    wrapper = wrapped.wrap(TritonAttentionBackend)
    for dtype, head_size in (("auto", 64), ("fp8", 64), ("auto", 16)):  # fp8 reaches the impl, which refuses it
        config = AttentionSelectorConfig(head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=dtype,
                                         block_size=16)._asdict()
        reasons = wrapper.validate_configuration(device_capability=DeviceCapability(9, 0), **config)
        assert reasons == TritonAttentionBackend.validate_configuration(device_capability=DeviceCapability(9, 0),
                                                                        **config)
        assert bool(reasons) == (head_size == 16)
    for dtype in (torch.float32, torch.bfloat16):  # where vLLM would pick FlashAttention, Triton validates too
        for block in (16, 32):
            config = AttentionSelectorConfig(head_size=64, dtype=dtype, kv_cache_dtype="auto", block_size=block)
            assert wrapper.validate_configuration(device_capability=DeviceCapability(9, 0), **config._asdict()) == []


def test_importing_the_wrapper_module_imports_no_cuda_backend():
    code = ("import sys, sparrow.vllm.wrapped; "
            "print(any(m in sys.modules for m in ('vllm.v1.attention.backends.flash_attn', "
            "'vllm.v1.attention.backends.flashinfer')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("False"), run.stdout + run.stderr[-2000:]


def _stub_backend(support: AttentionCGSupport) -> type:
    builder = type("StubBuilder", (AttentionMetadataBuilder,), {"_cudagraph_support": support})
    return type("StubBackend", (AttentionBackend,), {"get_builder_cls": staticmethod(lambda: builder),
                                                     "get_impl_cls": staticmethod(lambda: object)})


@pytest.mark.parametrize(("theirs", "declared"), [
    ("ALWAYS", "UNIFORM_SINGLE_TOKEN_DECODE"), ("UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE"),
    ("UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_SINGLE_TOKEN_DECODE"), ("NEVER", "NEVER")])
def test_the_wrapper_declares_the_lower_cuda_graph_support(theirs, declared):
    backend = wrapped.wrap(_stub_backend(AttentionCGSupport[theirs]))
    assert backend.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport[declared]


# -- the builder and the impl without a kernel ----------------------------------------------------------------------


def _stock(batch):
    """Dense causal attention of each request of the metadata over its cached tokens: vLLM's kernel, stood in."""

    def forward(self, layer, query, key, value, kv_cache, meta, output, *args):
        starts, block = meta.query_start_loc.tolist(), batch.block
        for r in range(len(starts) - 1):
            length, n = int(meta.seq_lens[r]), starts[r + 1] - starts[r]
            pos = torch.arange(length)
            slots = meta.block_table[r, pos // block].long() * block + pos % block
            keys = batch.key_cache[slots // block, slots % block].transpose(0, 1)  # [Hkv, L, D]
            values = batch.value_cache[slots // block, slots % block].transpose(0, 1)
            q = query[starts[r]:starts[r + 1]].view(n, batch.kv_heads, batch.group, batch.dim).permute(1, 2, 0, 3)
            mask = pos <= (length - n + torch.arange(n)).view(-1, 1)
            out = torch.nn.functional.scaled_dot_product_attention(q, keys.unsqueeze(1), values.unsqueeze(1),
                                                                   attn_mask=mask, scale=batch.scale)
            output[starts[r]:starts[r + 1]] = out.permute(2, 0, 1, 3).reshape(n, *output.shape[1:])
        return output

    return forward


def _builder(graph_buffers=None):
    """The wrapped Triton builder without a vLLM engine: the attributes its build reads."""
    builder = object.__new__(wrapped.wrap(TritonAttentionBackend).get_builder_cls())
    segments = torch.empty(0)
    builder.__dict__.update(seq_threshold_3D=8, num_par_softmax_segments=16, softmax_segm_output=segments,
                            softmax_segm_max=segments, softmax_segm_expsum=segments, max_seqs_64_segments=0,
                            rswa_window=None, graph_buffers=graph_buffers, sparrow_block_size=32)
    return builder


def _impl(batch):
    return wrapped.wrap(TritonAttentionBackend).get_impl_cls()(4, 64, batch.scale, 2, None, None, "auto")


def _layer(index: int) -> SimpleNamespace:
    return SimpleNamespace(layer_name=f"model.layers.{index}.self_attn.attn")


def test_the_builder_sends_long_decodes_to_our_kernel_and_the_wrapped_builder_one_token_of_them(active):
    """Budget 64 tokens = 4 pages: requests 0 and 2 decode sparsely; request 1 (3 pages) decodes densely and
    request 3 is a prefill chunk of 5 tokens. The wrapped builder gets the whole batch once, the sparse requests'
    cached lengths 1 on the device and the host, no cascade prefix; our kernel the sparse requests' pages."""
    block_table = torch.arange(40, dtype=torch.int32).view(4, 10)
    cm = _common_metadata([1, 1, 1, 5], [300, 40, 100, 80], block_table, torch.arange(8))
    cm.seq_lens_cpu_upper_bound = cm.seq_lens.clone()
    given, build = [], TritonAttentionMetadataBuilder.build

    def spy(self, common_prefix_len, common_attn_metadata, fast_build=False):
        given.append((common_prefix_len, common_attn_metadata))
        return build(self, common_prefix_len, common_attn_metadata, fast_build)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonAttentionMetadataBuilder, "build", spy)
        meta = _builder().build(17, cm)
        assert _builder().build(0, _common_metadata([1, 5], [40, 80], block_table[:2], torch.arange(6))
                                ).sparrow_step is None  # no sparse request: the wrapped builder's metadata alone
    plan = meta.sparrow_step.plan
    assert plan.tokens.tolist() == [0, 2]
    assert plan.seq_lens.tolist() == [300, 100] and plan.budget_pages.tolist() == [4, 4]
    assert plan.page_table.shape == (2, 19)
    assert plan.page_table[1, :7].tolist() == [40, 41, 42, 43, 44, 45, 46]  # request 2: blocks 20.. of 2 pages
    assert plan.stock is None  # no sub-batch: the wrapped builder takes the whole batch
    prefix, theirs = given[0]
    assert len(given) == 2 and prefix == 0
    assert theirs.seq_lens.tolist() == [1, 40, 1, 80] and theirs.seq_lens_cpu_upper_bound.tolist() == [1, 40, 1, 80]
    assert theirs.max_seq_len == 80 and cm.seq_lens.tolist() == [300, 40, 100, 80]  # the step's own is unchanged
    assert meta.seq_lens.tolist() == [1, 40, 1, 80] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 8]
    assert meta.block_table is block_table and meta.slot_mapping.tolist() == list(range(8))
    assert (meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (8, 5, 80)
    assert meta.sparrow_step.seq_lens.tolist() == [300, 40, 100, 80]
    assert meta.sparrow_step.block_table is block_table


def test_the_wrapped_impl_refuses_attention_it_cannot_make_sparse(active):
    impl = wrapped.wrap(TritonAttentionBackend).get_impl_cls()
    with pytest.raises(SparrowError, match="a sliding window, a logit soft cap"):
        impl(4, 64, 0.125, 2, None, 128, "auto", logits_soft_cap=30.0)
    with pytest.raises(SparrowError, match=r"a quantized KV cache \(fp8\)"):
        impl(4, 64, 0.125, 2, None, None, "fp8")


# -- the wrapped Triton backend against the PyTorch references, under the interpreter ------------------------------


def _step(lengths, query_lens, prefilling, landmark):
    batch = Batch(lengths, 2, 2, 64, 32, landmark=landmark)
    slots = torch.cat([batch.slots(r, torch.arange(n - q, n)) for r, (n, q) in enumerate(zip(lengths, query_lens))])
    cm = _common_metadata(query_lens, lengths, batch.block_table, slots)
    cm.is_prefilling = torch.tensor(prefilling)
    cm.seq_lens_cpu_upper_bound = cm.seq_lens.clone()
    query = torch.randn(sum(query_lens), 4, 64, generator=torch.Generator().manual_seed(1))
    return batch, cm, query


def _dense(batch, cm, query):
    """Dense causal attention of every token of the step over its request's true cached length."""
    meta = SimpleNamespace(query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens, block_table=cm.block_table_tensor)
    return _stock(batch)(None, None, query, None, None, None, meta, torch.zeros(query.shape))


def _check_layer(got, layer, batch, cm, query, tokens, rows):
    """Layer 0 (dense) is dense causal attention for every token. In layer 3 the tokens `tokens` of the sparse
    requests `rows` are `paged.reference_decode` at the budget of 64 tokens (4 pages), really sparse, and the other
    tokens dense causal attention."""
    dense = _dense(batch, cm, query)
    if layer == 0:
        torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
        return
    queries = query[tokens].view(len(tokens), batch.kv_heads, batch.group, batch.dim)
    ref = reference_decode(queries, page_reader(batch.key_cache, batch.value_cache, PS), batch.page_table[rows],
                           batch.landmarks, batch.seq_lens[rows], torch.full((len(rows),), 4), batch.sparse,
                           batch.scale)
    torch.testing.assert_close(got[tokens], ref.reshape(len(tokens), 4, 64), atol=1e-5, rtol=1e-5)
    assert (got[tokens] - dense[tokens]).abs().max() > 1e-3  # the sparse rows really are sparse
    others = [t for t in range(got.shape[0]) if t not in tokens]
    torch.testing.assert_close(got[others], dense[others], atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_wrapped_impl_keeps_landmarks_and_decodes_as_the_reference(active, landmark):
    """The impl's landmarks from the cache as slots are written (prompt, then one decode token per request); its
    forward on a batch of sparse decodes equals `paged.reference_decode` at the budget in a sparse layer and over
    every page in a dense one; a step without a sparse request is the wrapped kernel's alone."""
    plugin_state.activate(plugin_env.PluginConfig(SparseConfig(landmark=landmark), const(64)))
    batch = Batch([300, 97, 513], 2, 2, 64, 32, landmark=landmark)
    impl = _impl(batch)
    prompt = torch.cat([batch.slots(r, torch.arange(n - 1)) for r, n in enumerate(batch.lengths)])
    impl.update_landmarks(batch.kv_cache, prompt)
    last = torch.stack([batch.slots(r, torch.tensor(n - 1)) for r, n in enumerate(batch.lengths)])
    impl.update_landmarks(batch.kv_cache, last)  # request 1's token 96 fills its page 5
    for store, mine in zip(batch.landmarks.tensors, impl.landmarks.tensors):
        torch.testing.assert_close(mine, store)
    cm = _common_metadata([1, 1, 1], batch.lengths, batch.block_table, last)
    meta = _builder().build(0, cm)
    plan = meta.sparrow_step.plan
    assert plan.tokens.tolist() == [0, 1, 2] and meta.seq_lens.tolist() == [1, 1, 1]
    query = batch.queries.reshape(3, 4, 64)
    read = page_reader(batch.key_cache, batch.value_cache, PS)

    def stock(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        return output.fill_(7.0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonAttentionImpl, "forward", stock)
        sparse = impl.forward(_layer(3), query, None, None, batch.kv_cache, meta, torch.zeros(3, 4, 64))
        dense = impl.forward(_layer(1), query, None, None, batch.kv_cache, meta, torch.zeros(3, 4, 64))
        plugin_state.activate(plugin_env.PluginConfig(SparseConfig(landmark=landmark), const(1024)))
        covered = _builder().build(0, cm)
        stock_only = impl.forward(_layer(3), query, None, None, batch.kv_cache, covered, torch.zeros(3, 4, 64))
    ref = reference_decode(batch.queries, read, batch.page_table, batch.landmarks, batch.seq_lens, plan.budget_pages,
                           batch.sparse, batch.scale)
    torch.testing.assert_close(sparse.view(3, 2, 2, 64), ref, atol=1e-5, rtol=1e-5)
    ref = reference_decode(batch.queries, read, batch.page_table, batch.landmarks, batch.seq_lens, batch.n_pages,
                           batch.sparse, batch.scale)
    torch.testing.assert_close(dense.view(3, 2, 2, 64), ref, atol=1e-5, rtol=1e-5)  # a dense layer: every page
    assert covered.sparrow_step is None and bool((stock_only == 7.0).all())  # covered: the wrapped kernel's whole


@interpreted
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_wrapped_triton_backend_equals_the_references(active, landmark):
    """Requests 0 and 2 sparse, 1 covered, 3 a prefill chunk of 5 tokens, 4 a one-token prompt tail; layer 3 is
    sparse and layer 0 dense. The wrapped kernel sees the sparse requests as one token long."""
    plugin_state.activate(plugin_env.PluginConfig(SparseConfig(landmark=landmark), const(64)))
    batch, cm, query = _step([300, 40, 513, 80, 200], [1, 1, 1, 5, 1], [False] * 3 + [True] * 2, landmark)
    impl = _impl(batch)
    impl.update_landmarks(batch.kv_cache, batch.slot_mapping)
    meta = _builder().build(17, cm)
    assert meta.sparrow_step.plan.tokens.tolist() == [0, 2]
    assert meta.seq_lens.tolist() == [1, 40, 1, 80, 200] and meta.max_seq_len == 200
    assert meta.sparrow_step.seq_lens.tolist() == [300, 40, 513, 80, 200]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonAttentionImpl, "forward", _stock(batch))
        for layer in (3, 0):
            got = impl.forward(_layer(layer), query, None, None, batch.kv_cache, meta, torch.zeros(9, 4, 64))
            _check_layer(got, layer, batch, cm, query, [0, 2], [0, 2])
    no_sparse = _common_metadata([1, 5], [40, 80], batch.block_table[1:3], torch.arange(6))
    assert _builder().build(0, no_sparse).sparrow_step is None


@interpreted
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_wrapped_fixed_shape_path_equals_the_eager_one_and_the_references(active, landmark):
    """A uniform decode step (0 and 2 sparse, 1 covered, 3 a one-token prompt tail) through the fixed-shape path
    equals the eager wrapped path and the references, in a sparse and a dense layer."""
    plugin_state.activate(plugin_env.PluginConfig(SparseConfig(landmark=landmark), const(64)))
    batch, cm, query = _step([300, 40, 513, 200], [1, 1, 1, 1], [False, False, False, True], landmark)
    impl = _impl(batch)
    impl.update_landmarks(batch.kv_cache, batch.slot_mapping)
    graph = _builder(DecodeGraphBuffers(8, 4, "cpu")).build(0, cm)
    assert graph.sparrow_step.graph is not None and graph.seq_lens.tolist() == [1, 40, 1, 200]
    assert graph.sparrow_step.graph.budget_pages.tolist() == [4, 0, 4, 0]
    eager = _builder().build(0, cm)
    assert eager.sparrow_step.graph is None and eager.sparrow_step.plan.tokens.tolist() == [0, 2]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonAttentionImpl, "forward", _stock(batch))
        for layer in (3, 0):
            got = impl.forward(_layer(layer), query, None, None, batch.kv_cache, graph, torch.zeros(4, 4, 64))
            want = impl.forward(_layer(layer), query, None, None, batch.kv_cache, eager, torch.zeros(4, 4, 64))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            _check_layer(got, layer, batch, cm, query, [0, 2], [0, 2])
