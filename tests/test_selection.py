"""The page-selection rule and landmark scores, pinned on small hand-made inputs."""

import torch

from sparrow.attention import (
    KVCache,
    SparseConfig,
    centroid_scores,
    quest_scores,
    select_pages,
)


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
    for landmark in ("centroid", "quest"):
        sparse = SparseConfig(page_size=4, landmark=landmark)
        cache = KVCache(1, 2, 1, 3, 16, sparse, torch.float32, torch.device("cpu"))
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
