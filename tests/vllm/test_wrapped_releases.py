"""What wrapped.py does for the CUDA backends as vLLM 0.32-0.34 have them (found by scripts/check_vllm_release.py):
an impl that keeps no `attn_type` (FlashInferImpl), and backends that let a model or a fused op write the cache
around `do_kv_cache_update` (FlashAttention and FlashInfer declare `supports_kv_cache_update_bypass` from 0.33).
vLLM's Triton impl (which runs on CPU) stands in for the CUDA-only ones."""

import pytest

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from sparrow.attention import SparseConfig
from sparrow.schedules import const
from sparrow.vllm import env as plugin_env
from sparrow.vllm import state as plugin_state
from sparrow.vllm import wrapped


@pytest.fixture
def active():
    plugin_state.activate(plugin_env.PluginConfig(SparseConfig(), const(64)))
    yield
    plugin_state.activate(None)


class DecoderOnlyImpl(TritonAttentionImpl):
    """As vLLM's FlashInferImpl: takes decoder attention only and keeps no attn_type; offers a fused RoPE + cache
    write."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self.attn_type

    def fused_rope_kvcache_supported(self):
        return True

    def fused_qk_norm_rope_kvcache_supported(self):
        return True


class BypassingBackend(TritonAttentionBackend):
    """As vLLM 0.33's FlashAttentionBackend: a model may write the cache and call attention without key/value."""

    supports_kv_cache_update_bypass = True

    @staticmethod
    def get_impl_cls():
        return DecoderOnlyImpl


def test_an_impl_without_attn_type_is_wrapped_as_decoder_attention(active):
    impl = wrapped.wrap(BypassingBackend).get_impl_cls()(4, 64, 0.125, 2, None, None, "auto")
    assert impl.attn_type == AttentionType.DECODER and impl.sparse == SparseConfig()


def test_every_cache_write_goes_through_do_kv_cache_update(active):
    backend = wrapped.wrap(BypassingBackend)
    impl = backend.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto")
    assert backend.supports_kv_cache_update_bypass is False and backend.forward_includes_kv_cache_update is False
    assert not impl.fused_rope_kvcache_supported() and not impl.fused_qk_norm_rope_kvcache_supported()
