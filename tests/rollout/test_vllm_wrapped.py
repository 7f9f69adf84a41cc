"""The wrapper of vLLM's CUDA backends (wrapped.py) on CPU: the registration and selection logic with vLLM's registry
(no CUDA-only module imported), and, under Triton's interpreter, vLLM's Triton backend wrapped against the
sub-batch backend of cuda_attention.py on a step with sparse, covered and prefill requests, eager and fixed-shape.

vLLM's Triton kernel does not run on CPU; as in test_vllm_graph.py a dense causal reference reading the metadata it
is given (query starts, cached lengths, block table) stands in for it, in both backends.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.schedules import const
from sparrow.vllm import config as plugin_config
from tests.rollout.test_vllm_triton import INTERPRETED, Batch, _common_metadata, _triton_metadata, interpreted

vllm = pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from sparrow.vllm import cuda_attention, plugin, wrapped
from sparrow.vllm.graph_decode import DecodeGraphBuffers


@pytest.mark.skipif(INTERPRETED, reason="this process runs them itself")
def test_the_wrapper_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not test_the_wrapper_under_the_interpreter"],
                         cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-1000:]


@pytest.fixture
def active():
    plugin_config.activate(plugin_config.PluginConfig(SparseConfig(), const(64)))
    yield plugin_config.active()
    plugin_config.activate(None)


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


# -- the wrapped Triton backend against the sub-batch backend, under the interpreter --------------------------------


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


def _step(lengths, query_lens, prefilling, landmark):
    batch = Batch(lengths, 2, 2, 64, 32, landmark=landmark)
    slots = torch.cat([batch.slots(r, torch.arange(n - q, n)) for r, (n, q) in enumerate(zip(lengths, query_lens))])
    cm = _common_metadata(query_lens, lengths, batch.block_table, slots)
    cm.is_prefilling = torch.tensor(prefilling)
    cm.seq_lens_cpu_upper_bound = cm.seq_lens.clone()
    query = torch.randn(sum(query_lens), 4, 64, generator=torch.Generator().manual_seed(1))
    return batch, cm, query


def _impls(batch):
    current = cuda_attention.SparrowTritonAttentionImpl(4, 64, batch.scale, 2, None, None, "auto")
    mine = wrapped.wrap(TritonAttentionBackend).get_impl_cls()(4, 64, batch.scale, 2, None, None, "auto")
    for impl in (current, mine):
        impl.update_landmarks(batch.kv_cache, batch.slot_mapping)
    return current, mine


@interpreted
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_wrapped_triton_backend_equals_the_sub_batch_backend(active, landmark):
    """Requests 0 and 2 sparse, 1 covered, 3 a prefill chunk of 5 tokens, 4 a one-token prompt tail; layer 3 is
    sparse and layer 0 dense. The wrapped kernel sees the sparse requests as one token long."""
    plugin_config.activate(plugin_config.PluginConfig(SparseConfig(landmark=landmark), const(64)))
    config = plugin_config.active()
    batch, cm, query = _step([300, 40, 513, 80, 200], [1, 1, 1, 5, 1], [False] * 3 + [True] * 2, landmark)
    current, mine = _impls(batch)
    plan, stock_meta = cuda_attention.eager_plan(config, cm, _triton_metadata(cuda_attention, cm), 32)
    assert plan.tokens.tolist() == [0, 2]
    reference = _triton_metadata(cuda_attention, cm, sparse_plan=plan, stock_metadata=stock_meta,
                                 plugin_config=config)
    meta = _builder().build(17, cm)
    assert meta.seq_lens.tolist() == [1, 40, 1, 80, 200] and meta.max_seq_len == 200
    assert meta.sparrow_step.seq_lens.tolist() == [300, 40, 513, 80, 200]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonAttentionImpl, "forward", _stock(batch))
        got = {}
        for layer in (3, 0):
            name = SimpleNamespace(layer_name=f"model.layers.{layer}.self_attn.attn")
            want = current.forward(name, query, None, None, batch.kv_cache, reference, torch.zeros(9, 4, 64))
            got[layer] = mine.forward(name, query, None, None, batch.kv_cache, meta, torch.zeros(9, 4, 64))
            torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)
        dense = _stock(batch)(None, None, query, None, None, None, _triton_metadata(cuda_attention, cm),
                              torch.zeros(9, 4, 64))
    torch.testing.assert_close(got[0], dense, atol=1e-5, rtol=1e-5)  # layer 0: dense for every request
    got = got[3]
    assert (got[[0, 2]] - dense[[0, 2]]).abs().max() > 1e-3  # layer 3's sparse rows really are sparse
    torch.testing.assert_close(got[[1, 3, 4, 5, 6, 7, 8]], dense[[1, 3, 4, 5, 6, 7, 8]], atol=1e-5, rtol=1e-5)
    no_sparse = _common_metadata([1, 5], [40, 80], batch.block_table[1:3], torch.arange(6))
    assert _builder().build(0, no_sparse).sparrow_step is None


@interpreted
@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_the_wrapped_fixed_shape_path_equals_the_eager_one(active, landmark):
    """A uniform decode step (0 and 2 sparse, 1 covered, 3 a one-token prompt tail) through the fixed-shape path
    equals the eager wrapped path and the sub-batch backend's fixed-shape path, in a sparse and a dense layer."""
    plugin_config.activate(plugin_config.PluginConfig(SparseConfig(landmark=landmark), const(64)))
    config = plugin_config.active()
    batch, cm, query = _step([300, 40, 513, 200], [1, 1, 1, 1], [False, False, False, True], landmark)
    current, mine = _impls(batch)
    graph = _builder(DecodeGraphBuffers(8, 4, "cpu")).build(0, cm)
    assert graph.sparrow_step.graph is not None and graph.seq_lens.tolist() == [1, 40, 1, 200]
    eager = _builder().build(0, cm)
    reference = _triton_metadata(cuda_attention, cm, plugin_config=config,
                                 decode_graph=DecodeGraphBuffers(8, 4, "cpu").fill(cm, config.schedule, 16))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonAttentionImpl, "forward", _stock(batch))
        for layer in (3, 0):
            name = SimpleNamespace(layer_name=f"model.layers.{layer}.self_attn.attn")
            got = mine.forward(name, query, None, None, batch.kv_cache, graph, torch.zeros(4, 4, 64))
            want = mine.forward(name, query, None, None, batch.kv_cache, eager, torch.zeros(4, 4, 64))
            old = current.forward(name, query, None, None, batch.kv_cache, reference, torch.zeros(4, 4, 64))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got, old, atol=1e-5, rtol=1e-5)
