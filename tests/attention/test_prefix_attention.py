"""Causal attention after a shared prefix, split at the prefix: the masked SDPA's values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from sparrow.attention import prefix_attention
from sparrow.attention.prefix_attention import prefix_causal_attention
from sparrow.attention.teacher_forced import SharedPrompt
from sparrow.models import load_model


@pytest.mark.parametrize("heads, kv_heads, queries, prefix", [(6, 2, 37, 50), (4, 4, 1, 5), (3, 1, 64, 300)])
def test_split_attention_equals_masked_sdpa_in_values_and_gradients(heads, kv_heads, queries, prefix):
    torch.manual_seed(0)
    q = torch.randn(2, heads, queries, 32, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, prefix + queries, 32, requires_grad=True) for _ in range(2))
    length = prefix + queries
    causal = torch.arange(length) <= torch.arange(prefix, length)[:, None]
    grad = torch.randn(2, heads, queries, 32)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=causal, scale=0.2,
                                          enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad.double())
    got = prefix_causal_attention(q, k, v, 0.2)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5)


def test_split_attention_refuses_queries_without_a_prefix_or_off_cpu_dtypes():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4 queries over 4 keys"):
        prefix_causal_attention(q, k, k, 1.0)
    with pytest.raises(ValueError, match="float64"):
        prefix_causal_attention(q.double(), torch.randn(1, 2, 6, 8).double(), torch.randn(1, 2, 6, 8).double(), 1.0)


def test_dense_completions_after_a_shared_prompt_use_the_split_in_every_layer(monkeypatch):
    """The update's and the monitor's dense forward of completions runs the split attention (no mask), and its
    log-probs equal a plain full forward's."""
    torch.manual_seed(0)
    model, _ = load_model("tiny-llama")
    calls = []
    split = prefix_attention.prefix_causal_attention
    monkeypatch.setattr(prefix_attention, "prefix_causal_attention", lambda *a: calls.append(1) or split(*a))
    ids = torch.randint(3, 200, (3, 30))
    ids[:, :20] = ids[0, :20]
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[:, 19:29], -1)
        got = torch.log_softmax(SharedPrompt(model, ids[:1, :20]).logits(model, ids, 20), -1)
    assert len(calls) == model.config.num_hidden_layers
    assert torch.allclose(got, full, atol=1e-5)
