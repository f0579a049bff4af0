// Small-M GEMM for decode: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for M <= 8 rows
// (fp32 weights: up to 64, where torch's GEMM measured slower), and decode attention over the
// KV cache (cached_attention, at the end of the file).
//
// Decode at small batch is bound by reading the weights once per step; the inner loop streams
// each weight row once, widens it to fp32 (bf16: shift; fp16: F16C) and multiplies it against
// every x row held in L1, accumulating in fp32. Output rows are split across torch's threads.
// Narrow headers (not torch/extension.h) keep the one-time build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include "c_shims.h"
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include <unistd.h>
#include "exp16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NFX_AVX2 1
#endif

namespace {

inline float load1(const float* p) { return *p; }
inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline float load1(const c10::Half* p) { return static_cast<float>(*p); }
// KV caches only (kv_cache_dtype): int8 rows carry their scale (row_scale), fp8 is e4m3fn.
inline float load1(const int8_t* p) { return static_cast<float>(*p); }
inline float load1(const c10::Float8_e4m3fn* p) { return static_cast<float>(*p); }

// The 256 values of float8_e4m3fn, decoded once: a gather from this table widens 8 at a time.
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// A stored KV row's scale: 1 for float rows; an int8 row's fp32 scale follows its D values.
template <typename C>
inline float row_scale(const C*, int64_t) { return 1.f; }
inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(float));
  return s;
}

#ifdef NFX_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(fp8_table(), idx, 4);
}
// The same position one tile ahead: a tile's rows are short (1-3 KB), too short for the hardware
// stream prefetcher to ramp up; this measured 10-20% faster at 1 and 8 rows (AMD EPYC, AVX2).
// Into L2 for tiles of up to 4 rows of x (into L1 they evicted lines the tile still read), into
// L1 for taller 16-bit tiles, bound by their instructions (docs/performance.md, CPU kernels).
// Prefetches never fault, so running past the last row is harmless.
template <int MT, typename W>
inline void prefetch(const W* p) { _mm_prefetch(reinterpret_cast<const char*>(p), MT <= 4 ? _MM_HINT_T1 : _MM_HINT_T0); }
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// MT rows of x (fp32, row stride K) against NT rows of w starting at row n; writes out[m*N + n + j].
// ``REG``: empty asm statements pin each loaded vector to a register; GCC otherwise folds a load
// into every FMA that uses it (a 4 x 3 tile then issued 16 loads for 12 FMAs instead of 7).
template <typename W, int MT, int NT, bool REG = false>
inline void tile(const float* x, const W* w, int64_t K, int64_t N, int64_t n, float* out) {
  int64_t k = 0;
  float acc_s[MT][NT] = {};
#ifdef NFX_AVX2
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NT];
    for (int j = 0; j < NT; ++j) prefetch<MT>(w + (n + j + NT) * K + k);
    for (int j = 0; j < NT; ++j) {
      wv[j] = load8(w + (n + j) * K + k);
      if constexpr (REG) asm("" : "+x"(wv[j]));
    }
    for (int m = 0; m < MT; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      if constexpr (REG) asm("" : "+x"(xv));
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc_s[m][j] = hsum(acc[m][j]);
#endif
  // Explicit fma in the tails: left to the compiler, a * b + c was contracted in some tile
  // shapes and not others, and a row's bits then depended on the rows beside it.
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) acc_s[m][j] = std::fma(x[m * K + k], load1(w + (n + j) * K + k), acc_s[m][j]);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) out[m * N + n + j] = acc_s[m][j];
}

#ifdef NFX_AVX2
// bf16 weights, 16 per step: unpacking against zero puts each bf16 in the high half of an fp32
// lane (one instruction per 8 weights) but in lane order [0-3, 8-11] / [4-7, 12-15]; ``xp`` holds
// x already permuted to that order (see widen_x), so the products pair up.
template <int MT, int NT>
inline void tile_bf16(const float* xp, const c10::BFloat16* w, int64_t K, int64_t N, int64_t n, float* out) {
  const int64_t K16 = K / 16 * 16;
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 lo[NT], hi[NT];
    for (int j = 0; j < NT; ++j) prefetch<MT>(w + (n + j + NT) * K + k);
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
      for (int64_t k = K16; k < K; ++k) a = std::fma(xp[m * K + k], static_cast<float>(w[(n + j) * K + k]), a);
      out[m * N + n + j] = a;
    }
}

#endif

// x (M, K), any float dtype -> fp32 rows in the lane order tile_bf16 expects when ``permute``
// (per 16-block; the K % 16 tail unchanged). Plain loops: no dispatcher ops per call.
template <typename X>
void widen_x(const X* src, int64_t M, int64_t K, bool permute, float* dst) {
  static const int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  const int64_t K16 = permute ? K / 16 * 16 : 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K16; k += 16)
      for (int i = 0; i < 16; ++i) dst[m * K + k + i] = static_cast<float>(src[m * K + k + order[i]]);
    for (int64_t k = K16; k < K; ++k) dst[m * K + k] = static_cast<float>(src[m * K + k]);
  }
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
// accumulators (<= 8, one row: 4) in registers next to the NT weight vectors.
template <typename W, int MT>
void rows(const float* x, const W* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  constexpr int NT = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile_any<W, MT, NT>(x, w, K, N, n, out);
  for (; n < n1; ++n) tile_any<W, MT, 1>(x, w, K, N, n, out);
}

// fp32 weights against 5 or more rows of x: 4 x 3 tiles, the weight tile outer. Twelve
// accumulators cover the FMA latency, 7 loads feed 12 FMAs (an 8 x 1 tile: 9 for 8), and the
// three weight rows stay in L1 while every group of four rows passes them. Each output sums in
// the same order as in any other tile, so a row's bits do not depend on the rows beside it.
// SmolLM2's products, 2 threads, AVX2: 5 rows 23.3 ms vs 25.4, 8 rows 28.4 vs 30.9, 32 rows
// 75.5 vs 97.0 (torch's GEMM 131.5), 64 rows 149 vs 196 (torch 190).
constexpr int64_t kWideTileRows = 5;

template <int NT>
void wide_tiles(const float* x, int64_t M, const float* w, int64_t K, int64_t N, int64_t n, float* out) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<float, 4, NT, true>(x + m * K, w, K, N, n, out + m * N);
  x += m * K, out += m * N;
  switch (M - m) {
    case 1: tile<float, 1, NT, true>(x, w, K, N, n, out); break;
    case 2: tile<float, 2, NT, true>(x, w, K, N, n, out); break;
    case 3: tile<float, 3, NT, true>(x, w, K, N, n, out); break;
    default: break;
  }
}

void wide_rows(const float* x, int64_t M, const float* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  int64_t n = n0;
  for (; n + 3 <= n1; n += 3) wide_tiles<3>(x, M, w, K, N, n, out);
  for (; n < n1; ++n) wide_tiles<1>(x, M, w, K, N, n, out);
}

template <typename W>
void rows_m(const float* x, int64_t M, const W* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
#ifdef NFX_AVX2
  if constexpr (std::is_same_v<W, float>) {
    if (M >= kWideTileRows) return wide_rows(x, M, w, K, N, n0, n1, out);
  }
#endif
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows<W, 8>(x + m * K, w, K, N, n0, n1, out + m * N);
  // 16-bit weights (and fp32 without AVX2): the rest in one pass over the weights (5 rows: once,
  // not as 4 and 1: twice from memory).
  x += m * K, out += m * N;
  switch (M - m) {
    case 1: rows<W, 1>(x, w, K, N, n0, n1, out); break;
    case 2: rows<W, 2>(x, w, K, N, n0, n1, out); break;
    case 3: rows<W, 3>(x, w, K, N, n0, n1, out); break;
    case 4: rows<W, 4>(x, w, K, N, n0, n1, out); break;
    case 5: rows<W, 5>(x, w, K, N, n0, n1, out); break;
    case 6: rows<W, 6>(x, w, K, N, n0, n1, out); break;
    case 7: rows<W, 7>(x, w, K, N, n0, n1, out); break;
    default: break;
  }
}

// out[m, n] for n in [n0, n1) into acc (M, N) fp32, by weight dtype.
void gemm_rows(const float* xq, int64_t M, const at::Tensor& w, int64_t n0, int64_t n1, float* acc) {
  const int64_t N = w.size(0), K = w.size(1);
  switch (w.scalar_type()) {
    case at::kFloat: rows_m(xq, M, w.data_ptr<float>(), K, N, n0, n1, acc); break;
    case at::kBFloat16: rows_m(xq, M, w.data_ptr<c10::BFloat16>(), K, N, n0, n1, acc); break;
    case at::kHalf: rows_m(xq, M, w.data_ptr<c10::Half>(), K, N, n0, n1, acc); break;
    default: TORCH_CHECK(false, "small_gemm: weight dtype ", w.scalar_type(), " is not float32/bfloat16/float16");
  }
}

// Writes out[m, col0 + n] = f(m, n) for n in [n0, n1) in out's dtype; out's rows are ld long.
template <typename F>
void store_rows(at::Tensor& out, int64_t M, int64_t ld, int64_t col0, int64_t n0, int64_t n1, F f) {
  auto put = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) o[m * ld + col0 + n] = static_cast<T>(f(m, n));
  };
  switch (out.scalar_type()) {
    case at::kFloat: put(out.data_ptr<float>()); break;
    case at::kBFloat16: put(out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: put(out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "small_gemm: x dtype ", out.scalar_type(), " is not float32/bfloat16/float16");
  }
}

// x (..., K) -> fp32 (M, K) in the weights' lane order (bf16 weights: permuted).
at::Tensor prepare_x(const at::Tensor& x, int64_t K, at::ScalarType wtype) {
  TORCH_CHECK(x.size(-1) == K, "small_gemm: x has ", x.size(-1), " features, weight expects ", K);
  auto xc = x.contiguous();
  const int64_t M = x.numel() / K;
#ifdef NFX_AVX2
  const bool permute = wtype == at::kBFloat16;  // tile_bf16's lane order
#else
  const bool permute = false;
#endif
  auto xq = at::empty({M, K}, x.options().dtype(at::kFloat));
  float* dst = xq.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: widen_x(xc.data_ptr<float>(), M, K, permute, dst); break;
    case at::kBFloat16: widen_x(xc.data_ptr<c10::BFloat16>(), M, K, permute, dst); break;
    case at::kHalf: widen_x(xc.data_ptr<c10::Half>(), M, K, permute, dst); break;
    default: TORCH_CHECK(false, "small_gemm: x dtype ", x.scalar_type(), " is not float32/bfloat16/float16");
  }
  return xq;
}

void check_weight(const at::Tensor& w, int64_t K, at::ScalarType wtype) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "small_gemm: weight must be a contiguous (N, K) matrix");
  TORCH_CHECK(w.size(1) == K, "small_gemm: weight has ", w.size(1), " features, expected ", K);
  TORCH_CHECK(w.scalar_type() == wtype, "small_gemm: weights of one call must share a dtype");
}

at::Tensor out_like(const at::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options());
}

// Grain: ~64 output rows per task keeps both threads busy on the 192-row K/V projections.
constexpr int64_t GRAIN = 64;

// x @ w_i.T (+ bias_i) for every weight of ``ws`` (same K and dtype) in one parallel region:
// fused Q/K/V projections cost one call and one fork/join instead of three.
// One output, the weights' columns side by side (one tensor, not a list: inductor's C++ wrapper
// calls an op with tensor results through the dispatcher, a list result back through Python).
at::Tensor gemm_multi(const at::Tensor& x, at::TensorList ws, at::ArrayRef<c10::optional<at::Tensor>> biases) {
  TORCH_CHECK(!ws.empty() && biases.size() == ws.size(), "small_gemm: one bias (or None) per weight");
  const int64_t K = ws[0].size(1);
  const auto wtype = ws[0].scalar_type();
  std::vector<int64_t> offset = {0};
  std::vector<at::Tensor> accs;
  for (const auto& w : ws) {
    check_weight(w, K, wtype);
    offset.push_back(offset.back() + w.size(0));
  }
  auto xq = prepare_x(x, K, wtype);
  const int64_t M = xq.size(0), total = offset.back();
  std::vector<const float*> bias32(ws.size(), nullptr);
  std::vector<at::Tensor> keep;  // fp32 copies of the biases, alive for the parallel region
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!biases[i].has_value()) continue;
    TORCH_CHECK(biases[i]->numel() == ws[i].size(0), "small_gemm: bias has ", biases[i]->numel(), " values, weight has ", ws[i].size(0), " rows");
    keep.push_back(biases[i]->to(at::kFloat).contiguous());
    bias32[i] = keep.back().data_ptr<float>();
  }
  auto out = out_like(x, total);
  for (size_t i = 0; i < ws.size(); ++i) accs.push_back(at::empty({M, ws[i].size(0)}, xq.options()));
  at::parallel_for(0, total, GRAIN, [&](int64_t r0, int64_t r1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t n0 = std::max(r0, offset[i]) - offset[i], n1 = std::min(r1, offset[i + 1]) - offset[i];
      if (n0 >= n1) continue;
      const int64_t N = ws[i].size(0);
      float* acc = accs[i].data_ptr<float>();
      gemm_rows(xq.data_ptr<float>(), M, ws[i], n0, n1, acc);
      const float* b = bias32[i];
      store_rows(out, M, total, offset[i], n0, n1, [&](int64_t m, int64_t n) { return acc[m * N + n] + (b ? b[n] : 0.f); });
    }
  });
  return out;
}

// The op: up to three weights as separate arguments, not a Tensor[]. Inductor's C++ wrapper calls
// an op whose arguments are all Tensor, Tensor?, int or bool through its C shim; a list argument
// makes it include the dispatcher's headers instead (about 4 s more g++ per compiled layer group).
at::Tensor small_gemm_multi(const at::Tensor& x, const at::Tensor& w0, const c10::optional<at::Tensor>& w1,
                            const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& b0,
                            const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& b2) {
  TORCH_CHECK(w1.has_value() || !w2.has_value(), "small_gemm_multi: w2 given without w1");
  std::vector<at::Tensor> ws = {w0};
  std::vector<c10::optional<at::Tensor>> bs = {b0};
  if (w1.has_value()) ws.push_back(*w1), bs.push_back(b1);
  if (w2.has_value()) ws.push_back(*w2), bs.push_back(b2);
  return gemm_multi(x, ws, bs);
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  std::vector<c10::optional<at::Tensor>> b = {bias};
  return gemm_multi(x, {w}, b);
}

// SwiGLU's first half, silu(x @ gate.T) * (x @ up.T), in one parallel region; the product is
// formed from the fp32 accumulators and rounded once to x's dtype.
at::Tensor small_glu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
  const int64_t K = gate.size(1), N = gate.size(0);
  check_weight(gate, K, gate.scalar_type());
  check_weight(up, K, gate.scalar_type());
  TORCH_CHECK(up.size(0) == N, "small_glu: gate has ", N, " rows, up has ", up.size(0));
  auto xq = prepare_x(x, K, gate.scalar_type());
  const int64_t M = xq.size(0);
  auto out = out_like(x, N);
  auto g = at::empty({M, N}, xq.options()), u = at::empty({M, N}, xq.options());
  float* gp = g.data_ptr<float>();
  float* up_ = u.data_ptr<float>();
  at::parallel_for(0, N, GRAIN / 2, [&](int64_t n0, int64_t n1) {
    gemm_rows(xq.data_ptr<float>(), M, gate, n0, n1, gp);
    gemm_rows(xq.data_ptr<float>(), M, up, n0, n1, up_);
    store_rows(out, M, N, 0, n0, n1, [&](int64_t m, int64_t n) {
      const float a = gp[m * N + n];
      return a / (1.f + std::exp(-a)) * up_[m * N + n];
    });
  });
  return out;
}

// ---- decode attention over the KV cache ---------------------------------------------------------
// out[b, h, t] = softmax_j(q[b, h, t] . k[j] / sqrt(D), j attended) @ v[j] for the T new tokens
// of row b over its first S cache positions (k, v: KV head h / (H / H_kv), HF repeat_kv). The
// cache is paged: (num_blocks, H_kv, block_size, W), and row b's position j lies in block
// block_table[b, j / block_size] at offset j % block_size (the slots layout is one block per row).
// What positions the mask hides hold (NaN included) cannot leak: their scores become -inf and
// their values are never added (groups of four hidden keys are not even read; an int8 value
// row's weight there is 0, never its scale times anything); a token that attends nothing gets
// zeros. A NaN or +inf score at an attended position makes its token's output NaN (as SDPA's). One task per (row, KV head) or per row (attend_row); scores in two passes
// (scores, then exp and the weighted sum of values), exp vectorised (Cephes expf's polynomial).

#ifdef NFX_AVX2
// e^x for x <= 0 (scores minus their max), about 1 ulp: x = n ln2 + r, e^r by Cephes expf's
// degree-5 polynomial, 2^n through the exponent bits; x below -87 gives 2^-126 e^r (negligible
// against the max's weight 1).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// q . k_i over D for the four keys k + i * ld: four independent FMA chains, one transposing
// reduction (a key per dot product would wait on a horizontal sum each).
template <typename C>
inline void dot4(const float* q, const C* k, int64_t ld, int64_t D, float* out) {
  int64_t d = 0;
  out[0] = out[1] = out[2] = out[3] = 0.f;
#ifdef NFX_AVX2
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(qv, load8(k + i * ld + d), a[i]);
  }
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#endif
  for (; d < D; ++d)
    for (int i = 0; i < 4; ++i) out[i] += q[d] * load1(k + i * ld + d);
}

template <typename C>
inline float dot(const float* q, const C* k, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * load1(k + d);
  return s;
}

// acc[d] += sum_i p[i] * v_i[d] over D for the N values v + i * ld.
template <int N, typename C>
inline void axpy(const float* p, const C* v, int64_t ld, int64_t D, float* acc) {
  int64_t d = 0;
#ifdef NFX_AVX2
  __m256 pv[N];
  for (int i = 0; i < N; ++i) pv[i] = _mm256_set1_ps(p[i]);
  for (; d + 8 <= D; d += 8) {
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int i = 0; i < N; ++i) a = _mm256_fmadd_ps(pv[i], load8(v + i * ld + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
#endif
  for (; d < D; ++d)
    for (int i = 0; i < N; ++i) acc[d] += p[i] * load1(v + i * ld + d);
}

#if defined(NFX_AVX2) && defined(__AVX512F__)
#define NFX_ATTN_AVX512 1
// 16 cache values widened to fp32 (the AVX-512 forms of load8).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), fp8_table(), 4);
}
inline __m256 halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// The R x 4 dot products of query rows q + r * D with keys k + i * ld (D a multiple of 16): each
// key chunk is loaded and widened once for all R rows (the query heads sharing the KV head).
template <int R, typename C>
inline void dot_rows(const float* q, const C* k, int64_t ld, int64_t D, float* out) {
  __m512 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 k0 = load16(k + d), k1 = load16(k + ld + d), k2 = load16(k + 2 * ld + d), k3 = load16(k + 3 * ld + d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * D + d);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(halves(acc[r][0]), halves(acc[r][1])),
                                       _mm256_hadd_ps(halves(acc[r][2]), halves(acc[r][3])));
    _mm_storeu_ps(out + 4 * r, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
}

// out rows r (stride D) += sum_i p[4 r + i] * v_i for the 4 values v + i * ld, each value chunk
// loaded and widened once for all R rows.
template <int R, typename C>
inline void axpy_rows(const float* p, const C* v, int64_t ld, int64_t D, float* out) {
  __m512 pv[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) pv[r][i] = _mm512_set1_ps(p[4 * r + i]);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v0 = load16(v + d), v1 = load16(v + ld + d), v2 = load16(v + 2 * ld + d), v3 = load16(v + 3 * ld + d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m512 a = _mm512_loadu_ps(out + r * D + d);
      a = _mm512_fmadd_ps(pv[r][0], v0, a);
      a = _mm512_fmadd_ps(pv[r][1], v1, a);
      a = _mm512_fmadd_ps(pv[r][2], v2, a);
      a = _mm512_fmadd_ps(pv[r][3], v3, a);
      _mm512_storeu_ps(out + r * D + d, a);
    }
  }
}
#endif

#if defined(NFX_AVX2) && !defined(NFX_ATTN_AVX512)
#define NFX_ATTN_AVX2 1
// The AVX2 forms of dot_rows / axpy_rows (8 lanes, D a multiple of 8), for up to 3 rows: 3 x 4
// accumulators, 3 query chunks and one key fill the 16 registers. Each (row, key) sum runs in
// dot4's order and each output in axpy<4>'s, so the results are theirs bit for bit; what changes
// is that a key or value chunk is widened once for all R rows, not once per row (an int8 or bf16
// chunk costs two instructions to widen, the product one).
template <int R, typename C>
inline void dot_rows8(const float* q, const C* k, int64_t ld, int64_t D, float* out) {
  __m256 acc[R][4];
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q + r * D + d);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = load8(k + i * ld + d);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(qv[r], kv, acc[r][i]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
    _mm_storeu_ps(out + 4 * r, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
}

template <int R, typename C>
inline void axpy_rows8(const float* p, const C* v, int64_t ld, int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 v0 = load8(v + d), v1 = load8(v + ld + d), v2 = load8(v + 2 * ld + d), v3 = load8(v + 3 * ld + d);
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_loadu_ps(out + r * D + d);
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[4 * r]), v0, a);
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[4 * r + 1]), v1, a);
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[4 * r + 2]), v2, a);
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[4 * r + 3]), v3, a);
      _mm256_storeu_ps(out + r * D + d, a);
    }
  }
}
#endif

// dots[4 r + i] = q_r . k_i for n <= 4 query rows (stride D) and 4 keys (stride ld).
template <typename C>
inline void dots_4keys(int64_t n, const float* q, const C* k, int64_t ld, int64_t D, float* dots) {
#ifdef NFX_ATTN_AVX512
  if (D % 16 == 0) {
    switch (n) {
      case 4: return dot_rows<4>(q, k, ld, D, dots);
      case 3: return dot_rows<3>(q, k, ld, D, dots);
      case 2: return dot_rows<2>(q, k, ld, D, dots);
      default: return dot_rows<1>(q, k, ld, D, dots);
    }
  }
#endif
#ifdef NFX_ATTN_AVX2
  if (D % 8 == 0) {
    switch (n) {
      case 4: dot_rows8<2>(q, k, ld, D, dots); return dot_rows8<2>(q + 2 * D, k, ld, D, dots + 8);
      case 3: return dot_rows8<3>(q, k, ld, D, dots);
      case 2: return dot_rows8<2>(q, k, ld, D, dots);
      default: return dot_rows8<1>(q, k, ld, D, dots);
    }
  }
#endif
  for (int64_t r = 0; r < n; ++r) dot4(q + r * D, k, ld, D, dots + 4 * r);
}

// out rows r += sum_i p[4 r + i] * v_i for n <= 4 rows (stride D) and 4 values (stride ld).
template <typename C>
inline void axpy_4values(int64_t n, const float* p, const C* v, int64_t ld, int64_t D, float* out) {
#ifdef NFX_ATTN_AVX512
  if (D % 16 == 0) {
    switch (n) {
      case 4: return axpy_rows<4>(p, v, ld, D, out);
      case 3: return axpy_rows<3>(p, v, ld, D, out);
      case 2: return axpy_rows<2>(p, v, ld, D, out);
      default: return axpy_rows<1>(p, v, ld, D, out);
    }
  }
#endif
#ifdef NFX_ATTN_AVX2
  if (D % 8 == 0) {
    switch (n) {
      case 4: axpy_rows8<2>(p, v, ld, D, out); return axpy_rows8<2>(p + 8, v, ld, D, out + 2 * D);
      case 3: return axpy_rows8<3>(p, v, ld, D, out);
      case 2: return axpy_rows8<2>(p, v, ld, D, out);
      default: return axpy_rows8<1>(p, v, ld, D, out);
    }
  }
#endif
  for (int64_t r = 0; r < n; ++r) axpy<4>(p + 4 * r, v, ld, D, out + r * D);
}

// w (S scores) -> e^(w - max) where finite, 0 where -inf; returns their sum (0 when every
// score is -inf: the row attends nothing). A NaN or +inf score (a NaN or inf in an attended key
// or the query) makes the row NaN, as SDPA's softmax does (inf - inf): the weights are zeroed
// and the sum is NaN, so normalise turns the row's output NaN and the step's NaN report sees it.
// The SIMD max alone would skip a NaN lane and the -inf test below would then weight it 0.
inline float softmax_weights(float* w, int64_t S) {
  float mx = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#ifdef NFX_ATTN_AVX512
  // 16 lanes (exp16): half the instructions of 8, the same weights (one polynomial), the sum
  // in 16-lane chunks from position 0 whatever S is
  __m512 top16 = _mm512_set1_ps(-INFINITY);
  __mmask16 nan16 = 0;
  for (; j < S; j += 16) {  // the last chunk masked (its other lanes -inf): no scalar tail
    const __mmask16 live = S - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (S - j)) - 1);
    const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, w + j);
    nan16 |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    top16 = _mm512_max_ps(s, top16);
  }
  mx = _mm512_reduce_max_ps(top16);
  nan = nan16 != 0;
#elif defined(NFX_AVX2)
  // the max is exact in any order; NaN lanes are flagged apart (max_ps keeps its second operand)
  __m256 top = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
  for (; j + 8 <= S; j += 8) {
    const __m256 s = _mm256_loadu_ps(w + j);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
    top = _mm256_max_ps(s, top);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (const float x : lanes) mx = std::max(mx, x);
  nan = _mm256_movemask_ps(nan8) != 0;
#endif
  for (; j < S; ++j) {
    nan |= std::isnan(w[j]);
    mx = std::max(mx, w[j]);
  }
  if (nan || mx == INFINITY) {
    std::fill(w, w + S, 0.f);
    return NAN;
  }
  if (mx == -INFINITY) {
    std::fill(w, w + S, 0.f);
    return 0.f;
  }
  j = 0;
  float sum = 0.f;
#ifdef NFX_ATTN_AVX512
  __m512 sv16 = _mm512_setzero_ps();
  const __m512 m16 = _mm512_set1_ps(mx), ninf16 = _mm512_set1_ps(-INFINITY);
  for (; j < S; j += 16) {  // the last chunk's lanes past S add 0, as -inf positions of a longer bucket do
    const __mmask16 live = S - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (S - j)) - 1);
    const __m512 s = _mm512_mask_loadu_ps(ninf16, live, w + j);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, ninf16, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(s, m16)));
    _mm512_mask_storeu_ps(w + j, live, e);
    sv16 = _mm512_add_ps(sv16, e);
  }
  sum = _mm512_reduce_add_ps(sv16);
#elif defined(NFX_AVX2)
  __m256 sv = _mm256_setzero_ps();
  const __m256 m8 = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= S; j += 8) {
    const __m256 s = _mm256_loadu_ps(w + j);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(s, m8)), _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(w + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  sum = hsum(sv);
#endif
  for (; j < S; ++j) {
    w[j] = w[j] == -INFINITY ? 0.f : std::exp(w[j] - mx);
    sum += w[j];
  }
  return sum;
}

// This core's L2 bytes (sysconf; 1 MiB where it does not say).
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE  // glibc's; musl and macOS do not have it
    const long b = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long b = 0;
#endif
    return b > 0 ? static_cast<int64_t>(b) : int64_t{1} << 20;
  }();
  return bytes;
}

constexpr int64_t kAhead = 32;  // positions; a multiple of 4, so 4 keys there share a block (values: when S % 4 == 0)

// Prefetches the 4 cache rows (stride ld elements) at p into L1, one cache line at a time.
template <typename C>
inline void prefetch4(const C* p, int64_t ld) {
  const char* b = reinterpret_cast<const char*>(p);
  const int64_t bytes = 4 * ld * static_cast<int64_t>(sizeof(C));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(b + off, 0, 3);
}

// Whether any (all) of the T mask rows (stride S) attends keys j .. j + 3.
inline bool any4(const bool* m, int64_t T, int64_t S, int64_t j) {
  bool any = false;
  for (int64_t t = 0; t < T; ++t) any |= m[t * S + j] | m[t * S + j + 1] | m[t * S + j + 2] | m[t * S + j + 3];
  return any;
}
inline bool all4(const bool* m, int64_t T, int64_t S, int64_t j) {
  bool all = true;
  for (int64_t t = 0; t < T; ++t) all &= m[t * S + j] & m[t * S + j + 1] & m[t * S + j + 2] & m[t * S + j + 3];
  return all;
}

// p[i] = w[i] * vs[i] for 4 positions.
inline void scale4(const float* w, const float* vs, float* p) {
#ifdef NFX_AVX2
  _mm_storeu_ps(p, _mm_mul_ps(_mm_loadu_ps(w), _mm_loadu_ps(vs)));
#else
  for (int i = 0; i < 4; ++i) p[i] = w[i] * vs[i];
#endif
}

// The rows of 4 keys kAhead positions after j, then (past the keys) the values; null past both.
template <typename C>
inline const C* upcoming(const C* const* kb, const C* const* vb, int64_t bs, int64_t ld, int64_t S, int64_t j) {
  const int64_t a = j + kAhead;
  if (a + 4 <= S) return kb[a / bs] + (a % bs) * ld;
  if (a >= S && a - S + 4 <= S) return vb[(a - S) / bs] + ((a - S) % bs) * ld;
  return nullptr;
}

// ---- int8 keys: q . k in integers ---------------------------------------------------------------
// Each query row is rounded to int16 with one scale per row (its largest |q| / 32767: an error of
// at most 2^-16 of that |q|, against the int8 key's 2^-8 of its own), and its products with an
// int8 key row sum exactly in int32 (|sum| <= 512 x 32767 x 128 < 2^31 for D <= kInt8MaxHeadDim):
// vpmaddwd does 16 of them in one instruction where the float form widens 8 keys in two and
// multiplies them in a third. The sums are exact, so every path (SIMD, tails, scalar) gives the
// same bits; a score is then (float(sum) * qscale) * k_scale in fp32, qscale = (max / 32767) * scale.
constexpr int64_t kInt8MaxHeadDim = 512;  // config/kv.py INT8_MAX_HEAD_DIM
// A row whose largest |q| is below this multiplies as zeros (32767 / max would overflow fp32).
constexpr float kMinQueryMax = 1e-30f;
// q16 is read 16 values at a time: a row's last 8 values read 8 past it (times zero keys).
constexpr int64_t kQueryPad = 16;

// q (R, D) float -> q16 (R, D) and qscale[r] = (max |q_r| / 32767) * scale. A row holding a NaN
// or an infinity gets a NaN scale (every score NaN: the row's output is NaN, as a float cache's
// NaN products make it); a row below kMinQueryMax gets zeros and scale 0 (uniform weights).
inline void round_queries(const float* q, int64_t R, int64_t D, float scale, int16_t* q16, float* qscale) {
  for (int64_t r = 0; r < R; ++r) {
    const float* row = q + r * D;
    float mx = 0.f;
    bool finite = true;
    for (int64_t d = 0; d < D; ++d) {
      finite &= std::isfinite(row[d]);
      mx = std::max(mx, std::fabs(row[d]));
    }
    const bool usable = finite && mx >= kMinQueryMax;
    const float inv = usable ? 32767.f / mx : 0.f;
    for (int64_t d = 0; d < D; ++d) q16[r * D + d] = usable ? static_cast<int16_t>(std::nearbyint(row[d] * inv)) : 0;
    qscale[r] = !finite ? NAN : usable ? mx / 32767.f * scale : 0.f;
  }
}

inline int32_t dot_i16(const int16_t* q, const int8_t* k, int64_t D) {
  int32_t s = 0;
  for (int64_t d = 0; d < D; ++d) s += static_cast<int32_t>(q[d]) * static_cast<int32_t>(k[d]);
  return s;
}

#ifdef NFX_AVX2
// sums[4 r + i] = q_r . k_i for NR rows of q16 (stride D, kQueryPad readable past the last) and
// the 4 keys k + i * ld: 16 values at a time, then 8 (the keys' upper 8 lanes zero), then scalar.
template <int NR>
inline void dots_i16_rows(const int16_t* q, const int8_t* k, int64_t ld, int64_t D, int32_t* sums) {
  __m256i acc[NR][4];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_si256();
  const int64_t D8 = D / 8 * 8;
  for (int64_t d = 0; d < D8; d += 16) {
    const bool whole = d + 16 <= D8;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m128i* kp = reinterpret_cast<const __m128i*>(k + i * ld + d);
      const __m256i kv = _mm256_cvtepi8_epi16(whole ? _mm_loadu_si128(kp) : _mm_loadl_epi64(kp));
#pragma GCC unroll 3
      for (int r = 0; r < NR; ++r)
        acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * D + d)), kv));
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]), _mm256_hadd_epi32(acc[r][2], acc[r][3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums + 4 * r), _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
    for (int i = 0; D8 < D && i < 4; ++i) sums[4 * r + i] += dot_i16(q + r * D + D8, k + i * ld + D8, D - D8);
  }
}
#endif

#if defined(NFX_ATTN_AVX512) && defined(__AVX512BW__)
#define NFX_ATTN_I16_512 1
// acc + the sums of pairs of q's and k's int16 products: one vpdpwssd where AVX512-VNNI is.
inline __m512i mac_i16(__m512i acc, __m512i q, __m512i k) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, q, k);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(q, k));
#endif
}

// The 4 sums of a0..a3's 16 lanes each, into out[0..3] (in any order of addition: integers).
inline void sums4_512(__m512i a0, __m512i a1, __m512i a2, __m512i a3, int32_t* out) {
  const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23));  // each 128-bit lane: a0 a1 a2 a3
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

// dots_i16_rows in 32 lanes for D a multiple of 32: each key chunk widened once for the NR rows,
// one vpdpwssd per row where the 256-bit form took a vpmaddwd and an add per 16 values.
template <int NR>
inline void dots_i16_rows512(const int16_t* q, const int8_t* k, int64_t ld, int64_t D, int32_t* sums) {
  __m512i acc[NR][4];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_si512();
  for (int64_t d = 0; d < D; d += 32) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + i * ld + d)));
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r][i] = mac_i16(acc[r][i], _mm512_loadu_si512(q + r * D + d), kv);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) sums4_512(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums + 4 * r);
}
#endif

// sums[4 r + i] = q_r . k_i for n <= 4 rows of q16 (stride D) and the 4 keys k + i * ld.
inline void dots_i16_4keys(int64_t n, const int16_t* q, const int8_t* k, int64_t ld, int64_t D, int32_t* sums) {
#ifdef NFX_ATTN_I16_512
  if (D % 32 == 0) {
    switch (n) {
      case 4: return dots_i16_rows512<4>(q, k, ld, D, sums);
      case 3: return dots_i16_rows512<3>(q, k, ld, D, sums);
      case 2: return dots_i16_rows512<2>(q, k, ld, D, sums);
      default: return dots_i16_rows512<1>(q, k, ld, D, sums);
    }
  }
#endif
#ifdef NFX_AVX2
  switch (n) {
    case 4: dots_i16_rows<2>(q, k, ld, D, sums); return dots_i16_rows<2>(q + 2 * D, k, ld, D, sums + 8);
    case 3: return dots_i16_rows<3>(q, k, ld, D, sums);
    case 2: return dots_i16_rows<2>(q, k, ld, D, sums);
    default: return dots_i16_rows<1>(q, k, ld, D, sums);
  }
#else
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < 4; ++i) sums[4 * r + i] = dot_i16(q + r * D, k + i * ld, D);
#endif
}

// out rows r (R, D) /= sums[r]; a row whose sum is 0 attends nothing and keeps its zeros.
inline void normalise(float* out, const float* sums, int64_t R, int64_t D) {
  for (int64_t r = 0; r < R; ++r) {
    if (sums[r] == 0.f) continue;
    const float inv = 1.f / sums[r];
    for (int64_t d = 0; d < D; ++d) out[r * D + d] *= inv;
  }
}

// w[i] = (sums[i] * qs) * ks[i] where m[i], else -inf, for the 4 keys i.
inline void scores4(const int32_t* sums, float qs, const float* ks, const bool* m, float* w) {
#ifdef NFX_AVX2
  int32_t bits;
  std::memcpy(&bits, m, 4);
  const __m128 keep = _mm_castsi128_ps(_mm_cmpgt_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(bits)), _mm_setzero_si128()));
  const __m128 f = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sums))), _mm_set1_ps(qs)),
                              _mm_loadu_ps(ks));
  _mm_storeu_ps(w, _mm_blendv_ps(_mm_set1_ps(-INFINITY), f, keep));
#else
  for (int i = 0; i < 4; ++i) w[i] = m[i] ? static_cast<float>(sums[i]) * qs * ks[i] : -INFINITY;
#endif
}

// The queries as the key pass multiplies them: float keys take q as it is (FloatQueries), int8
// keys q rounded to int16 (Int16Queries, round_queries). queries_for picks by the key type.
struct FloatQueries {
  const float* q;
  float scale;
};
struct Int16Queries {
  std::vector<int16_t> q16;  // (R, D) and kQueryPad; per task: two small allocations against ~50 us of keys
  std::vector<float> qscale;
};
template <typename C>
inline FloatQueries queries_for(const float* q, int64_t, int64_t, float scale, const C*) { return {q, scale}; }
inline Int16Queries queries_for(const float* q, int64_t R, int64_t D, float scale, const int8_t*) {
  Int16Queries qs{std::vector<int16_t>(R * D + kQueryPad), std::vector<float>(R)};
  round_queries(q, R, D, scale, qs.q16.data(), qs.qscale.data());
  return qs;
}

// w[r * S + i] for the R rows and the 4 keys kj + i * ld (masks, w: at the first of them; row r's
// mask row is r % T): the product times the key's scale, -inf where the mask hides the key.
template <typename C>
inline void scores_4keys(const FloatQueries& qs, const C* kj, int64_t ld, int64_t D, int64_t R, int64_t T, int64_t S,
                         const bool* masks, float* w) {
  float ks[4], dots[16];
  for (int i = 0; i < 4; ++i) ks[i] = qs.scale * row_scale(kj + i * ld, D);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t n = std::min<int64_t>(4, R - r0);
    dots_4keys(n, qs.q + r0 * D, kj, ld, D, dots);
    for (int64_t rr = 0, t = T == 1 ? 0 : r0 % T; rr < n; ++rr, t = t + 1 == T ? 0 : t + 1) {  // t = (r0 + rr) % T without a division
      const bool* m = masks + t * S;
      for (int i = 0; i < 4; ++i) w[(r0 + rr) * S + i] = m[i] ? dots[4 * rr + i] * ks[i] : -INFINITY;
    }
  }
}
inline void scores_4keys(const Int16Queries& qs, const int8_t* kj, int64_t ld, int64_t D, int64_t R, int64_t T, int64_t S,
                         const bool* masks, float* w) {
  float ks[4];
  int32_t sums[16];
  for (int i = 0; i < 4; ++i) ks[i] = row_scale(kj + i * ld, D);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t n = std::min<int64_t>(4, R - r0);
    dots_i16_4keys(n, qs.q16.data() + r0 * D, kj, ld, D, sums);
    for (int64_t rr = 0, t = T == 1 ? 0 : r0 % T; rr < n; ++rr, t = t + 1 == T ? 0 : t + 1)  // t = (r0 + rr) % T without a division
      scores4(sums + 4 * rr, qs.qscale[r0 + rr], ks, masks + t * S, w + (r0 + rr) * S);
  }
}

// Row r's score of the one key kj (the tails after the groups of four), in the same order.
template <typename C>
inline float score_1key(const FloatQueries& qs, int64_t r, const C* kj, int64_t D) {
  return dot(qs.q + r * D, kj, D) * qs.scale * row_scale(kj, D);
}
inline float score_1key(const Int16Queries& qs, int64_t r, const int8_t* kj, int64_t D) {
  return static_cast<float>(dot_i16(qs.q16.data() + r * D, kj, D)) * qs.qscale[r] * row_scale(kj, D);
}

// One past the last position any of the T mask rows (stride S) attends, rounded up to a multiple
// of 8 and at most S: no row sees a position past it, so the passes stop there (a decode row in a
// bucket longer than its context read its rows' prefetch up to 32 positions past them); the
// rounding keeps the AVX2 softmax's 8-lane chunks, and so its sums' bits, those of all S
// positions (the AVX-512 one masks its last chunk: the same sums for any stop).
inline int64_t live_positions(const bool* masks, int64_t T, int64_t S) {
  int64_t last = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = S; j > last; --j)
      if (masks[t * S + j - 1]) {
        last = j;
        break;
      }
  return std::min(S, (last + 7) / 8 * 8);
}

// Scores w[r * S + j] = q_r . k_j * scale (times an int8 key's scale), -inf where row r's mask
// hides j, for the R rows of one KV head (qs: queries_for's form of q (R, D)) and the positions j <
// L (live_positions) of blocks [c_begin, c_end); see attend_row for the layout.
template <typename C, typename Q>
void key_scores(const Q& qs, const C* const* kb, const C* const* vb, int64_t bs, int64_t ld, int64_t S, int64_t L, int64_t D,
                int64_t R, int64_t T, const bool* masks, float* w, int64_t c_begin, int64_t c_end, bool values_too) {
  // Rows are prefetched kAhead positions ahead. Over blocks the hardware prefetcher does not
  // follow a jump to another block, and each block met its first reads cold (SmolLM2's fp32
  // cache, batch 32 x 1,024 positions in blocks of 16, 30 layers, one task per (row, KV head):
  // 125 ms, 12 GB/s; with the prefetch 79 ms; attend_row reaches the prefetched rows later, after
  // the other KV heads' rows of the blocks between). Over one slot's contiguous rows it still left the float caches waiting:
  // batch 8 x 2,000 positions, fp32 30.6 -> 27.2 ms, bf16 18.5 -> 16.5 (int8 unchanged: bound by
  // its instructions), 10-15% at 512 and 1,024 too.
  for (int64_t c = c_begin, j0 = c_begin * bs; c < c_end && j0 < L; ++c, j0 += bs) {  // block c: positions [j0, end), key j at k + (j - j0) * ld
    const int64_t end = std::min(L, j0 + bs);
    const C* k = kb[c];
    int64_t j = j0;
    for (; j + 4 <= end; j += 4) {
      // the keys kAhead on: in this block without upcoming's two divisions where the block is
      // longer than kAhead + 4 (the slots layout's one block per row; blocks of 16 never are)
      if (j + kAhead + 4 <= end) {
        prefetch4(k + (j + kAhead - j0) * ld, ld);
        if (values_too) prefetch4(vb[c] + (j + kAhead - j0) * ld, ld);
      } else if (const C* f = upcoming(kb, vb, bs, ld, L, j)) {
        prefetch4(f, ld);
        if (values_too && j + kAhead + 4 <= L) {  // one division (a % bs as a - ca bs)
          const int64_t a = j + kAhead, ca = a / bs;
          prefetch4(vb[ca] + (a - ca * bs) * ld, ld);
        }
      }
      if (any4(masks, T, S, j)) {
        scores_4keys(qs, k + (j - j0) * ld, ld, D, R, T, S, masks + j, w + j);
        continue;
      }
      for (int64_t r = 0; r < R; ++r) std::fill(w + r * S + j, w + r * S + j + 4, -INFINITY);
    }
    for (; j < end; ++j)
      for (int64_t r = 0; r < R; ++r) w[r * S + j] = masks[(r % T) * S + j] ? score_1key(qs, r, k + (j - j0) * ld, D) : -INFINITY;
  }
}

// out rows r (R, D) += sum_j w[r * S + j] * v_j (times an int8 row's scale) over the positions j
// < L of blocks [c_begin, c_end) that row r's mask lets through (a hidden value, NaN included, is
// never added); out is neither zeroed nor normalised here. Consecutive block ranges add in
// position order, as one range over them does (the same bits).
template <typename C>
void value_sums(const C* const* vb, int64_t bs, int64_t ld, int64_t S, int64_t L, int64_t D, int64_t R, int64_t T, const bool* masks,
                const float* w, float* out, int64_t c_begin, int64_t c_end) {
  float p[16];
  auto one = [&](int64_t r, int64_t jj, const C* vj) {  // value row vj of position jj for one row, if its mask lets it through
    if (!masks[(r % T) * S + jj]) return;
    const float pj = w[r * S + jj] * row_scale(vj, D);
    axpy<1>(&pj, vj, ld, D, out + r * D);
  };
  for (int64_t c = c_begin, j0 = c_begin * bs; c < c_end && j0 < L; ++c, j0 += bs) {
    const int64_t end = std::min(L, j0 + bs);
    const C* v = vb[c];
    int64_t j = j0;
    for (; j + 4 <= end; j += 4) {
      const C* vj = v + (j - j0) * ld;
      if (j + kAhead + 4 <= end) prefetch4(vj + kAhead * ld, ld);  // as key_scores: no division inside a long block
      else if (j + kAhead + 4 <= L) prefetch4(vb[(j + kAhead) / bs] + ((j + kAhead) % bs) * ld, ld);
      if (!all4(masks, T, S, j)) {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t i = 0; i < 4; ++i) one(r, j + i, vj + i * ld);
        continue;
      }
      float vs[4];
      for (int i = 0; i < 4; ++i) vs[i] = row_scale(vj + i * ld, D);
      for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int64_t n = std::min<int64_t>(4, R - r0);
        for (int64_t rr = 0; rr < n; ++rr) scale4(w + (r0 + rr) * S + j, vs, p + 4 * rr);
        axpy_4values(n, p, vj, ld, D, out + r0 * D);
      }
    }
    for (; j < end; ++j)
      for (int64_t r = 0; r < R; ++r) one(r, j, v + (j - j0) * ld);
  }
}

// The value pass of n_kv KV heads over positions < L (attend_row's layout): out (n_kv, R, D) += each
// row's weights w (n_kv, R, S) times the values its mask lets through, block by block, every head
// of a block in turn. out is neither zeroed nor normalised here.
template <typename C>
void value_pass(const C* const* vb, int64_t count, int64_t n_kv, int64_t bs, int64_t ld, int64_t S, int64_t L, int64_t D, int64_t R,
                int64_t T, const bool* masks, const float* w, float* out, bool) {
  const int64_t blocks = (L + bs - 1) / bs;
  for (int64_t c = 0; c < blocks; ++c)
    for (int64_t h = 0; h < n_kv; ++h) value_sums(vb + h * count, bs, ld, S, L, D, R, T, masks, w + h * R * S, out + h * R * D, c, c + 1);
}

// ---- int8 values: weighted sums in integers ------------------------------------------------------
// Over an int8 cache the value pass folds each position's scale into its weight (p_j = w_j x
// scale_j, 0 where the mask hides j) and, per span of kValueSpan positions (spans start at
// multiples of it, so every layout and block size cuts the same spans), rounds a row's p to int16
// against the span's largest (an error of at most 2^-16 of the span's largest p, against the int8
// value's 2^-8 of its row's largest): the span's products then sum exactly in int32 (|sum| <= 256 x 32767 x
// 128 < 2^31), two positions per vpdpwssd / vpmaddwd lane, where the float form widens 16 values
// in two instructions and multiplies them per row in a third (12 FMAs a position for SmolLM2's 3
// rows of head dim 64). A span's sums join out in fp32, out + float(sum) * (largest / 32767) in one
// fused multiply-add, span after span in position order: the sums are exact, so the value pass's
// SIMD paths, tails and scalar path give the same bits, for every layout and block size.
constexpr int64_t kValueSpan = 256;

// How a head dim's sums are laid out and added: 2, 32 lanes (AVX-512); 1, 16 (AVX2); 0, scalar.
inline int value_path(int64_t D) {
#ifdef NFX_ATTN_I16_512
  if (D % 32 == 0) return 2;
#endif
#ifdef NFX_AVX2
  if (D % 16 == 0) return 1;
#endif
  return 0;
}

// Where value d's sum lies in a row of sums: per 32 (path 2) or 16 (path 1) values, vpunpcklwd's
// lanes (value 8 l + i at 4 l + i, i < 4) then vpunpckhwd's (8 l + 4 + i after them); in order
// on the scalar path.
inline int64_t value_lane(int64_t d, int path) {
  if (path == 0) return d;
  const int64_t width = path == 2 ? 32 : 16, c = d / width * width, e = d % width, l = e / 8, i = e % 8;
  return c + (i < 4 ? 4 * l + i : width / 2 + 4 * l + i - 4);
}

#ifdef NFX_ATTN_I16_512
// acc rows r < NR (stride D, path 2's lane order) += sum over the pairs i < pairs of
// p[r * ldp + 2 i + t] * v[(2 i + t) * ld + d] (t = 0, 1): each pair's two value rows widened and
// interleaved once for the NR rows, whose pair of weights is one 32-bit broadcast. ahead (or
// null): rows to prefetch into L2 alongside, 2 ld bytes a pair, spread over the D / 32 passes so
// that the next span streams in while this one computes.
template <int NR>
inline void value_pairs512(const int16_t* p, int64_t ldp, const int8_t* v, int64_t ld, int64_t pairs, int64_t D, int32_t* acc,
                           const int8_t* ahead) {
  for (int64_t d = 0; d < D; d += 32) {
    const int64_t first_line = ahead != nullptr ? 64 * (d / 32) : 2 * ld + 64, line_step = 64 * (D / 32);
    __m512i lo[NR], hi[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      lo[r] = _mm512_loadu_si512(acc + r * D + d);
      hi[r] = _mm512_loadu_si512(acc + r * D + d + 16);
    }
    for (int64_t i = 0; i < pairs; ++i) {
      for (int64_t o = first_line; o < 2 * ld + 63; o += line_step)  // the last line: at the pair's last byte
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * i * ld + std::min(o, 2 * ld - 1)), _MM_HINT_T1);
      const int8_t* v0 = v + 2 * i * ld + d;
      const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0)));
      const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + ld)));
      const __m512i ab_lo = _mm512_unpacklo_epi16(a, b), ab_hi = _mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t pw;
        std::memcpy(&pw, p + r * ldp + 2 * i, sizeof(pw));
        const __m512i pv = _mm512_set1_epi32(pw);
        lo[r] = mac_i16(lo[r], pv, ab_lo);
        hi[r] = mac_i16(hi[r], pv, ab_hi);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      _mm512_storeu_si512(acc + r * D + d, lo[r]);
      _mm512_storeu_si512(acc + r * D + d + 16, hi[r]);
    }
  }
}
#endif

#ifdef NFX_AVX2
// value_pairs512 in 16 lanes (path 1): vpmaddwd and an add per row, pair and 16 values.
template <int NR>
inline void value_pairs256(const int16_t* p, int64_t ldp, const int8_t* v, int64_t ld, int64_t pairs, int64_t D, int32_t* acc,
                           const int8_t* ahead) {
  for (int64_t d = 0; d < D; d += 16) {
    const int64_t first_line = ahead != nullptr ? 64 * (d / 16) : 2 * ld + 64, line_step = 64 * (D / 16);
    __m256i lo[NR], hi[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      lo[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * D + d));
      hi[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * D + d + 8));
    }
    for (int64_t i = 0; i < pairs; ++i) {
      for (int64_t o = first_line; o < 2 * ld + 63; o += line_step)  // the last line: at the pair's last byte
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * i * ld + std::min(o, 2 * ld - 1)), _MM_HINT_T1);
      const int8_t* v0 = v + 2 * i * ld + d;
      const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v0)));
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v0 + ld)));
      const __m256i ab_lo = _mm256_unpacklo_epi16(a, b), ab_hi = _mm256_unpackhi_epi16(a, b);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t pw;
        std::memcpy(&pw, p + r * ldp + 2 * i, sizeof(pw));
        const __m256i pv = _mm256_set1_epi32(pw);
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(pv, ab_lo));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(pv, ab_hi));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * D + d), lo[r]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * D + d + 8), hi[r]);
    }
  }
}
#endif

// The pair sums of value_pairs512 for R rows (in groups of four) on the head dim's path; the
// scalar path (in order) adds one product at a time.
inline void value_pairs(const int16_t* p, int64_t ldp, const int8_t* v, int64_t ld, int64_t pairs, int64_t D, int64_t R, int32_t* acc,
                        const int8_t* ahead, int path) {
  if (path == 0) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < 2 * pairs; ++j)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += static_cast<int32_t>(p[r * ldp + j]) * v[j * ld + d];
    return;
  }
  for (int64_t r0 = 0; r0 < R; r0 += 4, ahead = nullptr) {
    const int16_t* pr = p + r0 * ldp;
    int32_t* ar = acc + r0 * D;
    const int64_t n = std::min<int64_t>(4, R - r0);
#ifdef NFX_ATTN_I16_512
    if (path == 2) {
      switch (n) {
        case 4: value_pairs512<4>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
        case 3: value_pairs512<3>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
        case 2: value_pairs512<2>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
        default: value_pairs512<1>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
      }
      continue;
    }
#endif
#ifdef NFX_AVX2
    switch (n) {
      case 4: value_pairs256<4>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
      case 3: value_pairs256<3>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
      case 2: value_pairs256<2>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
      default: value_pairs256<1>(pr, ldp, v, ld, pairs, D, ar, ahead); break;
    }
#endif
  }
}

// p16 (R, ldp) = row r's weights of positions [s0, s1) rounded to int16 against their largest, its
// scale (largest / 32767) in pscale[r]; vscale: those positions' value scales; pf: scratch for
// s1 - s0 floats. A row whose largest weight is 0 (or so small that 32767 / it overflows) gets
// zeros and scale 0; one holding a NaN or an infinity scale NaN (its output NaN, as the float
// pass makes it).
inline void round_span_weights(const float* w, int64_t S, const bool* masks, int64_t T, int64_t R, int64_t s0, int64_t s1,
                               const float* vscale, float* pf, int16_t* p16, int64_t ldp, float* pscale) {
  const int64_t n = s1 - s0;
  for (int64_t r = 0; r < R; ++r) {
    const float* wr = w + r * S + s0;
    const bool* m = masks + (r % T) * S + s0;
    // a hidden position's weight is 0, never w x its scale: that scale may be anything (NaN)
    float top = 0.f;
    bool finite = true;
    int64_t k = 0;
#ifdef NFX_ATTN_AVX512
    __m512 top16 = _mm512_setzero_ps();
    __mmask16 bad = 0;  // lanes that met a NaN or an infinity (p - p is NaN)
    for (; k + 16 <= n; k += 16) {
      const __mmask16 keep = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + k))),
                                                    _mm512_set1_epi32(0xFF));
      const __m512 pk = _mm512_maskz_mul_ps(keep, _mm512_loadu_ps(wr + k), _mm512_loadu_ps(vscale + k));
      _mm512_storeu_ps(pf + k, pk);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(pk, pk), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      top16 = _mm512_max_ps(top16, _mm512_abs_ps(pk));
    }
    top = _mm512_reduce_max_ps(top16);  // exact in any order (NaN lanes: flagged in bad)
    finite = bad == 0;
#elif defined(NFX_AVX2)
    __m256 top8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (; k + 8 <= n; k += 8) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + k)));
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
      const __m256 pk = _mm256_and_ps(keep, _mm256_mul_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(vscale + k)));  // +0 where hidden
      _mm256_storeu_ps(pf + k, pk);
      bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(_mm256_sub_ps(pk, pk), _mm256_setzero_ps(), _CMP_NEQ_UQ));
      top8 = _mm256_max_ps(top8, _mm256_and_ps(pk, magnitude));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    for (const float x : lanes) top = std::max(top, x);  // exact in any order (NaN lanes: flagged in bad8)
    finite = _mm256_movemask_ps(bad8) == 0;
#endif
    for (; k < n; ++k) {
      pf[k] = m[k] ? wr[k] * vscale[k] : 0.f;
      finite &= std::isfinite(pf[k]);
      top = std::max(top, std::fabs(pf[k]));
    }
    const float inv = 32767.f / top;
    const bool usable = finite && std::isfinite(inv);
    int16_t* pr = p16 + r * ldp;
    k = 0;
    if (usable) {
#ifdef NFX_ATTN_AVX512
      const __m512 iv = _mm512_set1_ps(inv);
      for (; k + 16 <= n; k += 16)  // vcvtps2dq rounds half to even, as std::nearbyint
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + k), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pf + k), iv))));
#elif defined(NFX_AVX2)
      const __m256 iv = _mm256_set1_ps(inv);
      for (; k + 8 <= n; k += 8) {
        const __m256i r32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(pf + k), iv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pr + k), _mm_packs_epi32(_mm256_castsi256_si128(r32), _mm256_extracti128_si256(r32, 1)));
      }
#endif
      for (; k < n; ++k) pr[k] = static_cast<int16_t>(std::nearbyint(pf[k] * inv));
    }
    std::fill(pr + k, pr + ldp, static_cast<int16_t>(0));  // an odd run's partner and past it: weight 0
    pscale[r] = !finite ? NAN : usable ? top / 32767.f : 0.f;
  }
}

// out rows (R, D) += float(acc) * pscale[r] in one fused multiply-add, acc in the path's lane order.
inline void add_span_sums(const int32_t* acc, const float* pscale, int64_t R, int64_t D, int path, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const int32_t* a = acc + r * D;
    float* o = out + r * D;
    int64_t d = 0;
#ifdef NFX_ATTN_I16_512
    if (path == 2) {  // from lane order back to value order: two permutes per 32 values
      const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      const __m512 ps = _mm512_set1_ps(pscale[r]);
      for (; d < D; d += 32) {
        const __m512i lo = _mm512_loadu_si512(a + d), hi = _mm512_loadu_si512(a + d + 16);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, first, hi));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, second, hi));
        _mm512_storeu_ps(o + d, _mm512_fmadd_ps(f0, ps, _mm512_loadu_ps(o + d)));
        _mm512_storeu_ps(o + d + 16, _mm512_fmadd_ps(f1, ps, _mm512_loadu_ps(o + d + 16)));
      }
    }
#endif
#ifdef NFX_AVX2
    if (path == 1) {  // 16 values: [0-3, 8-11] then [4-7, 12-15] -> two 128-bit permutes
      const __m256 ps = _mm256_set1_ps(pscale[r]);
      for (; d < D; d += 16) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d + 8));
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(f0, ps, _mm256_loadu_ps(o + d)));
        _mm256_storeu_ps(o + d + 8, _mm256_fmadd_ps(f1, ps, _mm256_loadu_ps(o + d + 8)));
      }
    }
#endif
    for (; d < D; ++d) o[d] = std::fma(static_cast<float>(a[value_lane(d, path)]), pscale[r], o[d]);  // one rounding, as the vector paths
  }
}

// value_pass over int8 rows, in integers (see kValueSpan). prefetched: the key pass brought the
// rows into L2; else each span's rows are prefetched while the span before computes.
inline void value_pass(const int8_t* const* vb, int64_t count, int64_t n_kv, int64_t bs, int64_t ld, int64_t S, int64_t L, int64_t D,
                       int64_t R, int64_t T, const bool* masks, const float* w, float* out, bool prefetched) {
  constexpr int64_t ldp = kValueSpan + 2;
  const int path = value_path(D);
  std::vector<float> vscale(n_kv * kValueSpan), pf(kValueSpan), pscale(n_kv * R);
  std::vector<int16_t> p16(n_kv * R * ldp);
  std::vector<int32_t> acc(n_kv * R * D);
  for (int64_t s0 = 0; s0 < L; s0 += kValueSpan) {
    const int64_t s1 = std::min(L, s0 + kValueSpan);
    for (int64_t j = s0; j < s1;) {  // the span's value scales, block by block
      const int64_t c = j / bs, e = std::min(s1, (c + 1) * bs);
      for (int64_t h = 0; h < n_kv; ++h) {
        const int8_t* v = vb[h * count + c] + (j - c * bs) * ld;
        for (int64_t t = j; t < e; ++t, v += ld) vscale[h * kValueSpan + t - s0] = row_scale(v, D);
      }
      j = e;
    }
    for (int64_t h = 0; h < n_kv; ++h)
      round_span_weights(w + h * R * S, S, masks, T, R, s0, s1, vscale.data() + h * kValueSpan, pf.data(), p16.data() + h * R * ldp, ldp,
                         pscale.data() + h * R);
    std::fill(acc.begin(), acc.end(), 0);
    for (int64_t j = s0; j < s1;) {  // block by block, every head's rows of a block in turn
      const int64_t c = j / bs, e = std::min(s1, (c + 1) * bs), pairs = (e - j) / 2;
      for (int64_t h = 0; h < n_kv; ++h) {
        const int8_t* v = vb[h * count + c] + (j - c * bs) * ld;
        const int16_t* p = p16.data() + h * R * ldp + (j - s0);
        int32_t* a = acc.data() + h * R * D;
        // the same rows a span later, where they lie in one block (block sizes dividing the span)
        const int64_t na = j + kValueSpan, ne = e + kValueSpan, nc = na / bs;
        const int8_t* ahead = !prefetched && ne <= L && (ne - 1) / bs == nc ? vb[h * count + nc] + (na - nc * bs) * ld : nullptr;
        value_pairs(p, ldp, v, ld, pairs, D, R, a, ahead, path);
        if ((e - j) % 2 != 0)  // an odd run's last position alone (only at L: blocks of several are a multiple of 4)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t d = 0; d < D; ++d)
              a[r * D + value_lane(d, path)] += static_cast<int32_t>(p[r * ldp + e - 1 - j]) * v[(e - 1 - j) * ld + d];
      }
      j = e;
    }
    add_span_sums(acc.data(), pscale.data(), n_kv * R, D, path, out);
  }
}

// The R = group x T query rows that share one KV head of one batch row (grouped-query
// attention: head h reads KV head h / group): q rows (R, D) contiguous, row r = (g, t) masked by
// masks + t * S; w and sums are scratch for R x S weights and R sums; writes out (R, D) fp32.
// Position j's key and value rows are kb[j / bs] + (j % bs) * ld and vb[j / bs] + (j % bs) * ld
// (kb, vb: the row's ceil(S / bs) blocks, already at this KV head). Positions are walked block by
// block, so no key costs a division, and inside a block the loops are those of one contiguous
// window: a single block holding all S positions (the slots layout) runs exactly as a window
// does. A group of four keys never spans two blocks (bs % 4 == 0 wherever there are several).
// Keys go four at a time, each loaded and widened once for up to four query rows (dots_4keys); a
// group of four with a hidden key computes its products anyway and then selects -inf over it, so
// a NaN there is never used, and its values are added one by one, skipping the hidden ones; four
// keys no row attends are not read. An int8 row's scale multiplies its score and its weight; int8
// keys take key_scores' integer form, int8 values value_pass's (weights rounded per span).
// attend_row does this for n_kv KV heads of one batch row at once (n_kv = 1: one KV head's task),
// block by block: each block's rows of every head are read in turn (in the engine's contiguous
// cache a block is (n_kv, bs, W), one run of memory), where a task per (row, KV head) read bs rows
// of every block and skipped the rest, which the hardware prefetcher does not follow (batch 8, 9 query heads over 3 KV heads,
// 320 positions in blocks of 16 taken in order, 30 layers, fp32: 1.46-1.49x the slots layout's
// time per task and head, 1.02-1.04x per row; docs/performance.md). The same products in the
// same order as one head at a time. q rows (n_kv, group x T, D); kb[h * count + c],
// vb[h * count + c]: head h's rows of block c; w (n_kv, R, S) and sums (n_kv, R) scratch.
template <typename C>
void attend_row(const float* q, const C* const* kb, const C* const* vb, int64_t count, int64_t n_kv, int64_t bs, int64_t ld,
                int64_t S, int64_t D, int64_t group, int64_t T, const bool* masks, float scale, float* w, float* sums, float* out) {
  const int64_t R = group * T, L = live_positions(masks, T, S), blocks = (L + bs - 1) / bs;
  using Q = decltype(queries_for(q, R, D, scale, static_cast<const C*>(nullptr)));
  std::vector<Q> qs;
  qs.reserve(n_kv);
  for (int64_t h = 0; h < n_kv; ++h) qs.push_back(queries_for(q + h * R * D, R, D, scale, static_cast<const C*>(nullptr)));
  // int8 values are read a span at a time after the keys (value_pass): the key pass prefetches
  // them beside the keys (into L1, as the keys) where both, and the weights, stay in L2 until
  // then (docs/performance.md, "int8 values summed in integers")
  const bool values_too = std::is_same_v<C, int8_t> && 2 * n_kv * L * ld + n_kv * R * L * static_cast<int64_t>(sizeof(float)) <= l2_bytes();
  for (int64_t c = 0; c < blocks; ++c)
    for (int64_t h = 0; h < n_kv; ++h)
      key_scores(qs[h], kb + h * count, vb + h * count, bs, ld, S, L, D, R, T, masks, w + h * R * S, c, c + 1, values_too);
  for (int64_t r = 0; r < n_kv * R; ++r) sums[r] = softmax_weights(w + r * S, L);
  std::fill(out, out + n_kv * R * D, 0.f);
  value_pass(vb, count, n_kv, bs, ld, S, L, D, R, T, masks, w, out, values_too);
  for (int64_t h = 0; h < n_kv; ++h) normalise(out + h * R * D, sums + h * R, R, D);
}

// blocks (B, count): the blocks holding each row's first S positions (count = ceil(S / bs)).
template <typename C>
void attention_tasks(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<int64_t>& blocks,
                     int64_t count, const bool* mask, int64_t B, int64_t H, int64_t T, int64_t S, int64_t D, float* out) {
  const int64_t n_kv = k_cache.size(1), group = H / n_kv, bs = k_cache.size(2);
  const C* kc = k_cache.data_ptr<C>();
  const C* vc = v_cache.data_ptr<C>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ld = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  TORCH_CHECK(v_cache.stride(2) == ld, "cached_attention: k_cache and v_cache must share a layout");
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Tasks of at least ~32K multiply-adds: a fork/join (a few us) costs more than a smaller one.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, group * T * S * D));
  // Over several blocks, one task per batch row (attend_row) where the rows split evenly over the
  // threads (or are many): 3 rows on 2 threads would give one thread twice the other's work.
  const int64_t threads = at::get_num_threads();
  if (count > 1 && n_kv > 1 && (B % threads == 0 || B >= 4 * threads)) {
    at::parallel_for(0, B, std::max<int64_t>(1, grain / n_kv), [&](int64_t b0, int64_t b1) {
      std::vector<float> w(n_kv * group * T * S), sums(n_kv * group * T);
      std::vector<const C*> bases(2 * n_kv * count);  // head h's key blocks at h * count, its value blocks after all keys
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t h = 0; h < n_kv; ++h)
          for (int64_t c = 0; c < count; ++c) {
            const int64_t blk = blocks[b * count + c];
            bases[h * count + c] = kc + blk * ks0 + h * ks1;
            bases[(n_kv + h) * count + c] = vc + blk * vs0 + h * vs1;
          }
        attend_row(q + b * H * T * D, bases.data(), bases.data() + n_kv * count, count, n_kv, bs, ld, S, D, group, T, mask + b * T * S,
                   scale, w.data(), sums.data(), out + b * H * T * D);
      }
    });
    return;
  }
  at::parallel_for(0, B * n_kv, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> w(group * T * S), sums(group * T);  // per thread, not per task
    std::vector<const C*> bases(2 * count);                // the task's key blocks, then its value blocks
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / n_kv, kvh = i % n_kv;
      const int64_t first = (b * H + kvh * group) * T * D;  // query rows (g, t) of heads kvh * group ...
      for (int64_t c = 0; c < count; ++c) {
        const int64_t blk = blocks[b * count + c];
        bases[c] = kc + blk * ks0 + kvh * ks1;
        bases[count + c] = vc + blk * vs0 + kvh * vs1;
      }
      attend_row(q + first, bases.data(), bases.data() + count, count, 1, bs, ld, S, D, group, T, mask + b * T * S, scale, w.data(),
                   sums.data(), out + first);
    }
  });
}

// The first ``count`` columns of block_table (B, N), int32 or int64, any strides, as (B, count)
// int64, each checked to lie in [0, num_blocks). The later columns are never read.
std::vector<int64_t> table_blocks(const at::Tensor& table, int64_t B, int64_t count, int64_t num_blocks) {
  std::vector<int64_t> blocks(B * count);
  const int64_t s0 = table.stride(0), s1 = table.stride(1);
  auto read = [&](const auto* p) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < count; ++c) blocks[b * count + c] = static_cast<int64_t>(p[b * s0 + c * s1]);
  };
  if (table.scalar_type() == at::kInt)
    read(table.data_ptr<int32_t>());
  else
    read(table.data_ptr<int64_t>());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < count; ++c) {
      const int64_t blk = blocks[b * count + c];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "cached_attention: block_table[", b, ", ", c, "] = ", blk, " is out of [0, ",
                  num_blocks, ")");
    }
  return blocks;
}

// q (B, H, T, D) float; k_cache / v_cache (num_blocks, H_kv, block_size, W), last dim contiguous
// (W = D, or D + 4 for int8 rows); block_table (B, N) int32/int64: position j of row b lives in
// block block_table[b, j / block_size] at offset j % block_size (the slots layout: N = 1,
// block_size = sequence length, block_table = seq_ids[:, None]); mask (B, 1, T, S) bool
// (true = attend). -> (B, H, T, D) in q's dtype.
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4 && mask.dim() == 4,
              "cached_attention: q, caches and mask must be 4-D");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), S = mask.size(3);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "cached_attention: k_cache and v_cache differ");
  // an int8 cache row is D values and its fp32 scale (neuronfx/graphs/models/kv_rows.py)
  const int64_t width = D + (k_cache.scalar_type() == at::kChar ? static_cast<int64_t>(sizeof(float)) : 0);
  TORCH_CHECK(k_cache.size(3) == width && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "cached_attention: cache rows must be ", width, " wide and contiguous");
  TORCH_CHECK(k_cache.scalar_type() != at::kChar || D <= kInt8MaxHeadDim, "cached_attention: int8 rows of head dim ", D,
              " exceed ", kInt8MaxHeadDim, " (q . k sums in int32)");
  TORCH_CHECK(H % k_cache.size(1) == 0, "cached_attention: ", H, " query heads over ", k_cache.size(1), " KV heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == T,
              "cached_attention: mask must be bool (B, 1, T, S)");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B, "cached_attention: block_table must be 2-D (B, N) with B = ", B,
              ", got shape ", block_table.sizes());
  TORCH_CHECK(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
              "cached_attention: block_table must be int32 or int64, got ", block_table.scalar_type());
  const int64_t N = block_table.size(1), bs = k_cache.size(2);
  TORCH_CHECK(N == 1 || bs % 4 == 0, "cached_attention: block_size ", bs,
              " must be a multiple of 4 when the table has several blocks per row (N = ", N, ")");
  TORCH_CHECK(S <= N * bs, "cached_attention: mask covers ", S, " positions, block table holds ", N * bs, " (", N,
              " blocks of ", bs, ")");
  const int64_t count = S == 0 ? 0 : (S + bs - 1) / bs;  // blocks holding positions [0, S)
  const auto blocks = table_blocks(block_table, B, count, k_cache.size(0));
  auto q32 = q.to(at::kFloat).contiguous();
  auto m = mask.contiguous();
  auto out32 = at::empty({B, H, T, D}, q32.options());
  const float* qp = q32.data_ptr<float>();
  const bool* mp = m.data_ptr<bool>();
  float* op = out32.data_ptr<float>();
  switch (k_cache.scalar_type()) {
    case at::kFloat: attention_tasks<float>(qp, k_cache, v_cache, blocks, count, mp, B, H, T, S, D, op); break;
    case at::kBFloat16: attention_tasks<c10::BFloat16>(qp, k_cache, v_cache, blocks, count, mp, B, H, T, S, D, op); break;
    case at::kHalf: attention_tasks<c10::Half>(qp, k_cache, v_cache, blocks, count, mp, B, H, T, S, D, op); break;
    case at::kChar: attention_tasks<int8_t>(qp, k_cache, v_cache, blocks, count, mp, B, H, T, S, D, op); break;
    case at::kFloat8_e4m3fn: attention_tasks<c10::Float8_e4m3fn>(qp, k_cache, v_cache, blocks, count, mp, B, H, T, S, D, op); break;
    default: TORCH_CHECK(false, "cached_attention: cache dtype ", k_cache.scalar_type(),
                         " is not float32/bfloat16/float16/int8 (scaled rows)/float8_e4m3fn");
  }
  return q.scalar_type() == at::kFloat ? out32 : out32.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY(neuronfx, m) {
  m.def("small_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_gemm_multi(Tensor x, Tensor w0, Tensor? w1, Tensor? w2, Tensor? b0, Tensor? b1, Tensor? b2) -> Tensor");
  m.def("small_glu(Tensor x, Tensor gate, Tensor up) -> Tensor");
  m.def("cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor mask) -> Tensor");
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) {
  m.impl("small_gemm", &small_gemm);
  m.impl("small_gemm_multi", &small_gemm_multi);
  m.impl("small_glu", &small_glu);
  m.impl("cached_attention", &cached_attention);
}

// C shims (c_shims.h) of the decode products and attention.
NFX_SHIM(small_gemm, AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret0 = nfx_shim::result(small_gemm(nfx_shim::tensor(x), nfx_shim::tensor(w), nfx_shim::optional(bias))); });
}
NFX_SHIM(small_gemm_multi, AtenTensorHandle x, AtenTensorHandle w0, AtenTensorHandle* w1, AtenTensorHandle* w2, AtenTensorHandle* b0,
         AtenTensorHandle* b1, AtenTensorHandle* b2, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(small_gemm_multi(nfx_shim::tensor(x), nfx_shim::tensor(w0), nfx_shim::optional(w1), nfx_shim::optional(w2),
                                              nfx_shim::optional(b0), nfx_shim::optional(b1), nfx_shim::optional(b2)));
  });
}
NFX_SHIM(small_glu, AtenTensorHandle x, AtenTensorHandle gate, AtenTensorHandle up, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret0 = nfx_shim::result(small_glu(nfx_shim::tensor(x), nfx_shim::tensor(gate), nfx_shim::tensor(up))); });
}
NFX_SHIM(cached_attention, AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle block_table,
         AtenTensorHandle mask, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(cached_attention(nfx_shim::tensor(q), nfx_shim::tensor(k_cache), nfx_shim::tensor(v_cache),
                                              nfx_shim::tensor(block_table), nfx_shim::tensor(mask)));
  });
}
