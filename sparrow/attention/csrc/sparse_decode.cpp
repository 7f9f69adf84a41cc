// Sparse decode attention on CPU in one pass per (row, kv head), with no gathered copies:
//   1. score the candidate pages with their landmarks (centroid: group-mean query . mean key;
//      quest: max over the group's heads of sum_c max(q_c kmax_c, q_c kmin_c));
//   2. keep the sink and recent pages plus the top-scoring others, budget pages in all (every page when the
//      row has no more pages than its budget);
//   3. softmax attention of the group's query heads over the kept pages, read in place from the cache.
// The same rule as sparrow/attention/selection.py and kernels.py, which remain the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

// Pages are scattered, so the hardware prefetcher cannot guess them: ask for a page's lines ahead of use.
inline void prefetch(const float* p, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 3);
}

constexpr int64_t kAhead = 2;  // pages prefetched ahead of use

template <int64_t kD>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t len = kD ? kD : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

// Steps 1-2 for one (row, kv head): the kept pages, ascending. qh: the group's queries [G, D]; mark(p): page p's
// landmark vectors (centroid, or kmin and kmax) for this head; np pages of which `count` are kept.
template <int64_t kD, class Mark>
void choose_pages(const float* qh, int64_t G, int64_t D, int64_t np, int64_t count, int64_t sink, int64_t recent,
                  bool quest, Mark mark, std::vector<float>& page_score, std::vector<int64_t>& order,
                  std::vector<float>& qmean, std::vector<int64_t>& kept) {
  kept.clear();
  if (count >= np) {
    for (int64_t p = 0; p < np; ++p) kept.push_back(p);
    return;
  }
  const int64_t lo = sink, hi = np - recent;  // candidates [lo, hi); all full pages
  if (!quest) {
    std::fill(qmean.begin(), qmean.end(), 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) qmean[d] += qh[g * D + d];
    for (int64_t d = 0; d < D; ++d) qmean[d] /= static_cast<float>(G);
  }
  for (int64_t p = lo; p < hi; ++p) {
    const auto [mn, mx] = mark(p);
    if (quest) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qh + g * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += std::max(qg[d] * mx[d], qg[d] * mn[d]);
        best = std::max(best, s);
      }
      page_score[p] = best;
    } else {
      page_score[p] = dot<kD>(qmean.data(), mn, D);
    }
  }
  const int64_t take = count - std::min(sink, np) - recent;
  std::iota(order.begin(), order.begin() + (hi - lo), lo);
  std::nth_element(order.begin(), order.begin() + take, order.begin() + (hi - lo), [&](int64_t x, int64_t y) {
    return page_score[x] > page_score[y] || (page_score[x] == page_score[y] && x < y);
  });
  for (int64_t p = 0; p < std::min(sink, np); ++p) kept.push_back(p);
  kept.insert(kept.end(), order.begin(), order.begin() + take);
  for (int64_t p = hi; p < np; ++p) kept.push_back(p);
  std::sort(kept.begin(), kept.end());
}

// Softmax of each of the G rows of scores[g * stride + i], i < n, in place.
inline void softmax_rows(float* scores, int64_t G, int64_t stride, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    float top = *std::max_element(s, s + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - top);
      sum += s[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

// kD: the head dim when known at compile time (64, 128), else 0 and read from the tensors.
template <int64_t kD>
torch::Tensor sparse_decode_impl(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                 std::vector<torch::Tensor> marks, torch::Tensor n_pages, torch::Tensor budget_pages,
                                 torch::Tensor total, int64_t sink, int64_t recent, double scale) {
  // q [B, H, G, D]; keys/values [B, H, P, S, D]; marks: [centroid] or [kmin, kmax], each [B, H, P, D];
  // n_pages, budget_pages, total: [B] int64.
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = kD ? kD : q.size(3);
  const int64_t P = keys.size(2), S = keys.size(3);
  const bool quest = marks.size() == 2;
  auto qc = q.contiguous();
  auto np_t = n_pages.contiguous(), bp_t = budget_pages.contiguous(), tot_t = total.contiguous();
  for (auto& m : marks) TORCH_CHECK(m.is_contiguous() && m.size(2) == P, "landmarks must match the cache");
  auto out = torch::zeros({B, H, G, D}, q.options());
  const float* qd = qc.data_ptr<float>();
  const float* kd = keys.data_ptr<float>();
  const float* vd = values.data_ptr<float>();
  const float* m0 = marks[0].data_ptr<float>();
  const float* m1 = quest ? marks[1].data_ptr<float>() : nullptr;
  const int64_t* npd = np_t.data_ptr<int64_t>();
  const int64_t* bpd = bp_t.data_ptr<int64_t>();
  const int64_t* totd = tot_t.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> page_score(P), qmean(D), scores;
    std::vector<int64_t> order(P), kept, rows;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, np = npd[b], limit = totd[b];
      const float* qh = qd + bh * G * D;
      const int64_t base = bh * P * D;
      auto mark = [&](int64_t p) {
        return std::pair<const float*, const float*>(m0 + base + p * D, quest ? m1 + base + p * D : nullptr);
      };
      choose_pages<kD>(qh, G, D, np, std::min(bpd[b], np), sink, recent, quest, mark, page_score, order, qmean,
                       kept);
      const int64_t n_kept = static_cast<int64_t>(kept.size());
      scores.assign(G * n_kept * S, 0.f);
      rows.clear();
      const int64_t stride = n_kept * S;
      for (int64_t j = 0; j < n_kept; ++j) {
        const int64_t first = (bh * P + kept[j]) * S;
        if (j == 0)
          for (int64_t a = 1; a < std::min(kAhead, n_kept); ++a) prefetch(kd + (bh * P + kept[a]) * S * D, S * D);
        if (j + kAhead < n_kept) prefetch(kd + (bh * P + kept[j + kAhead]) * S * D, S * D);
        prefetch(vd + first * D, S * D);  // values of this page, for the second pass
        for (int64_t t = 0; t < S && kept[j] * S + t < limit; ++t) {
          const float* kr = kd + (first + t) * D;
          const int64_t n = static_cast<int64_t>(rows.size());
          for (int64_t g = 0; g < G; ++g) scores[g * stride + n] = dot<kD>(qh + g * D, kr, D) * sc;
          rows.push_back(first + t);
        }
      }
      const int64_t n = static_cast<int64_t>(rows.size());
      softmax_rows(scores.data(), G, stride, n);
      float* oh = od + bh * G * D;
      for (int64_t i = 0; i < n; ++i) {
        const float* vr = vd + rows[i] * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * stride + i];
          float* og = oh + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += w * vr[d];
        }
      }
    }
  });
  return out;
}

// The same step over vLLM's CPU paged cache, read in place. kv_cache [blocks, H, block, 2 D]: per (block, head),
// the keys transposed ([D, block]: channel-major) then the values ([block, D]). Page p of request r is physical
// page phys[r, p] = block * (block / S) + page within the block; marks are per physical page, [pages, H, D].
template <int64_t kD>
torch::Tensor paged_sparse_decode_impl(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor phys,
                                       std::vector<torch::Tensor> marks, torch::Tensor n_pages,
                                       torch::Tensor budget_pages, torch::Tensor total, int64_t page_size,
                                       int64_t sink, int64_t recent, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(kv_cache.is_contiguous(), "cache must be contiguous");
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = kD ? kD : q.size(3);
  const int64_t block = kv_cache.size(2), S = page_size, per = block / S, P = phys.size(1);
  TORCH_CHECK(block % S == 0 && kv_cache.size(3) == 2 * D, "cache layout does not match the page size");
  const bool quest = marks.size() == 2;
  auto qc = q.contiguous();
  auto ph_t = phys.contiguous();
  auto np_t = n_pages.contiguous(), bp_t = budget_pages.contiguous(), tot_t = total.contiguous();
  for (auto& m : marks) TORCH_CHECK(m.is_contiguous() && m.size(1) == H, "landmarks must match the cache");
  auto out = torch::zeros({R, H, G, D}, q.options());
  const float* qd = qc.data_ptr<float>();
  const float* cd = kv_cache.data_ptr<float>();
  const float* m0 = marks[0].data_ptr<float>();
  const float* m1 = quest ? marks[1].data_ptr<float>() : nullptr;
  const int64_t* phd = ph_t.data_ptr<int64_t>();
  const int64_t* npd = np_t.data_ptr<int64_t>();
  const int64_t* bpd = bp_t.data_ptr<int64_t>();
  const int64_t* totd = tot_t.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t head_stride = 2 * block * D;

  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> page_score(P), qmean(D), scores, tile(S);
    std::vector<int64_t> order(P), kept;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H, np = npd[r], limit = totd[r];
      const float* qh = qd + rh * G * D;
      const int64_t* pr = phd + r * P;
      auto mark = [&](int64_t p) {
        const int64_t at = (pr[p] * H + h) * D;
        return std::pair<const float*, const float*>(m0 + at, quest ? m1 + at : nullptr);
      };
      choose_pages<kD>(qh, G, D, np, std::min(bpd[r], np), sink, recent, quest, mark, page_score, order, qmean,
                       kept);
      const int64_t n_kept = static_cast<int64_t>(kept.size());
      const int64_t stride = n_kept * S;
      scores.assign(G * stride, 0.f);
      auto head_base = [&](int64_t p) { return cd + ((pr[p] / per) * H + h) * head_stride; };
      int64_t n = 0;  // tokens attended so far (the last page may be partial)
      for (int64_t j = 0; j < n_kept; ++j) {
        const int64_t p = kept[j], within = (pr[p] % per) * S;
        const int64_t valid = std::min(S, limit - p * S);
        const float* kt = head_base(p) + within;  // key channel d of token t at kt[d * block + t]
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          std::fill(tile.begin(), tile.end(), 0.f);
          for (int64_t d = 0; d < D; ++d) {
            const float qv = qg[d];
            const float* kd = kt + d * block;
#pragma omp simd
            for (int64_t t = 0; t < S; ++t) tile[t] += qv * kd[t];
          }
          float* s = scores.data() + g * stride + n;
          for (int64_t t = 0; t < valid; ++t) s[t] = tile[t] * sc;
        }
        n += valid;
      }
      softmax_rows(scores.data(), G, stride, n);
      float* oh = od + rh * G * D;
      int64_t i = 0;
      for (int64_t j = 0; j < n_kept; ++j) {
        const int64_t p = kept[j], within = (pr[p] % per) * S;
        const int64_t valid = std::min(S, limit - p * S);
        const float* vp = head_base(p) + block * D + within * D;
        for (int64_t t = 0; t < valid; ++t, ++i) {
          const float* vr = vp + t * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * stride + i];
            float* og = oh + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) og[d] += w * vr[d];
          }
        }
      }
    }
  });
  return out;
}

torch::Tensor sparse_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values, std::vector<torch::Tensor> marks,
                            torch::Tensor n_pages, torch::Tensor budget_pages, torch::Tensor total, int64_t sink,
                            int64_t recent, double scale) {
  switch (q.size(3)) {
    case 64: return sparse_decode_impl<64>(q, keys, values, marks, n_pages, budget_pages, total, sink, recent, scale);
    case 128: return sparse_decode_impl<128>(q, keys, values, marks, n_pages, budget_pages, total, sink, recent, scale);
    default: return sparse_decode_impl<0>(q, keys, values, marks, n_pages, budget_pages, total, sink, recent, scale);
  }
}

torch::Tensor paged_sparse_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor phys,
                                  std::vector<torch::Tensor> marks, torch::Tensor n_pages, torch::Tensor budget_pages,
                                  torch::Tensor total, int64_t page_size, int64_t sink, int64_t recent, double scale) {
  switch (q.size(3)) {
    case 64:
      return paged_sparse_decode_impl<64>(q, kv_cache, phys, marks, n_pages, budget_pages, total, page_size, sink,
                                          recent, scale);
    case 128:
      return paged_sparse_decode_impl<128>(q, kv_cache, phys, marks, n_pages, budget_pages, total, page_size, sink,
                                           recent, scale);
    default:
      return paged_sparse_decode_impl<0>(q, kv_cache, phys, marks, n_pages, budget_pages, total, page_size, sink,
                                         recent, scale);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_decode", &sparse_decode, "page selection and sparse attention for one decode step");
  m.def("paged_sparse_decode", &paged_sparse_decode, "the same step over vLLM's CPU paged KV cache");
}
