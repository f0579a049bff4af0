// Small-M GEMM for decode: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for M <= 8 rows.
//
// Decode at small batch is bound by reading the weights once per step; the inner loop streams
// each weight row once, widens it to fp32 (bf16: shift; fp16: F16C) and multiplies it against
// every x row held in L1, accumulating in fp32. Output rows are split across torch's threads.
// Narrow headers (not torch/extension.h) keep the one-time build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NFX_AVX2 1
#endif

namespace {

inline float load1(const float* p) { return *p; }
inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline float load1(const c10::Half* p) { return static_cast<float>(*p); }

#ifdef NFX_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// MT rows of x (fp32, row stride K) against NT rows of w starting at row n; writes out[m*N + n + j].
template <typename W, int MT, int NT>
inline void tile(const float* x, const W* w, int64_t K, int64_t N, int64_t n, float* out) {
  int64_t k = 0;
  float acc_s[MT][NT] = {};
#ifdef NFX_AVX2
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load8(w + (n + j) * K + k);
    for (int m = 0; m < MT; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc_s[m][j] = hsum(acc[m][j]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) acc_s[m][j] += x[m * K + k] * load1(w + (n + j) * K + k);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) out[m * N + n + j] = acc_s[m][j];
}

#ifdef NFX_AVX2
// bf16 weights, 16 per step: unpacking against zero puts each bf16 in the high half of an fp32
// lane (one instruction per 8 weights) but in lane order [0-3, 8-11] / [4-7, 12-15]; ``xp`` holds
// x already permuted to that order (see permute_x), so the products pair up.
template <int MT, int NT>
inline void tile_bf16(const float* xp, const c10::BFloat16* w, int64_t K, int64_t N, int64_t n, float* out) {
  const int64_t K16 = K / 16 * 16;
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 lo[NT], hi[NT];
    for (int j = 0; j < NT; ++j) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + j) * K + k));
      lo[j] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
      hi[j] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    }
    for (int m = 0; m < MT; ++m) {
      __m256 xl = _mm256_loadu_ps(xp + m * K + k), xh = _mm256_loadu_ps(xp + m * K + k + 8);
      for (int j = 0; j < NT; ++j) {
        acc[m][j] = _mm256_fmadd_ps(xl, lo[j], acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(xh, hi[j], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      float a = hsum(acc[m][j]);
      for (int64_t k = K16; k < K; ++k) a += xp[m * K + k] * static_cast<float>(w[(n + j) * K + k]);
      out[m * N + n + j] = a;
    }
}

#endif

// x rows (M, K) -> the lane order tile_bf16 expects, per 16-block; the K % 16 tail is unchanged.
at::Tensor permute_x(const at::Tensor& x32) {
  const int64_t M = x32.size(0), K = x32.size(1), K16 = K / 16 * 16;
  auto xp = x32.clone();
  const float* src = x32.data_ptr<float>();
  float* dst = xp.data_ptr<float>();
  static const int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K16; k += 16)
      for (int i = 0; i < 16; ++i) dst[m * K + k + i] = src[m * K + k + order[i]];
  return xp;
}

// bf16 weights take the 16-wide path when it is compiled in (x then arrives permuted).
template <typename W, int MT, int NT>
inline void tile_any(const float* x, const W* w, int64_t K, int64_t N, int64_t n, float* out) {
#ifdef NFX_AVX2
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    tile_bf16<MT, NT>(x, w, K, N, n, out);
    return;
  }
#endif
  tile<W, MT, NT>(x, w, K, N, n, out);
}

// Rows [n0, n1) of the output for MT rows of x; NT output rows per tile keeps MT * NT
// accumulators (<= 8) in registers next to the NT weight vectors.
template <typename W, int MT>
void rows(const float* x, const W* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  constexpr int NT = MT >= 8 ? 1 : (MT >= 4 ? 2 : 4);
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile_any<W, MT, NT>(x, w, K, N, n, out);
  for (; n < n1; ++n) tile_any<W, MT, 1>(x, w, K, N, n, out);
}

template <typename W>
void rows_m(const float* x, int64_t M, const W* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows<W, 8>(x + m * K, w, K, N, n0, n1, out + m * N);
  if (M - m >= 4) { rows<W, 4>(x + m * K, w, K, N, n0, n1, out + m * N); m += 4; }
  if (M - m >= 2) { rows<W, 2>(x + m * K, w, K, N, n0, n1, out + m * N); m += 2; }
  if (M - m >= 1) { rows<W, 1>(x + m * K, w, K, N, n0, n1, out + m * N); }
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "small_gemm: weight must be a contiguous (N, K) matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.size(-1) == K, "small_gemm: x has ", x.size(-1), " features, weight expects ", K);
  auto x32 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x32.size(0);
  auto out = at::empty({M, N}, x32.options());
  const float* xp = x32.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef NFX_AVX2
  const bool permuted = w.scalar_type() == at::kBFloat16;  // tile_bf16's lane order
#else
  const bool permuted = false;
#endif
  auto xperm = permuted ? permute_x(x32) : x32;
  const float* xq = xperm.data_ptr<float>();
  // Grain: ~64 output rows per task keeps both threads busy on the 192-row K/V projections.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (w.scalar_type()) {
      case at::kFloat: rows_m(xp, M, w.data_ptr<float>(), K, N, n0, n1, op); break;
      case at::kBFloat16: rows_m(xq, M, w.data_ptr<c10::BFloat16>(), K, N, n0, n1, op); break;
      case at::kHalf: rows_m(xp, M, w.data_ptr<c10::Half>(), K, N, n0, n1, op); break;
      default: TORCH_CHECK(false, "small_gemm: weight dtype ", w.scalar_type(), " is not float32/bfloat16/float16");
    }
  });
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY(neuronfx, m) { m.def("small_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) { m.impl("small_gemm", &small_gemm); }
