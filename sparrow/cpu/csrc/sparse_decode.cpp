// Sparse decode attention on CPU in one pass per (row, kv head), with no gathered copies:
//   1. score the candidate pages with their landmarks (centroid: group-mean query . mean key;
//      quest: max over the group's heads of sum_c max(q_c kmax_c, q_c kmin_c));
//   2. keep the sink and recent pages plus the top-scoring others, budget pages in all (every page when the
//      row has no more pages than its budget);
//   3. softmax attention of the group's query heads over the kept pages, read in place from the cache.
// The same rule as sparrow/attention/selection.py and kernels.py, which remain the reference.
// One decode loop (`decode`) serves two caches through a page reader, which says where page p's landmarks, keys
// and values of one (row, head) lie: `ContiguousPages` (the native engine's cache) and `PagedPages` (vLLM's).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
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

using Marks = std::pair<const float*, const float*>;  // a page's landmarks: (centroid, null) or (kmin, kmax)

// One register of floats: 16 lanes with AVX-512, 8 without. The loops below keep their running sums in such
// values, one lane per token or channel and never summed across lanes, so the order of a sum does not depend on the
// vector width (the build's -ffast-math still lets an AVX2 and an AVX-512 build round some results differently in
// the last bit: compare results within one machine); several independent sums at once keep the FMA units busy.
// Every loop over registers has a compile-time count and no more live sums than the CPU has registers (16 with
// AVX2, 32 with AVX-512): an array of vectors that does not fit is kept on the stack, several times slower.
#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vf __attribute__((vector_size(kW * sizeof(float))));
inline vf loadv(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));  // half an AVX-512 register

constexpr int kPageVecs = 16 / kW;         // registers per 16-token page row
constexpr int kMaxHeads = kW == 16 ? 4 : 2;  // query heads scored at once (2 sums x kPageVecs registers each)

// The scores of one 16-token page for NG query heads q [NG, kD] against keys stored channel-major (channel d of
// the 16 tokens at kt[d * kstride]): each channel is loaded once for the NG heads, two sums per head (even and odd
// channels). out[i * 16 + t]: head i's score of token t.
template <int64_t kD, int NG>
inline void page_scores16(const float* q, const float* kt, int64_t kstride, float* out) {
  vf a[NG][2][kPageVecs] = {};
  for (int64_t d = 0; d < kD; d += 2) {
    vf k0[kPageVecs], k1[kPageVecs];
#pragma GCC unroll 4
    for (int c = 0; c < kPageVecs; ++c) k0[c] = loadv(kt + d * kstride + c * kW), k1[c] = loadv(kt + (d + 1) * kstride + c * kW);
#pragma GCC unroll 4
    for (int i = 0; i < NG; ++i) {
      const float q0 = q[i * kD + d], q1 = q[i * kD + d + 1];
#pragma GCC unroll 4
      for (int c = 0; c < kPageVecs; ++c) a[i][0][c] += q0 * k0[c], a[i][1][c] += q1 * k1[c];
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NG; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < kPageVecs; ++c) storev(out + i * 16 + c * kW, a[i][0][c] + a[i][1][c]);
}

// page_scores16 for G heads, kMaxHeads at a time: scaled scores of the page's first `valid` tokens into
// s[g * stride + t].
template <int64_t kD>
inline void page_scores(const float* qh, int64_t G, const float* kt, int64_t kstride, int64_t valid, float sc,
                        float* s, int64_t stride) {
  float r[kMaxHeads * 16];
  for (int64_t g0 = 0; g0 < G; g0 += kMaxHeads) {
    const float* q = qh + g0 * kD;
    const int64_t n = std::min<int64_t>(kMaxHeads, G - g0);
    switch (n) {
      case 1: page_scores16<kD, 1>(q, kt, kstride, r); break;
      case 2: page_scores16<kD, 2>(q, kt, kstride, r); break;
      case 3: page_scores16<kD, kMaxHeads < 3 ? 1 : 3>(q, kt, kstride, r); break;  // n <= kMaxHeads
      default: page_scores16<kD, kMaxHeads>(q, kt, kstride, r); break;
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t t = 0; t < valid; ++t) s[(g0 + i) * stride + t] = r[i * 16 + t] * sc;
  }
}

// oh[g, :] += sum_t w[g * wstride + t] * vp[t, :] over a page's n tokens (values token-major [n, kD]) for the
// G heads: per head and block of kBlock registers of channels, one sum for even tokens and one for odd ones.
// NG heads at once where the registers allow (AVX-512: each value register loaded once serves 2 heads); the same
// sums in the same order whatever NG.
template <int64_t kD, int NG>
inline void add_page_values_heads(const float* w, int64_t wstride, const float* vp, int64_t n, float* oh) {
  constexpr int V = kD / kW, kBlock = V < 4 ? V : 4;
  static_assert(V % kBlock == 0, "head dim must be a multiple of the block");
  for (int b = 0; b < V; b += kBlock) {
    const float* vb = vp + b * kW;
    vf even[NG][kBlock], odd[NG][kBlock];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
      for (int v = 0; v < kBlock; ++v) even[g][v] = loadv(oh + g * kD + b * kW + kW * v), odd[g][v] = vf{};
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
      const float *v0 = vb + t * kD, *v1 = v0 + kD;
      vf x0[kBlock], x1[kBlock];
#pragma GCC unroll 8
      for (int v = 0; v < kBlock; ++v) x0[v] = loadv(v0 + kW * v), x1[v] = loadv(v1 + kW * v);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const float w0 = w[g * wstride + t], w1 = w[g * wstride + t + 1];
#pragma GCC unroll 8
        for (int v = 0; v < kBlock; ++v) even[g][v] += w0 * x0[v], odd[g][v] += w1 * x1[v];
      }
    }
    if (t < n)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
        for (int v = 0; v < kBlock; ++v) even[g][v] += w[g * wstride + t] * loadv(vb + t * kD + kW * v);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
      for (int v = 0; v < kBlock; ++v) storev(oh + g * kD + b * kW + kW * v, even[g][v] + odd[g][v]);
  }
}

template <int64_t kD>
inline void add_page_values(const float* w, int64_t wstride, int64_t G, const float* vp, int64_t n, float* oh) {
  constexpr int kHeads = kW == 16 ? 2 : 1;  // 2 x 2 x 4 sums and 8 value registers of AVX-512's 32
  int64_t g = 0;
  for (; g + kHeads <= G; g += kHeads) add_page_values_heads<kD, kHeads>(w + g * wstride, wstride, vp, n, oh + g * kD);
  for (; g < G; ++g) add_page_values_heads<kD, 1>(w + g * wstride, wstride, vp, n, oh + g * kD);
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

// e^x lane by lane for x <= 0, as Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), a
// degree-7 polynomial in r, times 2^n built in the exponent bits; within 2 ulp of std::exp. Lanes below -87
// (-inf included) give 0, whose weight would be below float's normal range anyway.
inline vf exp_nonpositive(vf x) {
  typedef int32_t vi __attribute__((vector_size(kW * sizeof(int32_t))));
  const vf lo = vf{} - 87.f;
  const vf xc = x < lo ? lo : x;
  const vi n = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi);  // xc <= 0: truncation rounds
  const vf fn = __builtin_convertvector(n, vf);
  vf r = xc - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  vf y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  const vi bits = (n + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return x < lo ? vf{} : y * scale;
}

// The largest of s[0..n) (n >= 1), a register at a time (a maximum is the same in any order).
inline float row_max(const float* s, int64_t n) {
  float top = s[0];
  int64_t i = 0;
  if (n >= kW) {
    vf m = loadv(s);
    for (i = kW; i + kW <= n; i += kW) {
      const vf v = loadv(s + i);
      m = v > m ? v : m;
    }
    float lanes[kW];
    storev(lanes, m);
    top = lanes[0];
    for (int l = 1; l < kW; ++l) top = std::max(top, lanes[l]);
  }
  for (; i < n; ++i) top = std::max(top, s[i]);
  return top;
}

// Softmax of each of the G rows of scores[g * stride + i], i < n, in place. The exponentials are summed in 16
// lanes (one per i mod 16), then the lanes in order, so the sum does not depend on the vector width.
inline void softmax_rows(float* scores, int64_t G, int64_t stride, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    const float top = row_max(s, n);
    vf acc[kPageVecs] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
#pragma GCC unroll 4
      for (int c = 0; c < kPageVecs; ++c) {
        const vf e = exp_nonpositive(loadv(s + i + c * kW) - top);
        storev(s + i + c * kW, e);
        acc[c] += e;
      }
    if (i < n) {  // the last partial 16, padded with -inf (weight 0)
      float pad[16];
      std::fill(pad, pad + 16, -std::numeric_limits<float>::infinity());
      std::copy(s + i, s + n, pad);
      for (int c = 0; c < kPageVecs; ++c) {
        const vf e = exp_nonpositive(loadv(pad + c * kW) - top);
        storev(pad + c * kW, e);
        acc[c] += e;
      }
      std::copy(pad, pad + (n - i), s + i);
    }
    float lanes[16];
    for (int c = 0; c < kPageVecs; ++c) storev(lanes + c * kW, acc[c]);
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += lanes[l];
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
}

// What both caches share: the queries [rows, H, G, D], per row the page count, budget in pages and token count
// ([rows] int64 each), the landmark tensors ([centroid] or [kmin, kmax]) and the output [rows, H, G, D].
struct Step {
  torch::Tensor q, n_pages, budget, total, out;  // contiguous; they own the memory of the pointers below
  std::vector<torch::Tensor> marks;
  int64_t rows, H, G, D, sink, recent;
  int64_t span = 1;  // new tokens per row: query row g of a head is token g % span of them (see span_decode)
  bool quest;
  float scale;
  const float *qd, *m0, *m1;
  const int64_t *npd, *bpd, *totd;
  float* od;
};

// The checks and pointers of a Step; `cache` is checked for dtype and layout, the reader checks its shape.
Step make_step(const torch::Tensor& q, const torch::Tensor& cache, std::vector<torch::Tensor> marks,
               const torch::Tensor& n_pages, const torch::Tensor& budget_pages, const torch::Tensor& total,
               int64_t sink, int64_t recent, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && cache.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(marks.size() == 1 || marks.size() == 2, "landmarks: [centroid] or [kmin, kmax]");
  for (auto& m : marks) TORCH_CHECK(m.is_contiguous(), "landmarks must match the cache");
  Step s;
  s.q = q.contiguous();
  s.n_pages = n_pages.contiguous(), s.budget = budget_pages.contiguous(), s.total = total.contiguous();
  s.marks = std::move(marks);
  s.rows = q.size(0), s.H = q.size(1), s.G = q.size(2), s.D = q.size(3);
  s.sink = sink, s.recent = recent, s.quest = s.marks.size() == 2, s.scale = static_cast<float>(scale);
  s.out = torch::zeros({s.rows, s.H, s.G, s.D}, q.options());
  s.qd = s.q.data_ptr<float>();
  s.m0 = s.marks[0].data_ptr<float>();
  s.m1 = s.quest ? s.marks[1].data_ptr<float>() : nullptr;
  s.npd = s.n_pages.data_ptr<int64_t>(), s.bpd = s.budget.data_ptr<int64_t>(), s.totd = s.total.data_ptr<int64_t>();
  s.od = s.out.data_ptr<float>();
  return s;
}

// A page reader gives, for one (row, head), a Head with:
//   mark(p)             page p's landmarks;
//   score<kD>(...)      the scaled scores q_g . k_t * scale of page p's first `valid` tokens for the G queries,
//                       into s[g * stride + t] (tile: scratch of S floats);
//   values(p)           page p's values [S, D], token-major;
//   prefetch(kept, j)   a hint before page kept[j] is scored.
// and, per reader, slots() (page slots per row) and page_size().

// score_span's loop for one 16-token page of token-major keys kp: query registers V of L lanes, NV of them per
// group of L * NV queries, kT = 8 / NV tokens at a time (8 sums in flight); scaled scores into s[g * stride + t].
template <int64_t kD, class V, int NV>
inline void span_page_scores(const float* qt, int64_t G, const float* kp, int64_t valid, float sc, float* s,
                             int64_t stride) {
  constexpr int L = sizeof(V) / sizeof(float), kT = 8 / NV;
  const int64_t Gp = (G + 15) / 16 * 16;
  for (int64_t g0 = 0; g0 < G; g0 += L * NV) {
    const int64_t ng = std::min<int64_t>(L * NV, G - g0);
    for (int64_t t0 = 0; t0 < valid; t0 += kT) {
      V acc[kT][NV] = {};
      for (int64_t d = 0; d < kD; ++d) {
        V q[NV];
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) __builtin_memcpy(&q[c], qt + d * Gp + g0 + c * L, sizeof(V));
#pragma GCC unroll 8
        for (int t = 0; t < kT; ++t) {
          const float k = kp[(t0 + t) * kD + d];
#pragma GCC unroll 4
          for (int c = 0; c < NV; ++c) acc[t][c] += k * q[c];
        }
      }
      float out[kT][L * NV];
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t)
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) {
          const V scaled = acc[t][c] * sc;
          __builtin_memcpy(out[t] + c * L, &scaled, sizeof(V));
        }
      const int64_t nt = std::min<int64_t>(kT, valid - t0);
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t t = 0; t < nt; ++t) s[(g0 + g) * stride + t0 + t] = out[t][g];
    }
  }
}

// The native engine's cache: keys/values [B, H, P, S, D] and landmarks [B, H, P, D], page p of (row, head) at
// (row H + head) P + p; keys token-major.
struct ContiguousPages {
  const float *keys, *vals, *m0, *m1;
  int64_t H, P, S, D;

  struct Head {
    const float *k, *v, *m0, *m1;  // this (row, head)'s page 0
    int64_t S, D;

    Marks mark(int64_t p) const { return {m0 + p * D, m1 ? m1 + p * D : nullptr}; }
    const float* page_keys(int64_t p) const { return k + p * S * D; }
    const float* values(int64_t p) const { return v + p * S * D; }

    // Keys kAhead pages ahead of use (the first pages at the start), and this page's values for the second pass.
    void prefetch(const std::vector<int64_t>& kept, int64_t j) const {
      const int64_t n_kept = static_cast<int64_t>(kept.size());
      if (j == 0)
        for (int64_t a = 1; a < std::min(kAhead, n_kept); ++a) ::prefetch(page_keys(kept[a]), S * D);
      if (j + kAhead < n_kept) ::prefetch(page_keys(kept[j + kAhead]), S * D);
    }
    // The same for the values, before page kept[j]'s are added.
    void prefetch_values(const std::vector<int64_t>& kept, int64_t j) const {
      const int64_t n_kept = static_cast<int64_t>(kept.size());
      if (j == 0)
        for (int64_t a = 0; a < std::min(kAhead, n_kept); ++a) ::prefetch(values(kept[a]), S * D);
      if (j + kAhead < n_kept) ::prefetch(values(kept[j + kAhead]), S * D);
    }

    // One dot product per (token, query head).
    template <int64_t kD>
    void score(const float* qh, int64_t G, int64_t p, int64_t valid, float sc, float* s, int64_t stride,
               float*) const {
      for (int64_t t = 0; t < valid; ++t) {
        const float* kr = page_keys(p) + t * D;
        for (int64_t g = 0; g < G; ++g) s[g * stride + t] = dot<kD>(qh + g * D, kr, D) * sc;
      }
    }
    // The span step's many query rows (G * span), queries as lanes: `qt` holds them transposed ([kD, Gp], Gp =
    // G rounded up to 16, zero padded; see transpose_queries). Per 16 queries (8 when there are no more: half
    // registers, twice as many per cycle where AVX-512 has 16 lanes) and kT tokens at a time, each key channel is
    // broadcast against the queries' register of that channel, so the keys are read as stored and one query load
    // serves kT tokens. One sum per (token, query), over the channels in order. Other page sizes as `score`.
    template <int64_t kD>
    void score_span(const float* qh, const float* qt, int64_t G, int64_t p, int64_t valid, float sc, float* s,
                    int64_t stride, float* tile) const {
      if constexpr (kD > 0) {
        if (S == 16) {
          const float* kp = page_keys(p);  // a full page of S slots: tokens past `valid` are read, never stored
          if (kW == 16 && G <= 8)
            span_page_scores<kD, v8f, 1>(qt, G, kp, valid, sc, s, stride);
          else
            span_page_scores<kD, vf, kPageVecs>(qt, G, kp, valid, sc, s, stride);
          return;
        }
      }
      score<kD>(qh, G, p, valid, sc, s, stride, tile);
    }
  };

  Head head(int64_t r, int64_t h) const {
    const int64_t at = (r * H + h) * P;
    return {keys + at * S * D, vals + at * S * D, m0 + at * D, m1 ? m1 + at * D : nullptr, S, D};
  }
  int64_t slots() const { return P; }
  int64_t page_size() const { return S; }
};

// vLLM's CPU paged cache [blocks, H, block, 2 D]: per (block, head), the keys transposed ([D, block]: channel-major)
// then the values ([block, D]). Page p of request r is physical page phys[r, p] = block * (block / S) + page within
// the block; landmarks are per physical page, [pages, H, D].
struct PagedPages {
  const float *cache, *m0, *m1;
  const int64_t* phys;  // [R, P]
  int64_t H, P, S, D, block;

  struct Head {
    const float *cache, *m0, *m1;
    const int64_t* pr;  // this request's physical pages
    int64_t h, H, S, D, block;

    Marks mark(int64_t p) const {
      const int64_t at = (pr[p] * H + h) * D;
      return {m0 + at, m1 ? m1 + at : nullptr};
    }
    // Page p's (block, head) slab [2 D block] and the page's first token within the block.
    const float* slab(int64_t p) const { return cache + ((pr[p] / (block / S)) * H + h) * 2 * block * D; }
    int64_t within(int64_t p) const { return (pr[p] % (block / S)) * S; }
    const float* values(int64_t p) const { return slab(p) + block * D + within(p) * D; }

    void prefetch(const std::vector<int64_t>&, int64_t) const {}  // not asked for: the keys are strided by block
    void prefetch_values(const std::vector<int64_t>&, int64_t) const {}

    template <int64_t kD>
    void score_span(const float* qh, const float*, int64_t G, int64_t p, int64_t valid, float sc, float* s,
                    int64_t stride, float* tile) const {
      score<kD>(qh, G, p, valid, sc, s, stride, tile);
    }

    // Channel by channel: S keys of one channel are one vector (key channel d of token t at kt[d * block + t]).
    template <int64_t kD>
    void score(const float* qh, int64_t G, int64_t p, int64_t valid, float sc, float* s, int64_t stride,
               float* tile) const {
      const float* kt = slab(p) + within(p);
      if constexpr (kD % 16 == 0 && kD > 0) {
        if (S == 16) {  // the usual page: up to 4 heads at a time, in registers
          page_scores<kD>(qh, G, kt, block, valid, sc, s, stride);
          return;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qh + g * D;
        std::fill(tile, tile + S, 0.f);
        for (int64_t d = 0; d < D; ++d) {
          const float qv = qg[d];
          const float* kd = kt + d * block;
#pragma omp simd
          for (int64_t t = 0; t < S; ++t) tile[t] += qv * kd[t];
        }
        for (int64_t t = 0; t < valid; ++t) s[g * stride + t] = tile[t] * sc;
      }
    }
  };

  Head head(int64_t r, int64_t h) const { return {cache, m0, m1, phys + r * P, h, H, S, D, block}; }
  int64_t slots() const { return P; }
  int64_t page_size() const { return S; }
};

// qt[d * Gp + g] = qh[g * D + d] for the G query rows [G, D], Gp = G rounded up to 16, the padding zero.
inline void transpose_queries(const float* qh, int64_t G, int64_t D, float* qt) {
  const int64_t Gp = (G + 15) / 16 * 16;
  std::fill(qt, qt + D * Gp, 0.f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qt[d * Gp + g] = qh[g * D + d];
}

// Steps 1-3 for every (row, kv head), reading the cache through `pages`. kD: the head dim when known at compile
// time (64, 128), else 0 and read from the tensors.
template <int64_t kD, class Pages>
torch::Tensor decode(const Step& st, const Pages& pages) {
  const int64_t H = st.H, G = st.G, D = kD ? kD : st.D, P = pages.slots(), S = pages.page_size();
  at::parallel_for(0, st.rows * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> page_score(P), qmean(D), scores, tile(S);  // tile: a page reader's scratch (see score)
    std::vector<int64_t> order(P), kept;
    std::vector<float> qt(st.span > 1 ? D * ((G + 15) / 16 * 16) : 0);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, np = st.npd[r], limit = st.totd[r];
      const float* qh = st.qd + rh * G * D;
      if (st.span > 1) transpose_queries(qh, G, D, qt.data());
      const auto head = pages.head(r, rh % H);
      auto mark = [&](int64_t p) { return head.mark(p); };
      choose_pages<kD>(qh, G, D, np, std::min(st.bpd[r], np), st.sink, st.recent, st.quest, mark, page_score, order,
                       qmean, kept);
      // Tokens of kept page p (the last page may be partial).
      auto valid = [&](int64_t p) { return std::clamp<int64_t>(limit - p * S, 0, S); };
      const int64_t n_kept = static_cast<int64_t>(kept.size()), stride = n_kept * S;
      scores.assign(G * stride, 0.f);
      int64_t n = 0;  // tokens scored so far
      for (int64_t j = 0; j < n_kept; ++j) {
        head.prefetch(kept, j);
        if (st.span > 1)
          head.template score_span<kD>(qh, qt.data(), G, kept[j], valid(kept[j]), st.scale, scores.data() + n,
                                       stride, tile.data());
        else
          head.template score<kD>(qh, G, kept[j], valid(kept[j]), st.scale, scores.data() + n, stride, tile.data());
        n += valid(kept[j]);
      }
      if (st.span > 1) {  // token s of the span sees the cache up to itself: its last span-1-s tokens are cut
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * stride;
          for (int64_t i = n - (st.span - 1 - g % st.span); i < n; ++i) sg[i] = -std::numeric_limits<float>::infinity();
        }
      }
      softmax_rows(scores.data(), G, stride, n);
      // The weighted sum of the kept tokens' values, page by page in the order scored.
      float* oh = st.od + rh * G * D;
      int64_t i = 0;
      for (int64_t j = 0; j < n_kept; ++j) {
        const int64_t p = kept[j];
        head.prefetch_values(kept, j);
        const float* vp = head.values(p);
        if constexpr (kD % 16 == 0 && kD > 0) {
          add_page_values<kD>(scores.data() + i, stride, G, vp, valid(p), oh);
          i += valid(p);
        } else {
          for (int64_t t = 0; t < valid(p); ++t, ++i) {
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
    }
  });
  return st.out;
}

// decode<kD> with the head dim as a compile-time constant when it is a common one.
template <class Pages>
torch::Tensor decode_any_dim(const Step& st, const Pages& pages) {
  switch (st.D) {
    case 64: return decode<64>(st, pages);
    case 128: return decode<128>(st, pages);
    default: return decode<0>(st, pages);
  }
}

// `span` new tokens per row at once (one for a decode step, several for the dense verification of drafted tokens,
// whose budget is n_pages): q [B, H, G * span, D], query row g * span + s for token s of the span, whose keys/values
// are the last `span` of each row's `total` tokens; token s attends to the first total - (span - 1 - s). Kept pages
// are ascending and hold the span's tokens last, so a token's future ones are the last scored of its row.
// keys/values [B, H, P, S, D]; marks: [centroid] or [kmin, kmax], each [B, H, P, D]; n_pages, budget_pages, total:
// [B] int64.
torch::Tensor span_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values, std::vector<torch::Tensor> marks,
                          torch::Tensor n_pages, torch::Tensor budget_pages, torch::Tensor total, int64_t sink,
                          int64_t recent, double scale, int64_t span) {
  TORCH_CHECK(span >= 1 && q.size(2) % span == 0, "span must divide the query rows");
  Step st = make_step(q, keys, std::move(marks), n_pages, budget_pages, total, sink, recent, scale);
  st.span = span;
  TORCH_CHECK(values.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(values.is_contiguous(), "cache must be contiguous");
  const int64_t P = keys.size(2);
  for (auto& m : st.marks) TORCH_CHECK(m.size(2) == P, "landmarks must match the cache");
  const ContiguousPages pages{keys.data_ptr<float>(), values.data_ptr<float>(), st.m0, st.m1, st.H, P,
                              keys.size(3), st.D};
  return decode_any_dim(st, pages);
}

// One new token per row (q [B, H, G, D]): span_decode with a span of 1.
torch::Tensor sparse_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values, std::vector<torch::Tensor> marks,
                            torch::Tensor n_pages, torch::Tensor budget_pages, torch::Tensor total, int64_t sink,
                            int64_t recent, double scale) {
  return span_decode(q, keys, values, std::move(marks), n_pages, budget_pages, total, sink, recent, scale, 1);
}

// The same step over vLLM's CPU paged cache kv_cache [blocks, H, block, 2 D] (see PagedPages): q [R, H, G, D];
// phys [R, P]; marks per physical page, [pages, H, D] each; n_pages, budget_pages, total: [R] int64.
torch::Tensor paged_sparse_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor phys,
                                  std::vector<torch::Tensor> marks, torch::Tensor n_pages, torch::Tensor budget_pages,
                                  torch::Tensor total, int64_t page_size, int64_t sink, int64_t recent, double scale) {
  const Step st = make_step(q, kv_cache, std::move(marks), n_pages, budget_pages, total, sink, recent, scale);
  const int64_t block = kv_cache.size(2), S = page_size;
  TORCH_CHECK(block % S == 0 && kv_cache.size(3) == 2 * st.D, "cache layout does not match the page size");
  for (auto& m : st.marks) TORCH_CHECK(m.size(1) == st.H, "landmarks must match the cache");
  const auto ph = phys.contiguous();
  const PagedPages pages{kv_cache.data_ptr<float>(), st.m0, st.m1, ph.data_ptr<int64_t>(), st.H, ph.size(1), S,
                         st.D, block};
  return decode_any_dim(st, pages);
}

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);  // small_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_decode", &sparse_decode, "page selection and sparse attention for one decode step");
  m.def("span_decode", &span_decode, "attention of several new tokens per row (causal among them)");
  m.def("paged_sparse_decode", &paged_sparse_decode, "the same step over vLLM's CPU paged KV cache");
  m.def("small_linear", &small_linear, "x W^T + b for the few rows of a decode step");
}
