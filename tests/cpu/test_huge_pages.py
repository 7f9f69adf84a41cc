"""Huge pages for KV caches: contents kept, off when asked, one collapse per vLLM cache allocation."""

import pytest
import torch

from sparrow.cpu import huge_pages


def collapse(tensor: torch.Tensor) -> bool:
    return huge_pages.collapse(tensor.data_ptr(), tensor.nbytes)


def test_collapsing_a_tensor_keeps_its_contents():
    tensor = torch.randn(4 << 20)  # 16 MiB: whole huge pages inside it wherever it starts
    before = tensor.clone()
    done = collapse(tensor)
    assert torch.equal(tensor, before)
    assert isinstance(done, bool)


def test_nothing_is_collapsed_below_one_huge_page_or_when_turned_off(monkeypatch):
    assert not collapse(torch.randn(1000))
    monkeypatch.setenv("SPARROW_HUGE_PAGES", "0")
    assert not collapse(torch.randn(4 << 20))
    zeroed = huge_pages.zeros((3, 1 << 20), torch.float32, torch.device("cpu"))
    assert zeroed.shape == (3, 1 << 20) and not zeroed.any()


def test_zeros_are_aligned_to_a_huge_page_and_zero():
    zeroed = huge_pages.zeros((2, 3 << 20), torch.float32, torch.device("cpu"))
    assert not zeroed.any() and zeroed.is_contiguous()
    if huge_pages.enabled():
        assert zeroed.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_the_plugin_collapses_vllms_cache_allocation_once_for_all_its_layer_views(monkeypatch):
    pytest.importorskip("vllm")
    from sparrow.vllm import cpu_attention

    monkeypatch.delenv("SPARROW_HUGE_PAGES", raising=False)
    if not huge_pages.enabled():
        pytest.skip("no madvise here")
    calls = []
    monkeypatch.setattr(cpu_attention.huge_pages, "collapse", lambda start, nbytes: calls.append((start, nbytes)))
    monkeypatch.setattr(cpu_attention, "_HUGE_CACHES", set())
    backing = torch.zeros(2, 4, 3, 16, 128)  # two layers' caches in one allocation, as vLLM allocates them
    for _ in range(3):
        for layer in backing:
            cpu_attention.use_huge_pages(layer)
    assert calls == [(backing.data_ptr(), backing.numel() * 4)]


def test_the_plugin_leaves_vllms_cache_alone_when_huge_pages_are_off(monkeypatch):
    pytest.importorskip("vllm")
    from sparrow.vllm import cpu_attention

    calls = []
    monkeypatch.setattr(cpu_attention.huge_pages, "collapse", lambda start, nbytes: calls.append(start))
    monkeypatch.setattr(cpu_attention, "_HUGE_CACHES", set())
    monkeypatch.setenv("SPARROW_HUGE_PAGES", "0")
    cpu_attention.use_huge_pages(torch.zeros(2, 4, 3, 16, 128)[0])
    assert calls == []


def test_the_plugin_says_how_the_move_of_a_large_cache_went(monkeypatch, capsys):
    pytest.importorskip("vllm")
    from sparrow.vllm import cpu_attention

    monkeypatch.delenv("SPARROW_HUGE_PAGES", raising=False)
    if not huge_pages.enabled():
        pytest.skip("no madvise here")
    monkeypatch.setattr(cpu_attention, "_HUGE_CACHES", set())
    monkeypatch.setattr(cpu_attention.huge_pages, "collapse", lambda start, nbytes: False)
    monkeypatch.setattr(cpu_attention.huge_pages, "last_refusal", lambda: "Cannot allocate memory")
    cpu_attention.use_huge_pages(torch.zeros(2, 1 << 10)[0])  # small: quiet
    assert capsys.readouterr().err == ""
    cpu_attention.use_huge_pages(torch.empty(2, 1 << 28, dtype=torch.uint8)[0])  # 0.5 GiB, never touched
    said = capsys.readouterr().err
    assert "KV cache (0.5 GiB)" in said and "not all moved: Cannot allocate memory" in said
