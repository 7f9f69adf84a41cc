"""The page-selection rule and landmark scores, pinned on small hand-made inputs; the landmark registry's costs."""

import types

import pytest
import torch

from sparrow.attention import (
    KVCache,
    SparseConfig,
    centroid_scores,
    quest_scores,
    select_pages,
)
from sparrow.attention.landmarks import LANDMARKS, REGISTRY, get_landmark
from sparrow.bench import kv_bytes_per_step
from sparrow.errors import SparrowError
from sparrow.measure.cost_model import ModelDims, Pricing, hardware, trajectory_cost
from sparrow.schedules import const


def _chosen(pages, valid):
    return sorted(p for p, v in zip(pages.tolist(), valid.tolist()) if v)


def test_sink_and_recent_pages_are_kept_even_with_the_lowest_scores():
    scores = torch.tensor([-9.0, 5.0, 4.0, 3.0, 2.0, 1.0, -8.0, -7.0])  # sink and recent score lowest
    pages, valid = select_pages(scores, torch.tensor(8), torch.tensor(5), sink_pages=1, recent_pages=2)
    assert _chosen(pages, valid) == [0, 1, 2, 6, 7]


def test_top_scoring_middle_pages_fill_the_rest_of_the_budget():
    scores = torch.tensor([0.0, 1.0, 9.0, 3.0, 8.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    pages, valid = select_pages(scores, torch.tensor(10), torch.tensor(5), 1, 2)
    assert _chosen(pages, valid) == [0, 2, 4, 8, 9]


def test_no_more_pages_than_budget_means_every_page():
    scores = torch.randn(6)
    pages, valid = select_pages(scores, torch.tensor(6), torch.tensor(8), 1, 2)
    assert _chosen(pages, valid) == list(range(6))


def test_pages_beyond_a_rows_length_are_never_chosen():
    scores = torch.tensor([[0.0, 5.0, 9.0, 9.0, 9.0, 9.0], [0.0, 5.0, 9.0, 1.0, 2.0, 3.0]])
    pages, valid = select_pages(scores, torch.tensor([4, 6]), torch.tensor([4, 4]), 1, 2)
    assert _chosen(pages[0], valid[0]) == [0, 1, 2, 3]
    assert _chosen(pages[1], valid[1]) == [0, 2, 4, 5]


def test_each_row_gets_its_own_budget_in_a_mixed_batch():
    scores = torch.arange(20.0).repeat(3, 1)
    pages, valid = select_pages(scores, torch.tensor([20, 20, 20]), torch.tensor([3, 5, 8]), 1, 2)
    assert valid.sum(-1).tolist() == [3, 5, 8]
    assert _chosen(pages[0], valid[0]) == [0, 18, 19]
    assert _chosen(pages[1], valid[1]) == [0, 16, 17, 18, 19]


def test_kv_heads_choose_independently():
    scores = torch.tensor([[0.0, 9.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0, 0.0, 0.0]])  # [Hkv, P]
    pages, valid = select_pages(scores, torch.tensor(6), torch.tensor(4), 1, 2)
    assert _chosen(pages[0], valid[0]) == [0, 1, 4, 5]
    assert _chosen(pages[1], valid[1]) == [0, 3, 4, 5]


def test_centroid_score_uses_the_group_mean_query():
    q = torch.tensor([[1.0, 0.0], [0.0, 3.0]]).view(1, 1, 1, 2, 2)  # two query heads in one group
    centroids = torch.tensor([[2.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    assert centroid_scores(q, centroids).flatten().tolist() == [1.0, 1.5]


def test_quest_score_is_the_per_head_upper_bound_maximized_over_the_group():
    q = torch.tensor([[1.0, -1.0], [-2.0, 0.0]]).view(1, 1, 1, 2, 2)
    keys = torch.randn(5, 2)
    kmin, kmax = keys.min(0).values.view(1, 1, 1, 2), keys.max(0).values.view(1, 1, 1, 2)
    got = quest_scores(q, kmin, kmax).item()
    bound = [sum(max(qc * lo, qc * hi) for qc, lo, hi in zip(head, kmin.flatten(), kmax.flatten()))
             for head in q.view(2, 2).tolist()]
    assert abs(got - max(bound)) < 1e-6
    assert got >= (q.view(2, 2) @ keys.T).max().item() - 1e-6  # an upper bound of every true score


def test_landmarks_are_finished_when_a_page_fills_and_match_the_page_keys():
    for landmark in LANDMARKS:
        sparse = SparseConfig(page_size=4, landmark=landmark)
        cache = KVCache(1, 2, 1, 3, 16, sparse, torch.float32, torch.device("cpu"))
        assert len(cache.landmarks[0]) == REGISTRY[landmark].tensors
        keys = torch.randn(2, 11, 3)
        cache.write_prompt(0, torch.tensor([0, 1]), keys[0, :5].view(1, 5, 3), keys[0, :5].view(1, 5, 3))
        cache.lengths[:] = 5
        for t in range(5, 11):
            step = cache.begin_step(None)
            cache.write_token(0, keys[0, t].expand(2, 1, 3), keys[0, t].expand(2, 1, 3), step)
            cache.lengths += 1
        pages = keys[0, :8].view(2, 4, 3)
        expected = [pages.mean(1)] if landmark == "centroid" else [pages.amin(1), pages.amax(1)]
        for store, want in zip(cache.landmarks[0], expected):
            assert torch.allclose(store[0, 0, :2], want) and torch.allclose(store[1, 0, :2], want)
            assert store[:, :, 2].abs().sum() == 0  # page 2 holds 3 of 4 tokens: no landmark yet


def test_registry_bytes_and_scoring_flops_per_page():
    centroid, quest = REGISTRY["centroid"], REGISTRY["quest"]
    assert LANDMARKS == ("centroid", "quest")
    assert centroid.bytes_per_page(kv_heads=2, head_dim=64, element_bytes=2) == 2 * 64 * 2  # one mean key per head
    assert quest.bytes_per_page(kv_heads=2, head_dim=64, element_bytes=2) == 2 * 2 * 64 * 2  # min and max
    assert centroid.score_flops_per_page(heads=8, kv_heads=2, head_dim=64) == 2 * 2 * 64  # group-mean query
    assert quest.score_flops_per_page(heads=8, kv_heads=2, head_dim=64) == 2 * 2 * 8 * 64  # two bounds per head


def test_cost_model_prices_landmarks_from_the_registry():
    dims = ModelDims(layers=4, hidden=128, heads=8, kv_heads=2, head_dim=64, intermediate=256, vocab=100,
                     params=10_000, tied_embeddings=True)
    for name, lm in REGISTRY.items():
        pricing = Pricing(page_size=16, dense_layers=1, landmark=name)
        cost = trajectory_cost(dims, hardware("h200"), const(64), prompt_len=159, gen_len=1, samples=3,
                               pricing=pricing).decode  # one step at 160 cached tokens
        assert cost.landmark_bytes == 3 * lm.bytes_per_page(2, 64, 2) * 3 * 10  # 3 sparse layers, 10 full pages
        assert cost.score_flops == 3 * lm.score_flops_per_page(8, 2, 64) * 3 * 10


def test_bench_bytes_per_step_read_the_landmark_bytes_of_the_registry():
    def engine(landmark):
        return types.SimpleNamespace(num_layers=4, kv_heads=2, head_dim=8, dtype=torch.float32,
                                     sparse=SparseConfig(landmark=landmark), model=torch.nn.Linear(2, 3))

    width = 2 * 2 * 8 * 4  # K and V of one token, float32
    for name, marks in (("centroid", 6 * 64), ("quest", 6 * 128)):  # 100 tokens: 6 full pages of 2 * 8 * 4 bytes
        got = kv_bytes_per_step(engine(name), const(48), cached=100, batch=2)
        assert got == {"weights": 9 * 4, "dense_kv": 4 * 100 * width * 2,
                       "sparse_kv": (2 * 100 * width + 2 * (48 * width + marks)) * 2}


def test_unknown_landmark_is_one_message_wherever_it_is_named():
    message = "unknown landmark 'mean': expected one of centroid, quest"
    for build in (lambda: get_landmark("mean"), lambda: SparseConfig(landmark="mean"),
                  lambda: trajectory_cost(ModelDims(2, 8, 2, 1, 4, 16, 10, 100, True), hardware("h200"), const(48),
                                          63, 1, 1, pricing=Pricing(landmark="mean"))):
        with pytest.raises(SparrowError, match=message):
            build()


def test_keep_in_place_gives_the_kept_rows_of_a_copy():
    """`keep` compacts in place; every tensor then equals the original's kept rows taken by index."""
    from sparrow.attention.kv_cache import KVCache

    cache = KVCache(2, 6, 2, 8, 40, SparseConfig(), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for t in cache.keys + cache.values + [m for lm in cache.landmarks for m in lm]:
        t.copy_(torch.randn(t.shape, generator=gen))
    cache.lengths.copy_(torch.arange(6) + 10)
    before = [t.clone() for t in cache.keys + cache.values + [m for lm in cache.landmarks for m in lm]]
    order = cache.keep([0, 2, 3, 5])
    assert order == [0, 5, 2, 3] and cache.rows == 4
    assert cache.lengths.tolist() == [10, 15, 12, 13]
    after = cache.keys + cache.values + [m for lm in cache.landmarks for m in lm]
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b[order]) and a.is_contiguous()
