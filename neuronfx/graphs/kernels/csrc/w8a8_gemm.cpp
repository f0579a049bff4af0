// int8 weights x int8 activations for decode rows: out[m, n] = (sum_k xq[m, k] * w[n, k]) *
// xs[m] * ws[n] (+ bias[n]), x rounded per row exactly as ``int8_x.int8_rows`` (absmax / 127,
// half to even) and the integer sums exact in int32, so the result has the bits of
// ``int8_x.w8a8_linear`` (torch._int_mm), whose oneDNN GEMM reads small-M products slowly and
// leaves x's rounding and the scaling to separate ops.
//
// AVX512-VNNI: ``vpdpbusd`` multiplies unsigned by signed bytes, so each weight byte is read as
// w + 128 (xor 0x80) and 128 * sum_k xq[m, k] is taken off each sum; 64 products per
// instruction, each weight row read once against every row of x. AVX2 without VNNI: the same
// exact integers through vpmaddwd (int8) and vpmaddubsw (4-bit) below; else scalar code.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include "c_shims.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define NFX_W8A8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NFX_W8A8_AVX2 1
#endif
#include "exp16.h"

namespace {

// x rounded per row: int8 rows of kp (K padded with zeros to whole 64s), their scales and sums.
struct XRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  int64_t kp;
  // The packed kernels on AVX2 only (else empty; with_pairs): per row kp / 2 int32, for each
  // quad q of x the int16 pairs (x[4q], x[4q + 2]) and (x[4q + 1], x[4q + 3]), vpmaddwd's operands.
  std::vector<int32_t> pairs;
};

// One row of x (fp32, K values) rounded into q: torch.round(x / safe).clamp(-127, 127), an
// IEEE fp32 division then half to even, 16 lanes at a time where AVX-512 is; returns the sum.
inline int32_t round_row(const float* x, int64_t K, float safe, int8_t* q) {
  int32_t sum = 0;
  int64_t k = 0;
#if defined(NFX_W8A8_VNNI)
  const __m512 d = _mm512_set1_ps(safe), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  __m512i acc = _mm512_setzero_si512();
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // max(v, lo) first: a NaN lane gives -127, as the scalar tail's std::max(-127, NaN)
    const __m512i i = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(i));
    acc = _mm512_add_epi32(acc, i);
  }
  sum = _mm512_reduce_add_epi32(acc);
#elif defined(NFX_W8A8_AVX2)
  const __m256 d = _mm256_set1_ps(safe), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i acc = _mm256_setzero_si256();
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // max(v, lo) first: a NaN lane gives -127, as the scalar tail's std::max(-127, NaN)
    const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w, w));
    acc = _mm256_add_epi32(acc, i);
  }
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
#endif
  for (; k < K; ++k) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[k] / safe)));
    q[k] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
  return sum;
}

// The largest |v[i]| over n values, NaN passed over (as std::max(amax, NaN) keeps amax), and in
// *nan whether any was NaN; 16 (8 on AVX2) lanes at a time. max_ps returns its second operand
// when either is NaN, so the running maximum goes second. The scalar loop took 2-3 us a batch-8
// row set of 576 features, on the calling thread while the other waited (about 0.5 ms a step).
inline float abs_max(const float* v, int64_t n, bool* nan) {
  float amax = 0.f;
  bool any = false;
  int64_t i = 0;
#if defined(NFX_W8A8_VNNI)
  __m512 acc = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    bad |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    acc = _mm512_max_ps(_mm512_abs_ps(x), acc);
  }
  amax = _mm512_reduce_max_ps(acc);
  any = bad != 0;
#elif defined(NFX_W8A8_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 acc = _mm256_setzero_ps();
  int bad = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    acc = _mm256_max_ps(_mm256_andnot_ps(sign, x), acc);
  }
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
  any = bad != 0;
#endif
  for (; i < n; ++i) {
    amax = std::max(amax, std::fabs(v[i]));  // std::max passes NaN over: noted apart
    any |= std::isnan(v[i]);
  }
  *nan = any;
  return amax;
}

// Rows in parallel past ROUND_GRAIN of them (a prefill's x); decode rows on the calling thread.
constexpr int64_t ROUND_GRAIN = 16;

template <typename X>
XRows round_rows(const X* x, int64_t M, int64_t K) {
  const int64_t kp = (K + 63) / 64 * 64;
  XRows r{std::vector<int8_t>(M * kp, 0), std::vector<float>(M), std::vector<int32_t>(M, 0), kp, {}};
  at::parallel_for(0, M, ROUND_GRAIN, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(x[m * K + k]);
      bool nan = false;
      const float amax = abs_max(row.data(), K, &nan);
      const float s = amax / 127.f;
      r.sum[m] = round_row(row.data(), K, s > 0.f ? s : 1.f, r.q.data() + m * r.kp);
      r.scale[m] = nan ? std::numeric_limits<float>::quiet_NaN() : s;  // NaN reaches every output, as torch's amax
    }
  });
  return r;
}

// r with its int16 pairs (the packed kernels' operands on AVX2; nothing elsewhere).
XRows with_pairs(XRows r) {
#if defined(NFX_W8A8_AVX2)
  const int64_t M = static_cast<int64_t>(r.scale.size());
  r.pairs.resize(M * r.kp / 2);
  for (int64_t i = 0; i < M * r.kp; i += 4) {
    const int8_t* q = r.q.data() + i;
    r.pairs[i / 2] = static_cast<int32_t>(static_cast<uint16_t>(q[0]) | (static_cast<uint32_t>(static_cast<uint16_t>(q[2])) << 16));
    r.pairs[i / 2 + 1] = static_cast<int32_t>(static_cast<uint16_t>(q[1]) | (static_cast<uint32_t>(static_cast<uint16_t>(q[3])) << 16));
  }
#endif
  return r;
}

template <typename X>
XRows round_any(const at::Tensor& xc) {
  return round_rows(xc.data_ptr<X>(), xc.size(0), xc.size(1));
}

#if defined(NFX_W8A8_VNNI)
inline __m256i fold(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// out[i] = the sum of v[i]'s lanes, i < C, four at a time through a transposing reduction (a
// tile's sums are few products long, so one reduction per sum would cost as much as the products).
template <int C>
inline void sums(const __m512i* v, int32_t* out) {
  int i = 0;
  for (; i + 4 <= C; i += 4) {
    const __m256i ab = _mm256_hadd_epi32(fold(v[i]), fold(v[i + 1])), cd = _mm256_hadd_epi32(fold(v[i + 2]), fold(v[i + 3]));
    const __m256i abcd = _mm256_hadd_epi32(ab, cd);  // lane j of each 128-bit half: part of sum j
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1)));
  }
  for (; i < C; ++i) out[i] = _mm512_reduce_add_epi32(v[i]);
}
#endif

// Rows [m0, m0 + MT) of x against weight rows [n, n + NT): their exact int32 sums into tot.
template <int MT, int NT>
inline void tile(const XRows& xr, int64_t m0, const int8_t* w, int64_t K, int64_t n, int32_t* tot) {
#if defined(NFX_W8A8_VNNI)
  __m512i acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ULL : (1ULL << (K - k)) - 1;  // masked bytes read 0 (x is 0 there)
    __m512i wv[NT];
    for (int j = 0; j < NT; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + j + 2 * NT) * K + k), _MM_HINT_T1);
      wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + (n + j) * K + k), flip);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i xv = _mm512_loadu_si512(xr.q.data() + (m0 + m) * xr.kp + k);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xv);
    }
  }
  sums<MT * NT>(&acc[0][0], tot);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) tot[m * NT + j] -= 128 * xr.sum[m0 + m];
#elif defined(NFX_W8A8_AVX2)
  // x and w widened to int16, vpmaddwd: 16 exact products a register, sums of pairs in int32
  __m256i acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_si256();
  const int64_t k16 = K / 16 * 16;
  for (int64_t k = 0; k < k16; k += 16) {
    __m256i wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + j) * K + k)));
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr.q.data() + (m0 + m) * xr.kp + k)));
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(xv, wv[j]));
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc[m][j]), _mm256_extracti128_si256(acc[m][j], 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      int32_t t = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
      for (int64_t k = k16; k < K; ++k) t += static_cast<int32_t>(xr.q[(m0 + m) * xr.kp + k]) * w[(n + j) * K + k];
      tot[m * NT + j] = t;
    }
#else
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<int32_t>(xr.q[(m0 + m) * xr.kp + k]) * w[(n + j) * K + k];
      tot[m * NT + j] = s;
    }
#endif
}

// Rows [m0, m0 + mc) (mc <= 8) against weight rows [n, n + nt): nt is 4 for up to 4 rows and 2
// above (16 int32 sums in registers), or 1 at the end of a task's range.
void tile_any(const XRows& xr, int64_t m0, int64_t mc, const int8_t* w, int64_t K, int64_t n, int nt, int32_t* tot) {
#define NFX_W8A8_CASE(MT, NT) \
  if (mc == MT && nt == NT) return tile<MT, NT>(xr, m0, w, K, n, tot);
  NFX_W8A8_CASE(1, 4) NFX_W8A8_CASE(2, 4) NFX_W8A8_CASE(3, 4) NFX_W8A8_CASE(4, 4)
  NFX_W8A8_CASE(5, 2) NFX_W8A8_CASE(6, 2) NFX_W8A8_CASE(7, 2) NFX_W8A8_CASE(8, 2)
  NFX_W8A8_CASE(1, 1) NFX_W8A8_CASE(2, 1) NFX_W8A8_CASE(3, 1) NFX_W8A8_CASE(4, 1)
  NFX_W8A8_CASE(5, 1) NFX_W8A8_CASE(6, 1) NFX_W8A8_CASE(7, 1) NFX_W8A8_CASE(8, 1)
#undef NFX_W8A8_CASE
}

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_gemm: x must be float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kChar && data.is_contiguous(),
              "w8a8_gemm: data must be a contiguous int8 (N, K) tensor");
  const int64_t N = data.size(0), K = data.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "w8a8_gemm: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "w8a8_gemm: scale must be (", N, ",)");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "w8a8_gemm: bias must be (", N, ",)");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  const XRows xr = x.scalar_type() == at::kFloat ? round_rows(xc.data_ptr<float>(), M, K)
                                                 : round_rows(xc.data_ptr<c10::BFloat16>(), M, K);
  const at::Tensor ws = scale.to(at::kFloat).contiguous();
  const at::Tensor bs = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* w = data.data_ptr<int8_t>();
  const float* wsp = ws.data_ptr<float>();
  const float* bp = bias ? bs.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int32_t tot[16];
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mc = std::min<int64_t>(8, M - m0);
      const int wide = mc <= 4 ? 4 : 2;
      for (int64_t n = n0; n < n1;) {
        const int nt = n + wide <= n1 ? wide : 1;
        tile_any(xr, m0, mc, w, K, n, nt, tot);
        for (int64_t m = 0; m < mc; ++m)
          for (int j = 0; j < nt; ++j) {
            // w8a8_linear's order: (sum * x scale) * weight scale, rounded, then + bias (the fma
            // with 0 keeps the compiler from fusing the last product with the bias)
            const float v = std::fma(static_cast<float>(tot[m * nt + j]) * xr.scale[m0 + m], wsp[n + j], 0.f);
            o[(m0 + m) * N + n + j] = bp ? v + bp[n + j] : v;
          }
        n += nt;
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.to(x.scalar_type()).view(shape);
}

// ---- int8 weights packed for vpdpbusd (quant.Int8Packed) -------------------------------------
// data uint8 (N / 16, K / 4, 64): block b, quad q holds w[16 b + c, 4 q + i] + 128 at byte 4 c + i,
// so one load is 4 input features of 16 output channels and x's 4 bytes are broadcast against
// it: the 16 channels' sums stay in the lanes of one register (no horizontal sums, which cost
// as much as the products over K = 576 in the row-major kernel above). The same int32 sums and
// the same scaling, so the same bits as w8a8_gemm and int8_x.w8a8_linear.

// Rows [m0, m0 + MT) of x against blocks [b, b + NT): the int32 sums, x's offset taken off.
template <int MT, int NT>
inline void packed_tile(const XRows& xr, int64_t m0, const uint8_t* data, int64_t K4, int64_t b, int32_t* tot) {
#if defined(NFX_W8A8_VNNI)
  __m512i acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_si512();
  const uint8_t* wb = data + b * K4 * 64;
  const int8_t* xq = xr.q.data() + m0 * xr.kp;
  for (int64_t q = 0; q < K4; ++q) {
    __m512i wv[NT];
    for (int j = 0; j < NT; ++j) {
      // the next tile's line at this quad, into L2: the weights stream from memory while this
      // tile computes (into L1 the next tile's lines evicted this one's: see packed_tile<8, 2>)
      _mm_prefetch(reinterpret_cast<const char*>(wb + ((NT + j) * K4 + q) * 64), _MM_HINT_T1);
      wv[j] = _mm512_loadu_si512(wb + (j * K4 + q) * 64);
    }
    for (int m = 0; m < MT; ++m) {
      int32_t x4;
      std::memcpy(&x4, xq + m * xr.kp + 4 * q, 4);
      const __m512i xv = _mm512_set1_epi32(x4);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xv);
    }
  }
  for (int m = 0; m < MT; ++m) {
    const __m512i off = _mm512_set1_epi32(128 * xr.sum[m0 + m]);
    for (int j = 0; j < NT; ++j) _mm512_storeu_si512(tot + (m * NT + j) * 16, _mm512_sub_epi32(acc[m][j], off));
  }
#else
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j)
      for (int c = 0; c < 16; ++c) {
        int32_t s = 0;
        for (int64_t q = 0; q < K4; ++q)
          for (int i = 0; i < 4; ++i)
            s += static_cast<int32_t>(xr.q[(m0 + m) * xr.kp + 4 * q + i]) * (static_cast<int32_t>(data[((b + j) * K4 + q) * 64 + 4 * c + i]) - 128);
        tot[(m * NT + j) * 16 + c] = s;
      }
#endif
}

#if defined(NFX_W8A8_VNNI)
// packed_tile<8, 2> with its 16 accumulators as named variables: GCC 12 kept the array's in
// registers but copied each one after every vpdpbusd (and spilled two), 0.75-0.9x of this in a
// microbenchmark that reached the instruction's peak with named ones (228 GMAC/s on one core).
template <>
__attribute__((noinline)) void packed_tile<8, 2>(const XRows& xr, int64_t m0, const uint8_t* data, int64_t K4, int64_t b, int32_t* tot) {
  const __m512i z = _mm512_setzero_si512();
  __m512i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z, a60 = z,
          a61 = z, a70 = z, a71 = z;
  const uint8_t* w0 = data + b * K4 * 64;
  const uint8_t* w1 = w0 + K4 * 64;
  const int8_t* x = xr.q.data() + m0 * xr.kp;
  const int64_t kp = xr.kp;
  for (int64_t q = 0; q < K4; ++q) {
    // the next tile's lines into L2: into L1 they evicted this tile's (docs/performance.md, CPU kernels)
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (2 * K4 + q) * 64), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (3 * K4 + q) * 64), _MM_HINT_T1);
    const __m512i v0 = _mm512_loadu_si512(w0 + q * 64), v1 = _mm512_loadu_si512(w1 + q * 64);
    int32_t t;
#define NFX_PACKED_ROW(M, A0, A1)                         \
  {                                                       \
    std::memcpy(&t, x + (M) * kp + 4 * q, 4);             \
    const __m512i xv = _mm512_set1_epi32(t);              \
    A0 = _mm512_dpbusd_epi32(A0, v0, xv);                 \
    A1 = _mm512_dpbusd_epi32(A1, v1, xv);                 \
  }
    NFX_PACKED_ROW(0, a00, a01) NFX_PACKED_ROW(1, a10, a11) NFX_PACKED_ROW(2, a20, a21) NFX_PACKED_ROW(3, a30, a31)
    NFX_PACKED_ROW(4, a40, a41) NFX_PACKED_ROW(5, a50, a51) NFX_PACKED_ROW(6, a60, a61) NFX_PACKED_ROW(7, a70, a71)
#undef NFX_PACKED_ROW
  }
  const __m512i acc[16] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51, a60, a61, a70, a71};
  for (int m = 0; m < 8; ++m) {
    const __m512i off = _mm512_set1_epi32(128 * xr.sum[m0 + m]);
    for (int j = 0; j < 2; ++j) _mm512_storeu_si512(tot + (m * 2 + j) * 16, _mm512_sub_epi32(acc[m * 2 + j], off));
  }
}
#endif

#if defined(NFX_W8A8_AVX2)
// packed_tile for AVX2 (no vpdpbusd), rows [m0, m0 + MT) (MT <= 4) against block b: each half of
// a quad's line (8 channels x 4 features, w + 128 in [0, 255]) split into its even and odd bytes
// as int16, against x's pairs (x[4q], x[4q + 2]) and (x[4q + 1], x[4q + 3]): vpmaddwd sums two
// products exactly in int32, so the sums are the VNNI path's. The 8 accumulators are named
// variables: GCC kept an array's on the stack, a store and a copy after each sum.
template <int MT>
__attribute__((noinline)) void packed_tile_avx2(const XRows& xr, int64_t m0, const uint8_t* data, int64_t K4, int64_t b, int32_t* tot) {
  const __m256i z = _mm256_setzero_si256(), low = _mm256_set1_epi16(0x00FF);
  __m256i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
  const uint8_t* w = data + b * K4 * 64;
  const int64_t xs = xr.kp / 2;
  const int32_t* xp = xr.pairs.data() + m0 * xs;
  for (int64_t q = 0; q < K4; ++q) {
    // the next block's line; into L1 (the AVX2 paths were timed so; L2 not tried for them)
    _mm_prefetch(reinterpret_cast<const char*>(w + (K4 + q) * 64), _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64)),
                  v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 32));
    const __m256i e0 = _mm256_and_si256(v0, low), o0 = _mm256_srli_epi16(v0, 8), e1 = _mm256_and_si256(v1, low),
                  o1 = _mm256_srli_epi16(v1, 8);
#define NFX_PACKED_ROW_AVX2(M, A0, A1)                                                                                 \
  if constexpr (MT > (M)) {                                                                                            \
    const __m256i xe = _mm256_set1_epi32(xp[(M) * xs + 2 * q]), xo = _mm256_set1_epi32(xp[(M) * xs + 2 * q + 1]);     \
    A0 = _mm256_add_epi32(A0, _mm256_add_epi32(_mm256_madd_epi16(e0, xe), _mm256_madd_epi16(o0, xo)));               \
    A1 = _mm256_add_epi32(A1, _mm256_add_epi32(_mm256_madd_epi16(e1, xe), _mm256_madd_epi16(o1, xo)));               \
  }
    NFX_PACKED_ROW_AVX2(0, a00, a01) NFX_PACKED_ROW_AVX2(1, a10, a11) NFX_PACKED_ROW_AVX2(2, a20, a21) NFX_PACKED_ROW_AVX2(3, a30, a31)
#undef NFX_PACKED_ROW_AVX2
  }
  const __m256i acc[8] = {a00, a01, a10, a11, a20, a21, a30, a31};
  for (int m = 0; m < MT; ++m) {
    const __m256i off = _mm256_set1_epi32(128 * xr.sum[m0 + m]);
    for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(tot + m * 16 + 8 * h), _mm256_sub_epi32(acc[2 * m + h], off));
  }
}
#endif

#if defined(NFX_W8A8_VNNI)
// packed_tile<4, 4> the same way (a prefill's tiles).
template <>
__attribute__((noinline)) void packed_tile<4, 4>(const XRows& xr, int64_t m0, const uint8_t* data, int64_t K4, int64_t b, int32_t* tot) {
  const __m512i z = _mm512_setzero_si512();
  __m512i a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z, a30 = z,
          a31 = z, a32 = z, a33 = z;
  const uint8_t* w0 = data + b * K4 * 64;
  const int8_t* x = xr.q.data() + m0 * xr.kp;
  const int64_t kp = xr.kp, s = K4 * 64;
  for (int64_t q = 0; q < K4; ++q) {
    const __m512i v0 = _mm512_loadu_si512(w0 + q * 64), v1 = _mm512_loadu_si512(w0 + s + q * 64),
                  v2 = _mm512_loadu_si512(w0 + 2 * s + q * 64), v3 = _mm512_loadu_si512(w0 + 3 * s + q * 64);
    int32_t t;
#define NFX_PACKED_ROW4(M, A0, A1, A2, A3)                                          \
  {                                                                                 \
    std::memcpy(&t, x + (M) * kp + 4 * q, 4);                                       \
    const __m512i xv = _mm512_set1_epi32(t);                                        \
    A0 = _mm512_dpbusd_epi32(A0, v0, xv);                                           \
    A1 = _mm512_dpbusd_epi32(A1, v1, xv);                                           \
    A2 = _mm512_dpbusd_epi32(A2, v2, xv);                                           \
    A3 = _mm512_dpbusd_epi32(A3, v3, xv);                                           \
  }
    NFX_PACKED_ROW4(0, a00, a01, a02, a03) NFX_PACKED_ROW4(1, a10, a11, a12, a13) NFX_PACKED_ROW4(2, a20, a21, a22, a23)
    NFX_PACKED_ROW4(3, a30, a31, a32, a33)
#undef NFX_PACKED_ROW4
  }
  const __m512i acc[16] = {a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33};
  for (int m = 0; m < 4; ++m) {
    const __m512i off = _mm512_set1_epi32(128 * xr.sum[m0 + m]);
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(tot + (m * 4 + j) * 16, _mm512_sub_epi32(acc[m * 4 + j], off));
  }
}
#endif

// mc (<= 8) rows against nt blocks: nt is 4 for up to 4 rows and 2 above (16 accumulators), or
// 1 at the end of a task's range.
void packed_tile_any(const XRows& xr, int64_t m0, int64_t mc, const uint8_t* data, int64_t K4, int64_t b, int nt, int32_t* tot) {
#if defined(NFX_W8A8_AVX2)
  // tiles of up to 4 rows x 1 block: 8 accumulators, 4 weight halves and 2 broadcasts fill
  // AVX2's 16 registers; the block's lines stay in L1 for the next 4 rows
  for (int j = 0; j < nt; ++j)
    for (int64_t r = 0; r < mc; r += 4) {
      int32_t part[4 * 16];
      const int64_t rc = std::min<int64_t>(4, mc - r);
      if (rc == 4) packed_tile_avx2<4>(xr, m0 + r, data, K4, b + j, part);
      else if (rc == 3) packed_tile_avx2<3>(xr, m0 + r, data, K4, b + j, part);
      else if (rc == 2) packed_tile_avx2<2>(xr, m0 + r, data, K4, b + j, part);
      else packed_tile_avx2<1>(xr, m0 + r, data, K4, b + j, part);
      for (int64_t i = 0; i < rc; ++i) std::memcpy(tot + ((r + i) * nt + j) * 16, part + i * 16, 16 * sizeof(int32_t));
    }
  return;
#endif
#define NFX_PACKED_CASE(MT, NT) \
  if (mc == MT && nt == NT) return packed_tile<MT, NT>(xr, m0, data, K4, b, tot);
  NFX_PACKED_CASE(1, 4) NFX_PACKED_CASE(2, 4) NFX_PACKED_CASE(3, 4) NFX_PACKED_CASE(4, 4)
  NFX_PACKED_CASE(1, 2) NFX_PACKED_CASE(2, 2) NFX_PACKED_CASE(3, 2) NFX_PACKED_CASE(4, 2)
  NFX_PACKED_CASE(5, 2) NFX_PACKED_CASE(6, 2) NFX_PACKED_CASE(7, 2) NFX_PACKED_CASE(8, 2)
  NFX_PACKED_CASE(1, 1) NFX_PACKED_CASE(2, 1) NFX_PACKED_CASE(3, 1) NFX_PACKED_CASE(4, 1)
  NFX_PACKED_CASE(5, 1) NFX_PACKED_CASE(6, 1) NFX_PACKED_CASE(7, 1) NFX_PACKED_CASE(8, 1)
#undef NFX_PACKED_CASE
}

// Rows [m0, m0 + mc) of a tile of nt blocks: out[m, c] = (sum * x scale) * weight scale (+ bias),
// w8a8_linear's order and rounding; ws, bias and out start at the tile's first channel, out rows
// ld apart.
void packed_store(const XRows& xr, int64_t m0, int64_t mc, int nt, const int32_t* tot, const float* ws, const float* bias,
                  float* out, int64_t ld) {
#if defined(NFX_W8A8_VNNI)
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t m = 0; m < mc; ++m) {
    const __m512 xs = _mm512_set1_ps(xr.scale[m0 + m]);
    for (int j = 0; j < nt; ++j) {
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(tot + (m * nt + j) * 16)), xs);
      const __m512 v = _mm512_fmadd_ps(t, _mm512_loadu_ps(ws + 16 * j), zero);  // rounded before the bias, as below
      _mm512_storeu_ps(out + (m0 + m) * ld + 16 * j, bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j)) : v);
    }
  }
  return;
#elif defined(NFX_W8A8_AVX2)
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < mc; ++m) {
    const __m256 xs = _mm256_set1_ps(xr.scale[m0 + m]);
    for (int64_t c = 0; c < nt * 16; c += 8) {
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tot + m * nt * 16 + c))), xs);
      const __m256 v = _mm256_fmadd_ps(t, _mm256_loadu_ps(ws + c), zero);  // rounded before the bias, as below
      _mm256_storeu_ps(out + (m0 + m) * ld + c, bias ? _mm256_add_ps(v, _mm256_loadu_ps(bias + c)) : v);
    }
  }
  return;
#endif
  for (int64_t m = 0; m < mc; ++m)
    for (int64_t c = 0; c < nt * 16; ++c) {
      const float v = std::fma(static_cast<float>(tot[m * nt * 16 + c]) * xr.scale[m0 + m], ws[c], 0.f);
      out[(m0 + m) * ld + c] = bias ? v + bias[c] : v;
    }
}

// One packed weight: data (NB, K4, 64), its fp32 scales and bias (or null), and the output column
// its channel 0 goes to.
struct PackedWeight {
  const uint8_t* data;
  const float* ws;
  const float* bias;
  int64_t NB;
  int64_t col;
};

// A prefill's rows go in chunks of ROW_CHUNK against a task's blocks (x's chunk stays near while
// the blocks pass), in tiles of 4 rows x 4 blocks: 1,024 rows of SmolLM2's gate 2.61 ms against
// 2.88 in 8 x 2 tiles over all rows at once (torch's _int_mm: 2.1 ms plus x's rounding).
constexpr int64_t ROW_CHUNK = 64;

// Blocks [b0, b1) of w against all M rows of x into out (M rows, ld apart). Each tile of blocks
// meets every row of x while it is in L1 (a prefill's rows in 8s).
void packed_range(const XRows& xr, int64_t M, int64_t K4, const PackedWeight& w, int64_t b0, int64_t b1, float* out, int64_t ld) {
  int32_t tot[8 * 4 * 16];
  const bool prefill = M > 8;
  const int wide = M <= 4 || prefill ? 4 : 2;
  const int64_t step = prefill ? 4 : 8;
  for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
    const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
    for (int64_t b = b0; b < b1;) {
      const int nt = b + wide <= b1 ? wide : 1;
      for (int64_t m0 = r0; m0 < r1; m0 += step) {
        const int64_t mc = std::min<int64_t>(step, r1 - m0);
        const int t = mc <= 4 ? std::min(nt, 4) : std::min(nt, 2);
        for (int64_t bb = b; bb < b + nt; bb += t) {
          packed_tile_any(xr, m0, mc, w.data, K4, bb, t, tot);
          const int64_t c = 16 * bb;
          packed_store(xr, m0, mc, t, tot, w.ws + c, w.bias ? w.bias + c : nullptr, out + w.col + c, ld);
        }
      }
      b += nt;
    }
  }
}

using OptT = c10::optional<at::Tensor>;

// A packed weight's tensors checked against x's K, its scale and bias made fp32 (kept in keep).
PackedWeight check_packed(int64_t K, const at::Tensor& data, const at::Tensor& scale, const OptT& bias, int64_t col,
                          std::vector<at::Tensor>& keep) {
  TORCH_CHECK(data.dim() == 3 && data.size(2) == 64 && data.scalar_type() == at::kByte && data.is_contiguous(),
              "w8a8_packed: data must be a contiguous uint8 (N / 16, K / 4, 64) tensor");
  const int64_t N = data.size(0) * 16;
  TORCH_CHECK(data.size(1) * 4 == K, "w8a8_packed: x has ", K, " features, the weight ", data.size(1) * 4);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "w8a8_packed: scale must be (", N, ",)");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "w8a8_packed: bias must be (", N, ",)");
  keep.push_back(scale.to(at::kFloat).contiguous());
  const float* ws = keep.back().data_ptr<float>();
  const float* bp = nullptr;
  if (bias) {
    keep.push_back(bias->to(at::kFloat).contiguous());
    bp = keep.back().data_ptr<float>();
  }
  return PackedWeight{data.data_ptr<uint8_t>(), ws, bp, data.size(0), col};
}

XRows rounded_x(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_packed: x must be float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "w8a8_packed: x must have a feature dimension");
  const at::Tensor xc = x.reshape({-1, x.size(-1)}).contiguous();
  return with_pairs(x.scalar_type() == at::kFloat ? round_any<float>(xc) : round_any<c10::BFloat16>(xc));
}

at::Tensor shaped(const at::Tensor& out, const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out.size(1);
  return out.to(x.scalar_type()).view(shape);
}

// The blocks of up to three weights (each with NB blocks of 16 channels) side by side in one (M,
// sum N) output, one parallel region over all of them: range(w, b0, b1, out, N) multiplies
// blocks [b0, b1) of w into its columns.
template <typename W, typename F>
at::Tensor side_by_side(const at::Tensor& x, int64_t M, const std::vector<W>& ws, F range) {
  std::vector<int64_t> start = {0};
  for (const auto& w : ws) start.push_back(start.back() + w.NB);
  const int64_t N = 16 * start.back();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, start.back(), 4, [&](int64_t r0, int64_t r1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t b0 = std::max(r0, start[i]) - start[i], b1 = std::min(r1, start[i + 1]) - start[i];
      if (b0 < b1) range(ws[i], b0, b1, o, N);
    }
  });
  return shaped(out, x);
}

// Up to three packed weights sharing x (Q, K, V): x rounded once, one parallel region over all
// their blocks, their columns side by side in one output (M, sum N).
at::Tensor w8a8_packed_multi(const at::Tensor& x, const at::Tensor& d0, const at::Tensor& s0, const OptT& b0, const OptT& d1,
                             const OptT& s1, const OptT& b1, const OptT& d2, const OptT& s2, const OptT& b2) {
  TORCH_CHECK(d1.has_value() == s1.has_value() && d2.has_value() == s2.has_value() && (d1.has_value() || !d2.has_value()),
              "w8a8_packed_multi: each weight needs its data and scale, d2 only after d1");
  const XRows xr = rounded_x(x);
  const int64_t K = x.size(-1), M = static_cast<int64_t>(xr.scale.size());
  std::vector<at::Tensor> keep;
  std::vector<PackedWeight> ws = {check_packed(K, d0, s0, b0, 0, keep)};
  if (d1) ws.push_back(check_packed(K, *d1, *s1, b1, ws.back().col + 16 * ws.back().NB, keep));
  if (d2) ws.push_back(check_packed(K, *d2, *s2, b2, ws.back().col + 16 * ws.back().NB, keep));
  return side_by_side(x, M, ws, [&](const PackedWeight& w, int64_t b0, int64_t b1, float* o, int64_t N) {
    packed_range(xr, M, K / 4, w, b0, b1, o, N);
  });
}

at::Tensor w8a8_packed(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale, const OptT& bias) {
  return w8a8_packed_multi(x, data, scale, bias, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
}


// g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u for i < n (16 lanes at a time where AVX-512 is).
inline void gated(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if defined(NFX_W8A8_VNNI)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// SwiGLU's first half, silu(x @ gate.T) * (x @ up.T), of packed gate and up: x rounded once, one
// parallel region; each product's fp32 values as w8a8_packed's, then silu(g) * u rounded once
// (as quant_glu).
at::Tensor w8a8_packed_glu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& gate_scale, const at::Tensor& up,
                           const at::Tensor& up_scale) {
  const XRows xr = rounded_x(x);
  const int64_t K = x.size(-1), M = static_cast<int64_t>(xr.scale.size());
  std::vector<at::Tensor> keep;
  const PackedWeight g = check_packed(K, gate, gate_scale, c10::nullopt, 0, keep), u = check_packed(K, up, up_scale, c10::nullopt, 0, keep);
  TORCH_CHECK(g.NB == u.NB, "w8a8_packed_glu: gate has ", 16 * g.NB, " rows, up has ", 16 * u.NB);
  const int64_t N = 16 * g.NB;
  at::Tensor gv = at::empty({M, N}, x.options().dtype(at::kFloat)), uv = at::empty({M, N}, x.options().dtype(at::kFloat));
  float *gp = gv.data_ptr<float>(), *up_ = uv.data_ptr<float>();
  at::parallel_for(0, g.NB, 2, [&](int64_t b0, int64_t b1) {
    packed_range(xr, M, K / 4, g, b0, b1, gp, N);
    packed_range(xr, M, K / 4, u, b0, b1, up_, N);
    for (int64_t m = 0; m < M; ++m) gated(gp + m * N + 16 * b0, up_ + m * N + 16 * b0, 16 * (b1 - b0));
  });
  return shaped(gv, x);
}

// ---- 4-bit weights packed for vpdpbusd (quant.Int4Packed) --------------------------------------
// data uint8 (N / 16, G, R): one record of R bytes per block b (16 output channels) and group g
// (32 input features), read as one stream per block: bytes [0, 256) are 4 lines of 64, line l
// holding at byte 4 c + i the nibbles of q[16 b + c, 32 g + 8 l + i] (low) and
// q[16 b + c, 32 g + 8 l + 4 + i] (high), q in [0, 15]; then the 16 channels' scales, then their
// offsets, fp16 (R = 320: GGUF's own d and m) or fp32 (R = 384); w = q * scale + offset. x is
// rounded with one scale per group of 32 (absmax / 127, as ggml's q8_1 and OpenVINO's dynamic
// quantization in groups of 32), so per group the nibble x int8 sums S and x's own sum X are
// exact integers, and
//   out = (sum over g in order of (S * scale + X * offset) * x scale of g) (+ bias)
// with every product and sum rounded once: int8_x.w4a8_linear's order, so the same bits. The
// unsigned nibbles are what vpdpbusd takes as its unsigned operand (no offset to take off).
constexpr int64_t NIBBLE_BYTES = 256;

// x rounded per group of 32: int8 rows of kp (zeros past K), each group's scale and exact sum.
struct XGroups {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;  // (M, G)
  int64_t kp, G;
};

template <typename X>
void round_group_rows(const X* x, int64_t M, int64_t K, XGroups& r) {
  at::parallel_for(0, M, ROUND_GRAIN, [&](int64_t m0, int64_t m1) {
    float row[32];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < r.G; ++g) {
        for (int i = 0; i < 32; ++i) row[i] = static_cast<float>(x[m * K + 32 * g + i]);
        bool nan = false;
        const float amax = abs_max(row, 32, &nan);
        const float s = amax / 127.f;
        r.sum[m * r.G + g] = static_cast<float>(round_row(row, 32, s > 0.f ? s : 1.f, r.q.data() + m * r.kp + 32 * g));
        r.scale[m * r.G + g] = nan ? std::numeric_limits<float>::quiet_NaN() : s;  // NaN reaches every output, as torch's amax
      }
  });
}

XGroups rounded_groups(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w4a8_packed: x must be float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "w4a8_packed: x must have a feature dimension");
  TORCH_CHECK(x.size(-1) > 0 && x.size(-1) % 32 == 0, "w4a8_packed: x's features must be a positive multiple of 32, got ", x.size(-1));
  const at::Tensor xc = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), G = K / 32, kp = (K + 63) / 64 * 64;
  XGroups r{std::vector<int8_t>(M * kp, 0), std::vector<float>(M * G), std::vector<float>(M * G), kp, G};
  if (x.scalar_type() == at::kFloat) round_group_rows(xc.data_ptr<float>(), M, K, r);
  else round_group_rows(xc.data_ptr<c10::BFloat16>(), M, K, r);
  return r;
}

// One packed 4-bit weight: its records (R bytes each, fp16 scales when half), bias (or null),
// and the output column its channel 0 goes to.
struct Packed4 {
  const uint8_t* data;
  const float* bias;
  int64_t NB;
  int64_t R;
  bool half;
  int64_t col;
};

template <typename S>
inline float scalar_at(const uint8_t* p, int c) {
  S v;
  std::memcpy(&v, p + sizeof(S) * c, sizeof(S));
  return static_cast<float>(v);
}

#if defined(NFX_W8A8_VNNI)
template <typename S>
inline __m512 load16(const uint8_t* p) {
  if constexpr (sizeof(S) == 2) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}
#elif defined(NFX_W8A8_AVX2)
template <typename S>
inline __m256 load8(const uint8_t* p) {
  if constexpr (sizeof(S) == 2) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}
#endif

#if defined(NFX_W8A8_AVX2)
// packed4_tile for AVX2 (no vpdpbusd), rows [m0, m0 + MT) (MT <= 4) against block b. vpmaddubsw:
// nibble (unsigned, at most 15) x int8 x (at most 127 in size), two products a word; each word
// sums its 16 products of a group over the 4 lines (at most 16 * 15 * 127 = 30,480: exact in
// int16), then vpmaddwd by ones gives the channel's exact int32 sum S, scaled in packed4_tile's
// order and roundings. The 8 int16 sums are named variables, as in packed_tile_avx2.
template <typename S, int MT>
__attribute__((noinline)) void packed4_tile_avx2(const XGroups& xr, int64_t m0, const Packed4& w, int64_t b, float* out, int64_t ld) {
  const int64_t G = xr.G;
  constexpr int64_t R = NIBBLE_BYTES + 32 * sizeof(S), SCALES = NIBBLE_BYTES, OFFSETS = NIBBLE_BYTES + 16 * sizeof(S);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc[2 * MT];
  for (int i = 0; i < 2 * MT; ++i) acc[i] = zero;
  const int8_t* x = xr.q.data() + m0 * xr.kp;
  const int64_t kp = xr.kp;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w.data + (b * G + g) * R;
    __m256i s00 = z, s01 = z, s10 = z, s11 = z, s20 = z, s21 = z, s30 = z, s31 = z;
    for (int l = 0; l < 4; ++l) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * l)),
                    v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * l + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                    lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
      int32_t t0, t1;
#define NFX_PACKED4_ROW_AVX2(M, S0, S1)                                                                             \
  if constexpr (MT > (M)) {                                                                                       \
    std::memcpy(&t0, x + (M) * kp + 32 * g + 8 * l, 4);                                                           \
    std::memcpy(&t1, x + (M) * kp + 32 * g + 8 * l + 4, 4);                                                       \
    const __m256i x0 = _mm256_set1_epi32(t0), x1 = _mm256_set1_epi32(t1);                                         \
    S0 = _mm256_add_epi16(S0, _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1)));    \
    S1 = _mm256_add_epi16(S1, _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1)));    \
  }
      NFX_PACKED4_ROW_AVX2(0, s00, s01) NFX_PACKED4_ROW_AVX2(1, s10, s11) NFX_PACKED4_ROW_AVX2(2, s20, s21)
      NFX_PACKED4_ROW_AVX2(3, s30, s31)
#undef NFX_PACKED4_ROW_AVX2
    }
    const __m256i sums[8] = {s00, s01, s10, s11, s20, s21, s30, s31};
    for (int h = 0; h < 2; ++h) {
      const __m256 d = load8<S>(rec + SCALES + 8 * h * sizeof(S)), o = load8<S>(rec + OFFSETS + 8 * h * sizeof(S));
      for (int m = 0; m < MT; ++m) {
        // fma with 0: a product never contracted into a sum, as in the VNNI path
        const int64_t at = (m0 + m) * G + g;
        const __m256 sd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums[2 * m + h], ones)), d, zero);
        const __m256 xo = _mm256_fmadd_ps(_mm256_set1_ps(xr.sum[at]), o, zero);
        acc[2 * m + h] = _mm256_add_ps(acc[2 * m + h], _mm256_fmadd_ps(_mm256_add_ps(sd, xo), _mm256_set1_ps(xr.scale[at]), zero));
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = 16 * b + 8 * h;
      float* o = out + (m0 + m) * ld + w.col + n;
      _mm256_storeu_ps(o, w.bias ? _mm256_add_ps(acc[2 * m + h], _mm256_loadu_ps(w.bias + n)) : acc[2 * m + h]);
    }
}
#endif

// Rows [m0, m0 + MT) against blocks [b, b + NT) of w (scales of type S), into out (rows ld apart).
template <typename S, int MT, int NT>
void packed4_tile(const XGroups& xr, int64_t m0, const Packed4& w, int64_t b, float* out, int64_t ld) {
  const int64_t G = xr.G;
  constexpr int64_t R = NIBBLE_BYTES + 32 * sizeof(S), SCALES = NIBBLE_BYTES, OFFSETS = NIBBLE_BYTES + 16 * sizeof(S);
  float acc[MT][NT][16] = {};
#if defined(NFX_W8A8_VNNI)
  __m512 av[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) av[m][j] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i s[MT][NT], t[MT][NT];  // low and high nibbles' sums apart: two chains of 4 vpdpbusd, not one of 8
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) s[m][j] = t[m][j] = _mm512_setzero_si512();
    for (int l = 0; l < 4; ++l) {
      __m512i lo[NT], hi[NT];
      for (int j = 0; j < NT; ++j) {
        const uint8_t* p = w.data + ((b + j) * G + g) * R + 64 * l;
        const __m512i v = _mm512_loadu_si512(p);
        lo[j] = _mm512_and_si512(v, low4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = xr.q.data() + (m0 + m) * xr.kp + 32 * g + 8 * l;
        int32_t t0, t1;
        std::memcpy(&t0, x, 4);
        std::memcpy(&t1, x + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(t0), x1 = _mm512_set1_epi32(t1);
        for (int j = 0; j < NT; ++j) {
          s[m][j] = _mm512_dpbusd_epi32(s[m][j], lo[j], x0);
          t[m][j] = _mm512_dpbusd_epi32(t[m][j], hi[j], x1);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const uint8_t* rec = w.data + ((b + j) * G + g) * R;
      const __m512 d = load16<S>(rec + SCALES), o = load16<S>(rec + OFFSETS);
      for (int m = 0; m < MT; ++m) {
        // products as fma with 0: GCC contracts a plain mul into the add (-ffp-contract=fast)
        const int64_t at = (m0 + m) * G + g;
        const __m512 sd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[m][j], t[m][j])), d, zero);
        const __m512 xo = _mm512_fmadd_ps(_mm512_set1_ps(xr.sum[at]), o, zero);
        av[m][j] = _mm512_add_ps(av[m][j], _mm512_fmadd_ps(_mm512_add_ps(sd, xo), _mm512_set1_ps(xr.scale[at]), zero));
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) _mm512_storeu_ps(acc[m][j], av[m][j]);
#else
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < NT; ++j) {
      const uint8_t* rec = w.data + ((b + j) * G + g) * R;
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = xr.q.data() + (m0 + m) * xr.kp + 32 * g;
        for (int c = 0; c < 16; ++c) {
          int32_t s = 0;
          for (int l = 0; l < 4; ++l)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = rec[64 * l + 4 * c + i];
              s += (byte & 0x0F) * x[8 * l + i] + (byte >> 4) * x[8 * l + 4 + i];
            }
          // fma with 0: each product rounded alone, never contracted into the sum (as the AVX path)
          const float sd = std::fma(static_cast<float>(s), scalar_at<S>(rec + SCALES, c), 0.f);
          const float xo = std::fma(xr.sum[(m0 + m) * G + g], scalar_at<S>(rec + OFFSETS, c), 0.f);
          acc[m][j][c] = acc[m][j][c] + std::fma(sd + xo, xr.scale[(m0 + m) * G + g], 0.f);
        }
      }
    }
#endif
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j)
      for (int c = 0; c < 16; ++c) {
        const int64_t n = 16 * (b + j) + c;
        out[(m0 + m) * ld + w.col + n] = w.bias ? acc[m][j][c] + w.bias[n] : acc[m][j][c];
      }
}

// mc rows against nt blocks from b: decode tiles of up to 8 rows x 1 block, prefill tiles of 4 x 2.
template <typename S>
void packed4_tile_any(const XGroups& xr, int64_t m0, int64_t mc, const Packed4& w, int64_t b, int nt, float* out, int64_t ld) {
#if defined(NFX_W8A8_AVX2)
  // tiles of up to 4 rows x 1 block: 8 int16 sums, 4 nibble halves and 2 broadcasts fill AVX2's
  // 16 registers; the block's record stays in L1 for the next 4 rows
  for (int j = 0; j < nt; ++j)
    for (int64_t r = 0; r < mc; r += 4) {
      const int64_t rc = std::min<int64_t>(4, mc - r);
      if (rc == 4) packed4_tile_avx2<S, 4>(xr, m0 + r, w, b + j, out, ld);
      else if (rc == 3) packed4_tile_avx2<S, 3>(xr, m0 + r, w, b + j, out, ld);
      else if (rc == 2) packed4_tile_avx2<S, 2>(xr, m0 + r, w, b + j, out, ld);
      else packed4_tile_avx2<S, 1>(xr, m0 + r, w, b + j, out, ld);
    }
  return;
#endif
#define NFX_PACKED4_CASE(MT, NT) \
  if (mc == MT && nt == NT) return packed4_tile<S, MT, NT>(xr, m0, w, b, out, ld);
  NFX_PACKED4_CASE(1, 1) NFX_PACKED4_CASE(2, 1) NFX_PACKED4_CASE(3, 1) NFX_PACKED4_CASE(4, 1)
  NFX_PACKED4_CASE(5, 1) NFX_PACKED4_CASE(6, 1) NFX_PACKED4_CASE(7, 1) NFX_PACKED4_CASE(8, 1)
  NFX_PACKED4_CASE(1, 2) NFX_PACKED4_CASE(2, 2) NFX_PACKED4_CASE(3, 2) NFX_PACKED4_CASE(4, 2)
#undef NFX_PACKED4_CASE
  TORCH_CHECK(false, "w4a8_packed: no tile of ", mc, " rows x ", nt, " blocks");  // packed4_rows makes none such
}

// Blocks [b0, b1) of w against all M rows. Decode rows (up to 8): one block at a time against
// all of them, so the weights are read in order, one memory stream per thread; tiles of 2 or 4
// blocks (x's broadcasts shared) read as many streams and were slower: SmolLM2's 210 Q4_1 layer
// products from memory, one row 3.4-3.8 -> 3.1-3.2 ms, four rows 5.0 -> 3.7 ms (2 threads of
// the EPYC, 2026-12-05). A prefill's rows (bound by the instructions, the blocks in cache): in
// chunks of ROW_CHUNK against pairs of blocks, tiles of 4 rows x 2 blocks (one tile of 8 x 1 was
// 1.4x slower at 128 rows).
template <typename S>
void packed4_rows(const XGroups& xr, int64_t M, const Packed4& w, int64_t b0, int64_t b1, float* out, int64_t ld) {
  if (M <= 8) {
    for (int64_t b = b0; b < b1 && M > 0; ++b) packed4_tile_any<S>(xr, 0, M, w, b, 1, out, ld);
    return;
  }
  for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
    const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
    for (int64_t b = b0; b < b1; b += 2) {
      const int nt = b + 2 <= b1 ? 2 : 1;
      for (int64_t m0 = r0; m0 < r1; m0 += 4) packed4_tile_any<S>(xr, m0, std::min<int64_t>(4, r1 - m0), w, b, nt, out, ld);
    }
  }
}

void packed4_range(const XGroups& xr, int64_t M, const Packed4& w, int64_t b0, int64_t b1, float* out, int64_t ld) {
  if (w.half) packed4_rows<c10::Half>(xr, M, w, b0, b1, out, ld);
  else packed4_rows<float>(xr, M, w, b0, b1, out, ld);
}

// A packed 4-bit weight checked against x's K (K = 32 G); its bias made fp32 (kept in keep).
Packed4 check_packed4(int64_t K, const at::Tensor& data, const OptT& bias, int64_t col, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(data.dim() == 3 && (data.size(2) == NIBBLE_BYTES + 64 || data.size(2) == NIBBLE_BYTES + 128) &&
                  data.scalar_type() == at::kByte && data.is_contiguous(),
              "w4a8_packed: data must be a contiguous uint8 (N / 16, K / 32, 320 or 384) tensor");
  const int64_t NB = data.size(0), G = data.size(1);
  TORCH_CHECK(G * 32 == K, "w4a8_packed: x has ", K, " features, the weight ", G * 32);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == 16 * NB), "w4a8_packed: bias must be (", 16 * NB, ",)");
  const float* bp = nullptr;
  if (bias) {
    keep.push_back(bias->to(at::kFloat).contiguous());
    bp = keep.back().data_ptr<float>();
  }
  return Packed4{data.data_ptr<uint8_t>(), bp, NB, data.size(2), data.size(2) == NIBBLE_BYTES + 64, col};
}

// Up to three packed 4-bit weights sharing x (Q, K, V): x rounded once, one parallel region,
// their columns side by side in one output (M, sum N).
at::Tensor w4a8_packed_multi(const at::Tensor& x, const at::Tensor& d0, const OptT& b0, const OptT& d1, const OptT& b1, const OptT& d2,
                             const OptT& b2) {
  TORCH_CHECK(d1.has_value() || !d2.has_value(), "w4a8_packed_multi: d2 only after d1");
  const XGroups xr = rounded_groups(x);
  const int64_t K = x.size(-1), M = static_cast<int64_t>(xr.scale.size()) / xr.G;
  std::vector<at::Tensor> keep;
  std::vector<Packed4> ws = {check_packed4(K, d0, b0, 0, keep)};
  if (d1) ws.push_back(check_packed4(K, *d1, b1, ws.back().col + 16 * ws.back().NB, keep));
  if (d2) ws.push_back(check_packed4(K, *d2, b2, ws.back().col + 16 * ws.back().NB, keep));
  return side_by_side(x, M, ws, [&](const Packed4& w, int64_t b0, int64_t b1, float* o, int64_t N) { packed4_range(xr, M, w, b0, b1, o, N); });
}

at::Tensor w4a8_packed(const at::Tensor& x, const at::Tensor& data, const OptT& bias) {
  return w4a8_packed_multi(x, data, bias, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
}

// silu(x @ gate.T) * (x @ up.T) of packed 4-bit gate and up: x rounded once, one parallel region,
// each product's fp32 values w4a8_packed's, then the gated product as w8a8_packed_glu's.
at::Tensor w4a8_packed_glu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
  const XGroups xr = rounded_groups(x);
  const int64_t K = x.size(-1), M = static_cast<int64_t>(xr.scale.size()) / xr.G;
  std::vector<at::Tensor> keep;
  const Packed4 g = check_packed4(K, gate, c10::nullopt, 0, keep), u = check_packed4(K, up, c10::nullopt, 0, keep);
  TORCH_CHECK(g.NB == u.NB, "w4a8_packed_glu: gate has ", 16 * g.NB, " rows, up has ", 16 * u.NB);
  const int64_t N = 16 * g.NB;
  at::Tensor gv = at::empty({M, N}, x.options().dtype(at::kFloat)), uv = at::empty({M, N}, x.options().dtype(at::kFloat));
  float *gp = gv.data_ptr<float>(), *up_ = uv.data_ptr<float>();
  at::parallel_for(0, g.NB, 2, [&](int64_t b0, int64_t b1) {
    packed4_range(xr, M, g, b0, b1, gp, N);
    packed4_range(xr, M, u, b0, b1, up_, N);
    for (int64_t m = 0; m < M; ++m) gated(gp + m * N + 16 * b0, up_ + m * N + 16 * b0, 16 * (b1 - b0));
  });
  return shaped(gv, x);
}

std::string w8a8_isa() {
#if defined(NFX_W8A8_VNNI)
  return "vnni";
#elif defined(NFX_W8A8_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) {
  m.def("w8a8_gemm(Tensor x, Tensor data, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w8a8_packed(Tensor x, Tensor data, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w8a8_packed_multi(Tensor x, Tensor d0, Tensor s0, Tensor? b0, Tensor? d1, Tensor? s1, Tensor? b1, Tensor? d2, Tensor? s2, "
        "Tensor? b2) -> Tensor");
  m.def("w8a8_packed_glu(Tensor x, Tensor gate, Tensor gate_scale, Tensor up, Tensor up_scale) -> Tensor");
  m.def("w4a8_packed(Tensor x, Tensor data, Tensor? bias) -> Tensor");
  m.def("w4a8_packed_multi(Tensor x, Tensor d0, Tensor? b0, Tensor? d1, Tensor? b1, Tensor? d2, Tensor? b2) -> Tensor");
  m.def("w4a8_packed_glu(Tensor x, Tensor gate, Tensor up) -> Tensor");
  m.def("w8a8_isa() -> str", &w8a8_isa);
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) {
  m.impl("w8a8_gemm", &w8a8_gemm);
  m.impl("w8a8_packed", &w8a8_packed);
  m.impl("w8a8_packed_multi", &w8a8_packed_multi);
  m.impl("w8a8_packed_glu", &w8a8_packed_glu);
  m.impl("w4a8_packed", &w4a8_packed);
  m.impl("w4a8_packed_multi", &w4a8_packed_multi);
  m.impl("w4a8_packed_glu", &w4a8_packed_glu);
}

// C shims (c_shims.h) of the int8-activation decode products.
NFX_SHIM(w8a8_gemm, AtenTensorHandle x, AtenTensorHandle data, AtenTensorHandle scale, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(w8a8_gemm(nfx_shim::tensor(x), nfx_shim::tensor(data), nfx_shim::tensor(scale), nfx_shim::optional(bias)));
  });
}
NFX_SHIM(w8a8_packed, AtenTensorHandle x, AtenTensorHandle data, AtenTensorHandle scale, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(w8a8_packed(nfx_shim::tensor(x), nfx_shim::tensor(data), nfx_shim::tensor(scale), nfx_shim::optional(bias)));
  });
}
NFX_SHIM(w8a8_packed_multi, AtenTensorHandle x, AtenTensorHandle d0, AtenTensorHandle s0, AtenTensorHandle* b0, AtenTensorHandle* d1,
         AtenTensorHandle* s1, AtenTensorHandle* b1, AtenTensorHandle* d2, AtenTensorHandle* s2, AtenTensorHandle* b2, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(w8a8_packed_multi(nfx_shim::tensor(x), nfx_shim::tensor(d0), nfx_shim::tensor(s0), nfx_shim::optional(b0),
                                               nfx_shim::optional(d1), nfx_shim::optional(s1), nfx_shim::optional(b1), nfx_shim::optional(d2),
                                               nfx_shim::optional(s2), nfx_shim::optional(b2)));
  });
}
NFX_SHIM(w8a8_packed_glu, AtenTensorHandle x, AtenTensorHandle gate, AtenTensorHandle gate_scale, AtenTensorHandle up,
         AtenTensorHandle up_scale, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(w8a8_packed_glu(nfx_shim::tensor(x), nfx_shim::tensor(gate), nfx_shim::tensor(gate_scale),
                                             nfx_shim::tensor(up), nfx_shim::tensor(up_scale)));
  });
}
NFX_SHIM(w4a8_packed, AtenTensorHandle x, AtenTensorHandle data, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret0 = nfx_shim::result(w4a8_packed(nfx_shim::tensor(x), nfx_shim::tensor(data), nfx_shim::optional(bias))); });
}
NFX_SHIM(w4a8_packed_multi, AtenTensorHandle x, AtenTensorHandle d0, AtenTensorHandle* b0, AtenTensorHandle* d1, AtenTensorHandle* b1,
         AtenTensorHandle* d2, AtenTensorHandle* b2, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(w4a8_packed_multi(nfx_shim::tensor(x), nfx_shim::tensor(d0), nfx_shim::optional(b0), nfx_shim::optional(d1),
                                               nfx_shim::optional(b1), nfx_shim::optional(d2), nfx_shim::optional(b2)));
  });
}
NFX_SHIM(w4a8_packed_glu, AtenTensorHandle x, AtenTensorHandle gate, AtenTensorHandle up, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret0 = nfx_shim::result(w4a8_packed_glu(nfx_shim::tensor(x), nfx_shim::tensor(gate), nfx_shim::tensor(up))); });
}
