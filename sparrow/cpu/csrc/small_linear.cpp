// y = x W^T + b for the few rows of a decode step (x [M, K], W [N, K], both float32 and contiguous).
// With a handful of rows a linear layer is a stream over its weights: each weight is read from memory once and
// used for every row while it sits in L1. Blocks of kNB weight rows x kMB input rows keep kMB * kNB sums in
// registers (one 8-float vector each: lane l sums the k = l mod 8 terms in order) while the next block's weights
// are prefetched (without it the stream reads at half the bandwidth here), the lanes are added in order
// and the last K mod 8 terms after them (each as one fused multiply-add). Each weight and input vector is loaded
// once per k into a register the compiler may not trade for a memory operand (GCC otherwise reloads the weights
// for every row: twice the loads, half the speed at exact mode's 40 rows). Every output comes from the same block
// code (a last block overlaps the one before it instead of being smaller), so an output does not depend on M, on
// which block it fell in, on the thread count or on the CPU's vector width (checked across an AVX2 and an AVX-512
// build): a row decoded alone gets the bits it gets in a batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

// The kernel is built with -ffast-math, whose reassociation would let the compiler sum the lanes (and the K mod 8
// tail) in an order that depends on how a block is unrolled: kept off here, the order is the one written.
#pragma GCC optimize("no-associative-math")

namespace {

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
// Keeps v in a register from here on: an empty asm that claims to read and change it.
inline void in_register(v8& v) { asm("" : "+x"(v)); }

constexpr int kMB = 4;  // input rows per block
#ifdef __AVX512F__
constexpr int kNB = 6;  // weight rows per block: 24 sums, 6 weight and 1 input registers of the 32 AVX-512 gives
#else
constexpr int kNB = 3;  // weight rows per block: 12 sums, 3 weight and 1 input registers of AVX2's 16
#endif

// y[m, n] for the MB rows at x and the NB weight rows at w (row strides K), into y (row stride N); rows before
// `row0` and columns before `col0` of the block are computed but not stored (an overlapping last block).
template <int MB, int NB>
inline void block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int row0,
                  int col0) {
  v8 acc[MB][NB] = {};
  const int64_t k8 = K / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8) {
    v8 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) __builtin_prefetch(w + (NB + j) * K + k, 0, 0);  // the next block's weights
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      wv[j] = load8(w + j * K + k);
      in_register(wv[j]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      v8 xv = load8(x + i * K + k);
      in_register(xv);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = row0; i < MB; ++i)
    for (int j = col0; j < NB; ++j) {
      float s = 0.f;
      for (int l = 0; l < 8; ++l) s += acc[i][j][l];
      for (int64_t k = k8; k < K; ++k) s = __builtin_fmaf(x[i * K + k], w[j * K + k], s);
      y[i * N + j] = bias ? s + bias[j] : s;
    }
}

// The rows of x against NB weight rows: blocks of kMB rows, the last one overlapping the one before it so that
// every output comes from the same block<kMB, NB> code (fewer than kMB rows in all: one smaller block).
template <int NB>
inline void rows_block(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                       int col0) {
  switch (M) {
    case 1: block<1, NB>(x, w, bias, y, K, N, 0, col0); return;
    case 2: block<2, NB>(x, w, bias, y, K, N, 0, col0); return;
    case 3: block<3, NB>(x, w, bias, y, K, N, 0, col0); return;
    default: break;
  }
  for (int64_t m = 0; m < M; m += kMB) {
    const int64_t start = std::min(m, M - kMB);
    block<kMB, NB>(x + start * K, w, bias, y + start * N, K, N, static_cast<int>(m - start), col0);
  }
}

}  // namespace

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
  if (w.size(0) < kNB) {  // fewer weight rows than a block: zero rows make one, so the same block code runs
    auto padded = torch::zeros({kNB, w.size(1)}, w.options());
    padded.narrow(0, 0, w.size(0)).copy_(w);
    c10::optional<torch::Tensor> padded_bias;
    if (bias.has_value() && bias->defined()) padded_bias = torch::cat({*bias, torch::zeros({kNB - w.size(0)}, bias->options())});
    return small_linear(x, padded, padded_bias).narrow(1, 0, w.size(0)).contiguous();
  }
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "bias [N] float32 expected");
  }
  auto y = torch::empty({M, N}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kNB - 1) / kNB;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n = nb * kNB;
      const int64_t start = std::min(n, N - kNB);  // the last block overlaps the one before it
      rows_block<kNB>(xp, wp + start * K, bp ? bp + start : nullptr, yp + start, M, K, N, static_cast<int>(n - start));
    }
  });
  return y;
}
