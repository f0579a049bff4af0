// Quantized-weight products for decode: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w
// stored as int8 (per channel), int4 (group-wise), or GGUF Q4_0 / Q4_1 / Q8_0 blocks
// (layouts: graphs/quant.py). Weight-only: x stays fp32 (bf16 x is widened exactly), the weights
// are widened to fp32 in registers and the products accumulate in fp32.
//
// Decode is bound by reading the weights, so each weight row is read from memory once against
// every row of x: a tile of NT weight rows meets the x rows in chunks of MT (MT * NT
// accumulators in registers; chunks after the first re-read the tile from L1), and the tile two
// ahead is prefetched into L2. Output rows are split across torch's threads (OpenMP).
//
// Per group of g weights with scale d and offset o (o = -8 d for Q4_0, 0 for Q8_0 and int8):
// - 4-bit formats on AVX-512: a 16-lane permute (vpermps) is a lookup table of the group's 16
//   values i * d + o, built with one FMA per group; the nibbles (zero-extended bytes; the high
//   ones shifted) index it, giving the dequantized fp32 weights for plain FMAs against x.
// - otherwise: sum_k x_k (d q_k + o) = d * sum_k x_k q_k + o * sum_k x_k, so the inner loop is
//   an FMA of x against the widened raw values (and / shift, int32 -> fp32), d is applied once
//   per group and vector of accumulators, and o against per-group sums of x computed once per
//   call (llama.cpp's q4_1 dot product splits the same way, ggml-cpu quants.c
//   ``ggml_vec_dot_q4_1_q8_1``; unlike it, x is never quantized here).
//
// Every a * b + c outside the intrinsics is an explicit std::fma: left to the compiler it was
// contracted in some tile shapes and not others, and a row's bits depended on its neighbours.
//
// SIMD path, chosen at compile time from -march=native's macros: AVX-512F (16 fp32 lanes),
// AVX2 + FMA + F16C (8 lanes), or portable scalar code; ``neuronfx::quant_isa()`` names it.
// Defining NFX_QUANT_AVX2 or NFX_QUANT_SCALAR forces a narrower path (to test it on a wider CPU).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include "c_shims.h"
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__F16C__) && !defined(NFX_QUANT_AVX2) && !defined(NFX_QUANT_SCALAR)
#define NFX_Q_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(NFX_QUANT_SCALAR)
#define NFX_Q_AVX2 1
#endif
#if defined(NFX_Q_AVX512) || defined(NFX_Q_AVX2)
#include <immintrin.h>
#endif

namespace {

enum Format : int64_t { kInt8 = 0, kInt4 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4 };

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(NFX_Q_AVX512) || defined(NFX_Q_AVX2)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}
inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

// ---- ISA: W fp32 lanes; nibbles() widens W bytes to their low and high nibbles, s8() W int8;
// kRegs: accumulators a tile keeps in registers (MT * NT). AVX-512 adds the 4-bit lookup table ----

#if defined(NFX_Q_AVX512)
struct Isa {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kRegs = 8;  // of 32 zmm (the split path keeps as many per-group partial sums)
  static constexpr const char* kName = "avx512";
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static __m256 fold(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  // The sum of v's lanes added in hsum4's order: an output's bits must not depend on whether its
  // tile reduced it alone or in a group of four (rows of one call equal the same rows alone).
  static float hsum(V v) {
    const __m256 f = fold(v), t = _mm256_hadd_ps(f, f), t2 = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
  }
  // out[i] = sum of v[i], i < 4: halves folded, then a transposing reduction (hadd).
  static void hsum4(const V* v, float* out) {
    const __m256 ab = _mm256_hadd_ps(fold(v[0]), fold(v[1])), cd = _mm256_hadd_ps(fold(v[2]), fold(v[3]));
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lane i of each 128-bit half: part of sum i
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static V s8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // The 16 values a group's nibbles stand for, i * d + o for i in [0, 16): one lane each.
  static V table(float d, float o) {
    const V iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(o));
  }
  static V table8(float d) {  // Q4_0: (i - 8) * d
    return _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_ps(d));
  }
  // The fp16 pairs at p + i * stride, i < n -> fp32 at out[2i], out[2i + 1]: four pairs per
  // conversion. Converting a tile's GGUF block headers ahead of its blocks leaves one FMA per
  // block for the table; converting and broadcasting d and m inside the block loop cost 37% of
  // a one-row Q4_1 product in cache (a gather instead was slower still on Zen 4).
  static void fp16_pairs(const uint8_t* p, int64_t stride, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      int32_t h[4];
      for (int c = 0; c < 4; ++c) std::memcpy(h + c, p + (i + c) * stride, 4);
      _mm256_storeu_ps(out + 2 * i, _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3])));
    }
    for (; i < n; ++i) {
      int32_t h;
      std::memcpy(&h, p + i * stride, 4);
      _mm_storel_pi(reinterpret_cast<__m64*>(out + 2 * i), _mm_cvtph_ps(_mm_cvtsi32_si128(h)));
    }
  }
  // 16 bytes -> the table's values for their low and high nibbles (vpermps reads the low 4 bits
  // of each index lane, so the low nibble needs no mask).
  static void lookup(const uint8_t* p, V t, V& lo, V& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(v, t);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
  }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};
#elif defined(NFX_Q_AVX2)
struct Isa {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kRegs = 4;  // of 16 ymm
  static constexpr const char* kName = "avx2";
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static float hsum(V v) {  // in hsum4's order (see the AVX-512 hsum)
    const __m256 t = _mm256_hadd_ps(v, v), t2 = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
  }
  static void hsum4(const V* v, float* out) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static V s8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};
#else
struct Isa {
  using V = float;
  static constexpr int W = 1;
  static constexpr int kRegs = 8;
  static constexpr const char* kName = "scalar";
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static V set1(float a) { return a; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V mul(V a, V b) { return a * b; }
  static float hsum(V v) { return v; }
  static void hsum4(const V* v, float* out) { std::copy(v, v + 4, out); }
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    lo = static_cast<float>(p[0] & 0x0F);
    hi = static_cast<float>(p[0] >> 4);
  }
  static V s8(const uint8_t* p) { return static_cast<float>(static_cast<int8_t>(p[0])); }
  static void prefetch(const void*) {}
};
#endif
using V = Isa::V;
constexpr int W = Isa::W;

// out[i] = the sum of the lanes of v[i] for i < C, four at a time (a tile's rows are short, so
// the horizontal sums are a visible share of the work).
template <int C>
inline void reduce(const V* v, float* out) {
  int i = 0;
  for (; i + 4 <= C; i += 4) Isa::hsum4(v + i, out + i);
  for (; i < C; ++i) out[i] = Isa::hsum(v[i]);
}

// ---- layouts: where group b of row n keeps its quantized values, scale and offset ----------
// kNibbles: 4-bit values, byte j of a group = element j (low nibble) and j + g/2 (high nibble);
// otherwise int8 values. kOffset: the group has an offset term (needs per-group sums of x).

// kG: the group size when known at compile time (32, 64, 128: the chunk loops unroll), else 0.
template <typename S, int kG>
struct Int4Layout {
  static constexpr bool kNibbles = true, kOffset = true;
  const uint8_t* data;
  const S* scale;
  const S* offset;
  int64_t row_bytes, groups, g;
  int64_t group() const { return kG ? kG : g; }
  const uint8_t* row(int64_t n) const { return data + n * row_bytes; }
  const uint8_t* values(const uint8_t* r, int64_t b) const { return r + b * (group() / 2); }
  float d(int64_t n, const uint8_t*, int64_t b) const { return to_f(scale[n * groups + b]); }
  float off(int64_t n, const uint8_t*, int64_t b) const { return to_f(offset[n * groups + b]); }
  // hdr[2b] = scale, hdr[2b + 1] = offset of row n's groups (the int8-activation path).
  void pairs(int64_t n, const uint8_t*, int64_t groups, float* hdr) const {
    for (int64_t b = 0; b < groups; ++b) hdr[2 * b] = to_f(scale[n * groups + b]), hdr[2 * b + 1] = to_f(offset[n * groups + b]);
  }
#if defined(NFX_Q_AVX512)
  void headers(const uint8_t*, int64_t, float*) const {}  // scales and offsets are read in place
  V table(int64_t n, const uint8_t* r, int64_t b, const float*) const { return Isa::table(d(n, r, b), off(n, r, b)); }
#endif
};

// GGUF blocks of 32 (ggml-common.h block_q4_0 / block_q4_1 / block_q8_0): fp16 d [, fp16 m], values.
template <int kBytes, int kHeader, bool kNib, bool kOff>
struct GgufLayout {
  static constexpr bool kNibbles = kNib, kOffset = kOff;
  const uint8_t* data;
  int64_t row_bytes;
  int64_t group() const { return 32; }
  const uint8_t* row(int64_t n) const { return data + n * row_bytes; }
  const uint8_t* values(const uint8_t* r, int64_t b) const { return r + b * kBytes + kHeader; }
  float d(int64_t, const uint8_t* r, int64_t b) const { return half_at(r + b * kBytes); }
  float off(int64_t, const uint8_t* r, int64_t b) const {
    // Q4_1: m; Q4_0: w = (q - 8) d, so the offset is -8 d.
    return kHeader == 4 ? half_at(r + b * kBytes + 2) : -8.f * half_at(r + b * kBytes);
  }
  // hdr[2b] = d, hdr[2b + 1] = the offset (Q4_1: m; Q4_0: -8 d) of row r's blocks.
  void pairs(int64_t, const uint8_t* r, int64_t groups, float* hdr) const {
#if defined(NFX_Q_AVX512)
    Isa::fp16_pairs(r, kBytes, groups, hdr);
#else
    for (int64_t b = 0; b < groups; ++b) hdr[2 * b] = half_at(r + b * kBytes), hdr[2 * b + 1] = half_at(r + b * kBytes + 2);
#endif
    if constexpr (kHeader == 2)  // the "m" read above is two value bytes
      for (int64_t b = 0; b < groups; ++b) hdr[2 * b + 1] = -8.f * hdr[2 * b];
  }
#if defined(NFX_Q_AVX512)
  // A row's block headers as fp32: hdr[2b] = d, hdr[2b + 1] = m (Q4_1; Q4_0: the first two
  // value bytes, unused).
  void headers(const uint8_t* r, int64_t groups, float* hdr) const { Isa::fp16_pairs(r, kBytes, groups, hdr); }
  V table(int64_t, const uint8_t*, int64_t b, const float* hdr) const {
    return kHeader == 4 ? Isa::table(hdr[2 * b], hdr[2 * b + 1]) : Isa::table8(hdr[2 * b]);
  }
#endif
};
using Q4_0Layout = GgufLayout<18, 2, true, true>;
using Q4_1Layout = GgufLayout<20, 4, true, true>;
using Q8_0Layout = GgufLayout<34, 2, false, false>;

// x as the kernel reads it: fp32 rows of kp (K padded with zeros to whole groups) and, for
// layouts with offsets, the sum of each group of each row.
// Chunks of the int8-activation path: 64 weights from 32 bytes of nibbles, lanes 0-31 their
// low nibbles, 32-63 their high ones. ``pair``: two groups of 32 per chunk (g = 32 and the GGUF
// blocks: 16 bytes each, so lanes [a 0-15, b 0-15, a 16-31, b 16-31]); otherwise g is a multiple
// of 64 and a chunk lies in one group.
struct ChunkMap {
  bool pair = true;
  int64_t g = 32, groups = 0, chunks = 0, per = 1;  // per: chunks per group when not pair
};

struct Xs {
  const float* x;
  const float* sums;
  int64_t kp, groups;
  float* hdr;  // per task: room for 8 rows of 2 * (groups + 1) fp32 block headers
  // int8 activations (``int8x``): x rounded to int8 in chunk lane order, 64 per chunk and row;
  // dxv: each chunk's two scales (lanes 0-31, 32-63) spread over 16 int32 lanes (8 each); hw:
  // per row, interleaved (0, the group's exact x sum), dotted with a weight row's (scale,
  // offset) header pairs for the offsets' share.
  bool int8x = false;
  const int8_t* xq = nullptr;
  const float* dxv = nullptr;
  const float* hw = nullptr;
  ChunkMap cm{};
};

// MT rows of x against NT weight rows starting at n: res[m * NT + j] = sum over groups of
// d * (x . q) + off * xsum. Grouped layouts (everything but int8).
template <typename L, int MT, int NT>
inline void group_tile(const L& lay, const Xs& xs, int64_t n, int64_t pf_rows, float* res) {
  const int64_t g = lay.group(), half = g / 2;
  const uint8_t* r[NT];
  for (int j = 0; j < NT; ++j) r[j] = lay.row(n + j);
  V tot[MT][NT];
  float corr[MT][NT] = {};
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) tot[m][j] = Isa::zero();
  for (int64_t b = 0; b < xs.groups; ++b) {
    const float* xb = xs.x + b * g;
    V acc[MT][NT];
    // The same bytes two tiles ahead, into L2: a tile's rows are short (a few hundred bytes), too
    // short for the hardware stream prefetcher to ramp up. On the AMD EPYC (Zen 4) this was
    // measured on, T1 (L2) beat T0 (L1) by 1.1x (4-bit) to 1.7x (8-bit) at one row, and no
    // prefetch was slowest. Prefetches never fault, so running past the last row is harmless.
    for (int j = 0; j < NT; ++j) Isa::prefetch(lay.values(r[j], b) + pf_rows * lay.row_bytes);
    if constexpr (L::kNibbles) {
      for (int j = 0; j < NT; ++j) {
        V lo, hi;
        Isa::nibbles(lay.values(r[j], b), lo, hi);
        for (int m = 0; m < MT; ++m)
          acc[m][j] = Isa::fma(Isa::load(xb + m * xs.kp + half), hi, Isa::mul(Isa::load(xb + m * xs.kp), lo));
      }
      for (int64_t c = W; c < half; c += W)
        for (int j = 0; j < NT; ++j) {
          V lo, hi;
          Isa::nibbles(lay.values(r[j], b) + c, lo, hi);
          for (int m = 0; m < MT; ++m) {
            acc[m][j] = Isa::fma(Isa::load(xb + m * xs.kp + c), lo, acc[m][j]);
            acc[m][j] = Isa::fma(Isa::load(xb + m * xs.kp + half + c), hi, acc[m][j]);
          }
        }
    } else {
      for (int j = 0; j < NT; ++j) {
        const V q = Isa::s8(lay.values(r[j], b));
        for (int m = 0; m < MT; ++m) acc[m][j] = Isa::mul(Isa::load(xb + m * xs.kp), q);
      }
      for (int64_t c = W; c < g; c += W)
        for (int j = 0; j < NT; ++j) {
          const V q = Isa::s8(lay.values(r[j], b) + c);
          for (int m = 0; m < MT; ++m) acc[m][j] = Isa::fma(Isa::load(xb + m * xs.kp + c), q, acc[m][j]);
        }
    }
    for (int j = 0; j < NT; ++j) {
      const V d = Isa::set1(lay.d(n + j, r[j], b));
      for (int m = 0; m < MT; ++m) tot[m][j] = Isa::fma(acc[m][j], d, tot[m][j]);
      if constexpr (L::kOffset) {
        const float o = lay.off(n + j, r[j], b);
        for (int m = 0; m < MT; ++m) corr[m][j] = std::fma(o, xs.sums[m * xs.groups + b], corr[m][j]);
      }
    }
  }
  reduce<MT * NT>(&tot[0][0], res);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) res[m * NT + j] += corr[m][j];
}

#if defined(NFX_Q_AVX512)
// 4-bit layouts where a 16-lane permute serves as lookup table (AVX-512): each group's nibbles
// are dequantized in registers (q * d + o, one FMA per group for the table) and the products
// are fp32 FMAs of x against those weights, as small_gemm; no per-group sums of x.
template <typename L, int MT, int NT>
inline void table_tile(const L& lay, const Xs& xs, int64_t n, int64_t pf_rows, float* res) {
  const int64_t g = lay.group(), half = g / 2;
  const uint8_t* r[NT];
  for (int j = 0; j < NT; ++j) r[j] = lay.row(n + j);
  const int64_t hdr_stride = 2 * xs.groups;
  for (int j = 0; j < NT; ++j) lay.headers(r[j], xs.groups, xs.hdr + j * hdr_stride);
  V tot[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) tot[m][j] = Isa::zero();
  for (int64_t b = 0; b < xs.groups; ++b) {
    const float* xb = xs.x + b * g;
    for (int j = 0; j < NT; ++j) Isa::prefetch(lay.values(r[j], b) + pf_rows * lay.row_bytes);
    for (int j = 0; j < NT; ++j) {
      const V t = lay.table(n + j, r[j], b, xs.hdr + j * hdr_stride);
      for (int64_t c = 0; c < half; c += W) {
        V lo, hi;
        Isa::lookup(lay.values(r[j], b) + c, t, lo, hi);
        for (int m = 0; m < MT; ++m) {
          tot[m][j] = Isa::fma(Isa::load(xb + m * xs.kp + c), lo, tot[m][j]);
          tot[m][j] = Isa::fma(Isa::load(xb + m * xs.kp + half + c), hi, tot[m][j]);
        }
      }
    }
  }
  reduce<MT * NT>(&tot[0][0], res);
}
#endif

// ---- int8 activations (opt-in, ``int8_x``): llama.cpp's approach for 4-bit weights ----------
// x is rounded to int8 with one scale per 32 of a chunk's lanes (absmax / 127, as ggml's
// ``quantize_row_q8_1``), and each chunk's 64 nibble x int8 products are summed exactly in int32
// lanes of four (AVX512-VNNI ``vpdpbusd``: unsigned nibbles times signed x), then scaled by the
// weight scale and x scale of their lanes and accumulated in fp32. The offsets' share, offset
// times the group's x sum, uses x's exact fp32 sums. Reference: ggml-cpu ``ggml_vec_dot_q4_1_q8_1``.
#if defined(NFX_Q_AVX512) && defined(__AVX512VNNI__)
#define NFX_Q_VNNI 1
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#if defined(NFX_Q_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// The 32 bytes of nibbles behind chunk c (group gi, chunk sub of it); a missing second group of
// a pair (odd group count) reads as zeros.
template <typename L>
inline void chunk_bytes(const L& lay, const uint8_t* r, const ChunkMap& cm, int64_t c, int64_t gi, int64_t sub, uint8_t* out) {
  if (cm.pair) {
    std::memcpy(out, lay.values(r, 2 * c), 16);
    if (2 * c + 1 < cm.groups) std::memcpy(out + 16, lay.values(r, 2 * c + 1), 16);
    else std::memset(out + 16, 0, 16);
  } else {
    std::memcpy(out, lay.values(r, gi) + 32 * sub, 32);
  }
}

template <typename L, int MT, int NT>
inline void int8x_tile(const L& lay, const Xs& xs, int64_t n, int64_t pf_rows, float* res) {
  const ChunkMap& cm = xs.cm;
  const int64_t hs = 2 * (xs.groups + 1);
  const uint8_t* r[NT];
  for (int j = 0; j < NT; ++j) {
    r[j] = lay.row(n + j);
    float* h = xs.hdr + j * hs;
    lay.pairs(n + j, r[j], xs.groups, h);
    h[2 * xs.groups] = h[2 * xs.groups + 1] = 0.f;  // the missing second group of an odd pair
  }
  float corr[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) corr[m][j] = dot(xs.hdr + j * hs, xs.hw + m * hs, 2 * xs.groups);
#if defined(NFX_Q_VNNI)
  const __m512i pair_idx = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  V acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = Isa::zero();
  for (int64_t c = 0, gi = 0, sub = 0; c < cm.chunks; ++c) {
    for (int j = 0; j < NT; ++j) Isa::prefetch(lay.values(r[j], cm.pair ? 2 * c : gi) + pf_rows * lay.row_bytes);
    for (int j = 0; j < NT; ++j) {
      __m256i v;
      if (cm.pair) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lay.values(r[j], 2 * c)));
        const __m128i b = 2 * c + 1 < cm.groups ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(lay.values(r[j], 2 * c + 1)))
                                                : _mm_setzero_si128();
        v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
      } else {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lay.values(r[j], gi) + 32 * sub));
      }
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                           _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
      const float* h = xs.hdr + j * hs;
      const V dw = cm.pair ? _mm512_permutexvar_ps(pair_idx, _mm512_castps128_ps512(_mm_loadu_ps(h + 4 * c)))
                           : _mm512_set1_ps(h[2 * gi]);
      for (int m = 0; m < MT; ++m) {
        const int64_t at = m * cm.chunks + c;
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xs.xq + 64 * at));
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_loadu_ps(xs.dxv + 16 * at)), acc[m][j]);
      }
    }
    if (!cm.pair && ++sub == cm.per) sub = 0, ++gi;
  }
  reduce<MT * NT>(&acc[0][0], res);
#else
  for (int i = 0; i < MT * NT; ++i) res[i] = 0.f;
  uint8_t bytes[32];
  for (int64_t c = 0, gi = 0, sub = 0; c < cm.chunks; ++c) {
    for (int j = 0; j < NT; ++j) {
      chunk_bytes(lay, r[j], cm, c, gi, sub, bytes);
      const float* h = xs.hdr + j * hs;
      for (int m = 0; m < MT; ++m) {
        const int64_t at = m * cm.chunks + c;
        float a = 0.f;
        for (int l = 0; l < 16; ++l) {  // lane l: bytes 4l..4l+3 of the unpacked 64
          int32_t s = 0;
          for (int t = 0; t < 4; ++t) {
            const int i = 4 * l + t;
            const int q = i < 32 ? bytes[i] & 0x0F : bytes[i - 32] >> 4;
            s += q * xs.xq[64 * at + i];
          }
          const float dw = cm.pair ? h[2 * (2 * c + ((l / 4) & 1))] : h[2 * gi];
          a = std::fma(static_cast<float>(s) * dw, xs.dxv[16 * at + l], a);
        }
        res[m * NT + j] += a;
      }
    }
    if (!cm.pair && ++sub == cm.per) sub = 0, ++gi;
  }
#endif
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) res[m * NT + j] += corr[m][j];
}

// int8 per output channel: one scale per row, no groups; K need not be a multiple of W.
template <typename S>
struct Int8Layout {
  static constexpr bool kNibbles = false;
  const int8_t* data;
  const S* scale;
  int64_t k;
};

template <typename S, int MT, int NT>
inline void int8_tile(const Int8Layout<S>& lay, const Xs& xs, int64_t n, int64_t pf_rows, float* res) {
  const int64_t K = lay.k, KW = K / W * W;
  const uint8_t* r[NT];
  for (int j = 0; j < NT; ++j) r[j] = reinterpret_cast<const uint8_t*>(lay.data + (n + j) * K);
  V acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = Isa::zero();
  for (int64_t k = 0; k < KW; k += W) {
    if (k % 64 == 0)
      for (int j = 0; j < NT; ++j) Isa::prefetch(r[j] + k + pf_rows * K);
#if defined(NFX_Q_AVX2)
    // x pinned to registers: GCC otherwise folds its load into each of the NT FMAs that use it
    V xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = Isa::load(xs.x + m * xs.kp + k);
      asm("" : "+x"(xv[m]));
    }
    for (int j = 0; j < NT; ++j) {
      const V q = Isa::s8(r[j] + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = Isa::fma(xv[m], q, acc[m][j]);
    }
#else
    for (int j = 0; j < NT; ++j) {
      const V q = Isa::s8(r[j] + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = Isa::fma(Isa::load(xs.x + m * xs.kp + k), q, acc[m][j]);
    }
#endif
  }
  reduce<MT * NT>(&acc[0][0], res);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      float a = res[m * NT + j];
      for (int64_t k = KW; k < K; ++k) a = std::fma(xs.x[m * xs.kp + k], static_cast<float>(static_cast<int8_t>(r[j][k])), a);
      res[m * NT + j] = a * to_f(lay.scale[n + j]);
    }
}

template <int MT, int NT, typename S>
inline void tile(const Int8Layout<S>& lay, const Xs& xs, int64_t n, float* res) { int8_tile<S, MT, NT>(lay, xs, n, 2 * NT, res); }
template <int MT, int NT, typename L>
inline void tile(const L& lay, const Xs& xs, int64_t n, float* res) {
  if constexpr (L::kNibbles) {
    if (xs.int8x) {
      int8x_tile<L, MT, NT>(lay, xs, n, 2 * NT, res);
      return;
    }
  }
#if defined(NFX_Q_AVX512)
  if constexpr (L::kNibbles) {
    table_tile<L, MT, NT>(lay, xs, n, 2 * NT, res);
    return;
  }
#endif
  group_tile<L, MT, NT>(lay, xs, n, 2 * NT, res);
}

// Where results go: out (M, N) in x's dtype, plus the bias.
struct Out {
  void* ptr;
  bool bf16;
  int64_t n_cols;
  const float* bias;
  void put(int64_t m0, int64_t n, int mt, int nt, const float* res) const {
    for (int m = 0; m < mt; ++m)
      for (int j = 0; j < nt; ++j) {
        const float v = res[m * nt + j] + (bias ? bias[n + j] : 0.f);
        const int64_t i = (m0 + m) * n_cols + n + j;
        if (bf16) static_cast<c10::BFloat16*>(ptr)[i] = c10::BFloat16(v);
        else static_cast<float*>(ptr)[i] = v;
      }
  }
};

template <int MT, int NT, typename L>
inline void tile_rows(const L& lay, const Xs& xs, int64_t m0, int64_t n, const Out& out) {
  float res[MT * NT];
  Xs sub = xs;
  sub.x = xs.x + m0 * xs.kp;
  sub.sums = xs.sums ? xs.sums + m0 * xs.groups : nullptr;
  if (xs.int8x) {
    sub.xq = xs.xq + m0 * 64 * xs.cm.chunks;
    sub.dxv = xs.dxv + m0 * 16 * xs.cm.chunks;
    sub.hw = xs.hw + m0 * 2 * (xs.groups + 1);
  }
  tile<MT, NT>(lay, sub, n, res);
  out.put(m0, n, MT, NT, res);
}

template <typename L>
struct IsInt8 : std::false_type {};
template <typename S>
struct IsInt8<Int8Layout<S>> : std::true_type {};

// Accumulators a tile of layout L keeps in registers (MT * NT): the 4-bit paths of AVX-512
// (lookup table, int8 x) and int8 per channel (no groups: no partial sums) keep only their
// sums, 16 of the 32 zmm (8 rows of x meet 2 weight rows, so each x load serves two FMAs);
// int8 per channel on AVX2 12 of the 16 ymm (3 rows of x meet 4 weight rows, max_mt);
// the others Isa::kRegs.
template <typename L>
constexpr int regs() {
#if defined(NFX_Q_AVX512)
  if constexpr (L::kNibbles || IsInt8<L>::value) return 16;
#elif defined(NFX_Q_AVX2)
  if constexpr (IsInt8<L>::value) return 12;
#endif
  return Isa::kRegs;
}

// The most rows of x one tile takes: 8, but 3 for int8 weights on AVX2, where 3 rows of x
// (pinned in registers) meet 4 weight rows: 12 FMAs for 3 loads of x, 4 of weights and 8 widening
// instructions, where 8 x 1 tiles took 9 loads for 8 FMAs. SmolLM2's 210 layer products, 2
// threads of a 2-core AMD EPYC (AVX2), 2026-12-06: 8 rows 16.1 ms against 20.65 for 8 x 1, 6
// rows 13.2 against 16.1, 5 rows 11.2 against 14.7, 4 rows 10.5 against 14.0; the pinned x
// alone (the same 2 x 4 and 1 x 4 tiles as before): 2 rows 6.9 against 8.4, 1 row 7.2 against 7.6.
// A microbenchmark: whole batch-8 steps did not move measurably (docs/performance.md, CPU kernels).
template <typename L>
constexpr int max_mt() {
#if defined(NFX_Q_AVX2)
  if constexpr (IsInt8<L>::value) return 3;
#endif
  return 8;
}

// The most weight rows one tile takes: 8, but 4 for int8 weights on AVX2, where their 12
// registers would let one row of x meet 8 (measured 5-8% slower than 4 at one row).
template <typename L>
constexpr int max_nt() {
#if defined(NFX_Q_AVX2)
  if constexpr (IsInt8<L>::value) return 4;
#endif
  return 8;
}

// Rows [m, m + R) of x against weight rows [n, n + NT), R < 8 known only at run time.
template <int NT, typename L, int R = 1>
inline void rest_rows(const L& lay, const Xs& xs, int64_t m, int64_t r, int64_t n, const Out& out) {
  if constexpr (R < 8 && R * NT <= regs<L>()) {
    if (r == R) tile_rows<R, NT>(lay, xs, m, n, out);
    else rest_rows<NT, L, R + 1>(lay, xs, m, r, n, out);
  }
}

// All M rows of x against weight rows [n, n + NT): chunks of MT rows (at most 8, MT * NT
// accumulators), then the rest in one chunk (5 rows: one pass of 5, not 4 and 1, so each
// weight is unpacked once); chunks after the first read the tile's rows from L1.
template <int NT, typename L>
inline void all_rows(const L& lay, const Xs& xs, int64_t M, int64_t n, const Out& out) {
  constexpr int MT = std::min(max_mt<L>(), regs<L>() / NT);
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile_rows<MT, NT>(lay, xs, m, n, out);
  if (m < M) rest_rows<NT>(lay, xs, m, M - m, n, out);
}

// Output columns [n0, n1): tiles of NT weight rows, NT the largest power of two (at most 8)
// with NT times the rows of a chunk <= regs<L>() (one row of x meets 8 weight rows at a time
// on AVX-512: independent FMA chains for the pipelines and fewer tile ends).
template <typename L>
void run_rows(const L& lay, const Xs& xs, int64_t M, int64_t n0, int64_t n1, const Out& out) {
  constexpr int kRegs = regs<L>(), kMaxNt = max_nt<L>();
  const int64_t mt = std::min<int64_t>({M, max_mt<L>(), kRegs});
  const int64_t per = kRegs / mt;
  const int64_t nt = per >= 8 && kMaxNt >= 8 ? 8 : per >= 4 ? 4 : per >= 2 ? 2 : 1;
  int64_t n = n0;
  if constexpr (kRegs >= 8 && kMaxNt >= 8)
    if (nt == 8)
      for (; n + 8 <= n1; n += 8) all_rows<8>(lay, xs, M, n, out);
  if (nt >= 4)
    for (; n + 4 <= n1; n += 4) all_rows<4>(lay, xs, M, n, out);
  if (nt >= 2)
    for (; n + 2 <= n1; n += 2) all_rows<2>(lay, xs, M, n, out);
  for (; n < n1; ++n) all_rows<1>(lay, xs, M, n, out);
}

// Grain: at least 64 output rows per task, so the 192-row K/V projections split in two (as small_gemm).
constexpr int64_t GRAIN = 64;

// The sum of g values (a group of x, for the offsets' share). AVX-512: 16 lanes, then one
// reduction (a sequential sum was a chain of g dependent adds, about 2 us per call at K = 1536).
inline float group_sum(const float* v, int64_t g) {
  int64_t k = 0;
  float a = 0.f;
#if defined(NFX_Q_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; k + 16 <= g; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(v + k));
  a = _mm512_reduce_add_ps(acc);
#endif
  for (; k < g; ++k) a += v[k];
  return a;
}

// x (M, K) -> fp32 (M, kp) zero-padded, then (when sums) the sum of each group of g.
template <typename X>
void widen(const X* src, int64_t M, int64_t K, int64_t kp, int64_t g, bool sums, float* dst) {
  const int64_t groups = kp / g;
  float* s = dst + M * kp;
  for (int64_t m = 0; m < M; ++m) {
    float* row = dst + m * kp;
    for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(src[m * K + k]);
    for (int64_t k = K; k < kp; ++k) row[k] = 0.f;
    if (!sums) continue;
    for (int64_t b = 0; b < groups; ++b) s[m * groups + b] = group_sum(row + b * g, g);
  }
}

const at::Tensor& need(const c10::optional<at::Tensor>& t, const char* what, int64_t format) {
  TORCH_CHECK(t.has_value(), "quant_gemm: format ", format, " needs ", what);
  TORCH_CHECK(t->is_contiguous() && (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
              "quant_gemm: ", what, " must be a contiguous float32 or bfloat16 tensor, got ", t->scalar_type());
  return *t;
}

// One quantized weight of a call, checked against x's K: its rows N, group size g (1 for int8)
// and groups per row.
struct QWeight {
  at::Tensor data;
  c10::optional<at::Tensor> scale, offset;
  int64_t format, N, g, groups;
};

QWeight check_weight(int64_t K, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& offset, int64_t format) {
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous(), "quant_gemm: data must be a contiguous 2-D tensor");
  const int64_t N = data.size(0);
  int64_t g = 32, groups = 0;
  switch (format) {
    case kInt8:
      TORCH_CHECK(data.scalar_type() == at::kChar && data.size(1) == K, "quant_gemm: int8 data must be int8 (N, ", K, "), got ",
                  data.scalar_type(), " ", data.sizes());
      TORCH_CHECK(need(scale, "scale", format).numel() == N, "quant_gemm: int8 scale must have ", N, " values");
      g = 1, groups = 0;  // per channel: no groups, no sums
      break;
    case kInt4: {
      TORCH_CHECK(data.scalar_type() == at::kByte, "quant_gemm: int4 data must be uint8");
      const auto& s = need(scale, "scale", format);
      const auto& o = need(offset, "offset", format);
      groups = s.dim() == 2 ? s.size(1) : 0;
      TORCH_CHECK(groups > 0 && s.size(0) == N && o.sizes() == s.sizes() && o.scalar_type() == s.scalar_type(),
                  "quant_gemm: int4 scale and offset must be (N, groups) of one dtype, got ", s.sizes(), " and ", o.sizes());
      TORCH_CHECK(2 * data.size(1) % groups == 0, "quant_gemm: int4 data has ", data.size(1), " bytes per row, not whole groups of ", groups);
      g = 2 * data.size(1) / groups;
      TORCH_CHECK(g % 32 == 0, "quant_gemm: int4 group size must be a multiple of 32, got ", g);
      TORCH_CHECK(K <= groups * g && K > (groups - 1) * g, "quant_gemm: x has ", K, " features, int4 weight holds ", groups, " groups of ", g);
      break;
    }
    case kQ4_0:
    case kQ4_1:
    case kQ8_0: {
      const int64_t bytes = format == kQ4_0 ? 18 : format == kQ4_1 ? 20 : 34;
      TORCH_CHECK(data.scalar_type() == at::kByte, "quant_gemm: GGUF blocks must be uint8");
      TORCH_CHECK(K % 32 == 0 && data.size(1) == K / 32 * bytes, "quant_gemm: x has ", K, " features, blocks hold ", data.size(1) / bytes * 32);
      groups = K / 32;
      break;
    }
    default: TORCH_CHECK(false, "quant_gemm: unknown format ", format);
  }
  return {data, scale, offset, format, N, g, groups};
}

// Output rows [n0, n1) of weight w against every row of x (xs.hdr: the task's scratch).
void run_range(const QWeight& w, const Xs& xs, int64_t M, int64_t n0, int64_t n1, const Out& o) {
  const uint8_t* d = static_cast<const uint8_t*>(w.data.data_ptr());
  const int64_t rb = w.data.size(1) * w.data.element_size(), g = w.g, groups = w.groups;
  switch (w.format) {
    case kInt8:
      if (w.scale->scalar_type() == at::kFloat) run_rows(Int8Layout<float>{w.data.data_ptr<int8_t>(), w.scale->data_ptr<float>(), xs.kp}, xs, M, n0, n1, o);
      else run_rows(Int8Layout<c10::BFloat16>{w.data.data_ptr<int8_t>(), w.scale->data_ptr<c10::BFloat16>(), xs.kp}, xs, M, n0, n1, o);
      break;
    case kInt4:
      if (w.scale->scalar_type() == at::kFloat) {
        const float* s = w.scale->data_ptr<float>();
        const float* f = w.offset->data_ptr<float>();
        if (g == 32) run_rows(Int4Layout<float, 32>{d, s, f, rb, groups, g}, xs, M, n0, n1, o);
        else if (g == 64) run_rows(Int4Layout<float, 64>{d, s, f, rb, groups, g}, xs, M, n0, n1, o);
        else if (g == 128) run_rows(Int4Layout<float, 128>{d, s, f, rb, groups, g}, xs, M, n0, n1, o);
        else run_rows(Int4Layout<float, 0>{d, s, f, rb, groups, g}, xs, M, n0, n1, o);
      } else {
        run_rows(Int4Layout<c10::BFloat16, 0>{d, w.scale->data_ptr<c10::BFloat16>(), w.offset->data_ptr<c10::BFloat16>(), rb, groups, g},
                 xs, M, n0, n1, o);
      }
      break;
    case kQ4_0: run_rows(Q4_0Layout{d, rb}, xs, M, n0, n1, o); break;
    case kQ4_1: run_rows(Q4_1Layout{d, rb}, xs, M, n0, n1, o); break;
    default: run_rows(Q8_0Layout{d, rb}, xs, M, n0, n1, o); break;
  }
}

// x widened once for every weight of a call (they share format, K and group size).
struct XBuf {
  std::vector<float> buf;
  std::vector<int8_t> xq;
  std::vector<float> dxv, hw;
  Xs xs;
  int64_t M;
};

// Which x element feeds lane i (< 32) of half h (0: low nibbles, 1: high) of chunk c; -1 none.
int64_t chunk_element(const ChunkMap& cm, int64_t c, int h, int i) {
  if (cm.pair) {
    const int64_t grp = 2 * c + (i >= 16);
    return grp < cm.groups ? grp * 32 + 16 * h + (i & 15) : -1;
  }
  const int64_t gi = c / cm.per, sub = c % cm.per;
  return gi * cm.g + h * (cm.g / 2) + 32 * sub + i;
}

#if defined(NFX_Q_AVX512)
// Chunk c of the pair layout (g = 32: lanes [a 0-15, b 0-15] per half, a = group 2c, b = group
// 2c + 1, zeros when b is past the last group) rounded to int8 with its two scales: the scalar
// loop's values bit for bit (max is exact, one multiply per value, and cvtps rounds half to
// even as nearbyint does in the default rounding mode), without its per-value index arithmetic.
inline void quantize_pair_chunk(const float* row, int64_t c, bool second, int8_t* xq, float* dxv) {
  for (int h = 0; h < 2; ++h) {
    const __m512 a = _mm512_loadu_ps(row + 64 * c + 16 * h);
    const __m512 b = second ? _mm512_loadu_ps(row + 64 * c + 32 + 16 * h) : _mm512_setzero_ps();
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512 s = _mm512_set1_ps(inv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 32 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, s))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 32 * h + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, s))));
    _mm256_storeu_ps(dxv + 8 * h, _mm256_set1_ps(d));
  }
}
#endif

// The int8-activation inputs of xb's widened x (rows of kp, exact group sums after them).
void quantize_x(XBuf& xb, int64_t kp) {
  Xs& xs = xb.xs;
  ChunkMap& cm = xs.cm;
  const int64_t M = xb.M, hs = 2 * (xs.groups + 1);
  xb.xq.assign(M * 64 * cm.chunks, 0);
  xb.dxv.assign(M * 16 * cm.chunks, 0.f);
  xb.hw.assign(M * hs, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xs.x + m * kp;
#if defined(NFX_Q_AVX512)
    if (cm.pair) {
      for (int64_t c = 0; c < cm.chunks; ++c) {
        const int64_t at = m * cm.chunks + c;
        quantize_pair_chunk(row, c, 2 * c + 1 < cm.groups, xb.xq.data() + 64 * at, xb.dxv.data() + 16 * at);
      }
      for (int64_t b = 0; b < xs.groups; ++b) xb.hw[m * hs + 2 * b + 1] = xs.sums[m * xs.groups + b];
      continue;
    }
#endif
    for (int64_t c = 0; c < cm.chunks; ++c)
      for (int h = 0; h < 2; ++h) {
        float v[32], amax = 0.f;
        for (int i = 0; i < 32; ++i) {
          const int64_t e = chunk_element(cm, c, h, i);
          v[i] = e < 0 ? 0.f : row[e];
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const int64_t at = m * cm.chunks + c;
        for (int i = 0; i < 32; ++i) xb.xq[64 * at + 32 * h + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        for (int l = 0; l < 8; ++l) xb.dxv[16 * at + 8 * h + l] = d;
      }
    for (int64_t b = 0; b < xs.groups; ++b) xb.hw[m * hs + 2 * b + 1] = xs.sums[m * xs.groups + b];
  }
  xs.xq = xb.xq.data();
  xs.dxv = xb.dxv.data();
  xs.hw = xb.hw.data();
}

// x widened once for every weight of a call (they share format, K and group size); with
// int8_x and a 4-bit format of groups of 32 or a multiple of 64, also rounded to int8.
XBuf prepare(const at::Tensor& x, const std::vector<QWeight>& ws, bool int8_x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_gemm: x must be float32 or bfloat16, got ",
              x.scalar_type());
  const int64_t K = x.size(-1), M = x.numel() / K, format = ws[0].format, g = ws[0].g, groups = ws[0].groups;
  for (const auto& w : ws)
    TORCH_CHECK(w.format == format && w.g == g && w.groups == groups, "quant_gemm: the weights of one call must share format and group size");
  const int64_t kp = format == kInt8 ? K : groups * g;
  const bool four_bit = format == kInt4 || format == kQ4_0 || format == kQ4_1;
  const bool int8x = int8_x && four_bit && (g == 32 || g % 64 == 0);
#if defined(NFX_Q_AVX512)
  const bool sums = int8x;  // the float path dequantizes the 4-bit formats through the lookup table
#else
  const bool sums = four_bit;
#endif
  XBuf xb{std::vector<float>(M * kp + (sums ? M * groups : 0)), {}, {}, {}, {}, M};
  auto xc = x.contiguous();
  if (x.scalar_type() == at::kFloat) widen(xc.data_ptr<float>(), M, K, kp, g, sums, xb.buf.data());
  else widen(xc.data_ptr<c10::BFloat16>(), M, K, kp, g, sums, xb.buf.data());
  xb.xs = Xs{xb.buf.data(), sums ? xb.buf.data() + M * kp : nullptr, kp, groups, nullptr};
  if (int8x) {
    xb.xs.int8x = true;
    xb.xs.cm = g == 32 ? ChunkMap{true, g, groups, (groups + 1) / 2, 1} : ChunkMap{false, g, groups, groups * (g / 64), g / 64};
    quantize_x(xb, kp);
  }
  return xb;
}

// Per parallel task: x's view with room for 8 rows of fp32 block headers.
template <typename F>
void parallel_rows(const Xs& xs, int64_t total, int64_t grain, F f) {
  at::parallel_for(0, total, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> hdr(8 * 2 * (xs.groups + 1));
    Xs task = xs;
    task.hdr = hdr.data();
    f(task, r0, r1);
  });
}

at::Tensor out_for(const at::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options());
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "quant_gemm: x must have a non-empty last dim");
}

// x @ w_i.T (+ bias_i) for every weight of one format, K and group size, in one call and one
// parallel region (fused Q/K/V projections): x is widened once, one fork/join instead of three.
at::Tensor gemm_multi(const at::Tensor& x, at::TensorList datas, at::ArrayRef<c10::optional<at::Tensor>> scales,
                      at::ArrayRef<c10::optional<at::Tensor>> offsets, int64_t format,
                      at::ArrayRef<c10::optional<at::Tensor>> biases, bool int8_x) {
  check_x(x);
  TORCH_CHECK(!datas.empty() && scales.size() == datas.size() && offsets.size() == datas.size() && biases.size() == datas.size(),
              "quant_gemm: one scale, offset and bias (or None) per weight");
  const int64_t K = x.size(-1);
  std::vector<QWeight> ws;
  std::vector<int64_t> start = {0};
  for (size_t i = 0; i < datas.size(); ++i) {
    ws.push_back(check_weight(K, datas[i], scales[i], offsets[i], format));
    start.push_back(start.back() + ws.back().N);
  }
  // One output, the weights' columns side by side (one tensor, not a list: a C++ wrapper calls
  // an op with tensor results through the dispatcher, a list result back through Python).
  auto out = out_for(x, start.back());
  std::vector<at::Tensor> bias32(ws.size());
  std::vector<Out> os;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (biases[i].has_value()) {
      TORCH_CHECK(biases[i]->numel() == ws[i].N, "quant_gemm: bias has ", biases[i]->numel(), " values, weight has ", ws[i].N, " rows");
      bias32[i] = biases[i]->to(at::kFloat).contiguous();
    }
    char* base = static_cast<char*>(out.data_ptr()) + start[i] * out.element_size();
    os.push_back(Out{base, bf16, start.back(), bias32[i].defined() ? bias32[i].data_ptr<float>() : nullptr});
  }
  const int64_t M = x.numel() / K;
  if (M == 0 || start.back() == 0) return out;
  const XBuf xb = prepare(x, ws, int8_x);
  parallel_rows(xb.xs, start.back(), GRAIN, [&](const Xs& task, int64_t r0, int64_t r1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t n0 = std::max(r0, start[i]) - start[i], n1 = std::min(r1, start[i + 1]) - start[i];
      if (n0 < n1) run_range(ws[i], task, M, n0, n1, os[i]);
    }
  });
  return out;
}

// The op: up to three weights (data, scale, offset, bias each) as separate arguments, not lists,
// for inductor's C++ wrapper (see small_gemm_multi in small_gemm.cpp).
using OptT = c10::optional<at::Tensor>;
at::Tensor quant_gemm_multi(const at::Tensor& x, int64_t format, bool int8_x, const at::Tensor& d0, const OptT& s0,
                            const OptT& o0, const OptT& b0, const OptT& d1, const OptT& s1, const OptT& o1, const OptT& b1,
                            const OptT& d2, const OptT& s2, const OptT& o2, const OptT& b2) {
  TORCH_CHECK(d1.has_value() || !d2.has_value(), "quant_gemm_multi: d2 given without d1");
  std::vector<at::Tensor> ds = {d0};
  std::vector<OptT> ss = {s0}, os = {o0}, bs = {b0};
  if (d1.has_value()) ds.push_back(*d1), ss.push_back(s1), os.push_back(o1), bs.push_back(b1);
  if (d2.has_value()) ds.push_back(*d2), ss.push_back(s2), os.push_back(o2), bs.push_back(b2);
  return gemm_multi(x, ds, ss, os, format, bs, int8_x);
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                      const c10::optional<at::Tensor>& offset, int64_t format, const c10::optional<at::Tensor>& bias, bool int8_x) {
  std::vector<c10::optional<at::Tensor>> s = {scale}, o = {offset}, b = {bias};
  return gemm_multi(x, {data}, s, o, format, b, int8_x);
}

// SwiGLU's first half, silu(x @ gate.T) * (x @ up.T), in one call and one parallel region; the
// product is formed from the fp32 accumulators and rounded once to x's dtype (as small_glu).
at::Tensor quant_glu(const at::Tensor& x, const at::Tensor& gate, const c10::optional<at::Tensor>& gate_scale,
                     const c10::optional<at::Tensor>& gate_offset, const at::Tensor& up, const c10::optional<at::Tensor>& up_scale,
                     const c10::optional<at::Tensor>& up_offset, int64_t format, bool int8_x) {
  check_x(x);
  const int64_t K = x.size(-1), M = x.numel() / K;
  const std::vector<QWeight> ws = {check_weight(K, gate, gate_scale, gate_offset, format), check_weight(K, up, up_scale, up_offset, format)};
  const int64_t N = ws[0].N;
  TORCH_CHECK(ws[1].N == N, "quant_glu: gate has ", N, " rows, up has ", ws[1].N);
  auto out = out_for(x, N);
  if (M == 0 || N == 0) return out;
  const XBuf xb = prepare(x, ws, int8_x);
  std::vector<float> g(M * N), u(M * N);
  const Out og{g.data(), false, N, nullptr}, ou{u.data(), false, N, nullptr};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  parallel_rows(xb.xs, N, GRAIN / 2, [&](const Xs& task, int64_t n0, int64_t n1) {
    run_range(ws[0], task, M, n0, n1, og);
    run_range(ws[1], task, M, n0, n1, ou);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        const float a = g[m * N + n], v = a / (1.f + std::exp(-a)) * u[m * N + n];
        if (bf16) static_cast<c10::BFloat16*>(op)[m * N + n] = c10::BFloat16(v);
        else static_cast<float*>(op)[m * N + n] = v;
      }
  });
  return out;
}

std::string quant_isa() { return Isa::kName; }

std::string quant_int8_x_isa() {
#if defined(NFX_Q_VNNI)
  return "avx512-vnni";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) {
  m.def("quant_gemm(Tensor x, Tensor data, Tensor? scale, Tensor? offset, int format, Tensor? bias, bool int8_x=False) -> Tensor");
  m.def("quant_gemm_multi(Tensor x, int format, bool int8_x, Tensor d0, Tensor? s0, Tensor? o0, Tensor? b0, Tensor? d1, "
        "Tensor? s1, Tensor? o1, Tensor? b1, Tensor? d2, Tensor? s2, Tensor? o2, Tensor? b2) -> Tensor");
  m.def("quant_glu(Tensor x, Tensor gate, Tensor? gate_scale, Tensor? gate_offset, Tensor up, Tensor? up_scale, Tensor? up_offset, "
        "int format, bool int8_x=False) -> Tensor");
  m.def("quant_isa() -> str", &quant_isa);
  m.def("quant_int8_x_isa() -> str", &quant_int8_x_isa);
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) {
  m.impl("quant_gemm", &quant_gemm);
  m.impl("quant_gemm_multi", &quant_gemm_multi);
  m.impl("quant_glu", &quant_glu);
}

// C shims (c_shims.h) of the decode products.
NFX_SHIM(quant_gemm, AtenTensorHandle x, AtenTensorHandle data, AtenTensorHandle* scale, AtenTensorHandle* offset, int64_t format,
         AtenTensorHandle* bias, int32_t int8_x, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(quant_gemm(nfx_shim::tensor(x), nfx_shim::tensor(data), nfx_shim::optional(scale),
                                        nfx_shim::optional(offset), format, nfx_shim::optional(bias), int8_x != 0));
  });
}
NFX_SHIM(quant_gemm_multi, AtenTensorHandle x, int64_t format, int32_t int8_x, AtenTensorHandle d0, AtenTensorHandle* s0,
         AtenTensorHandle* o0, AtenTensorHandle* b0, AtenTensorHandle* d1, AtenTensorHandle* s1, AtenTensorHandle* o1,
         AtenTensorHandle* b1, AtenTensorHandle* d2, AtenTensorHandle* s2, AtenTensorHandle* o2, AtenTensorHandle* b2,
         AtenTensorHandle* ret0) {
  using nfx_shim::optional;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(quant_gemm_multi(nfx_shim::tensor(x), format, int8_x != 0, nfx_shim::tensor(d0), optional(s0), optional(o0),
                                              optional(b0), optional(d1), optional(s1), optional(o1), optional(b1), optional(d2),
                                              optional(s2), optional(o2), optional(b2)));
  });
}
NFX_SHIM(quant_glu, AtenTensorHandle x, AtenTensorHandle gate, AtenTensorHandle* gate_scale, AtenTensorHandle* gate_offset,
         AtenTensorHandle up, AtenTensorHandle* up_scale, AtenTensorHandle* up_offset, int64_t format, int32_t int8_x,
         AtenTensorHandle* ret0) {
  using nfx_shim::optional;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = nfx_shim::result(quant_glu(nfx_shim::tensor(x), nfx_shim::tensor(gate), optional(gate_scale), optional(gate_offset),
                                       nfx_shim::tensor(up), optional(up_scale), optional(up_offset), format, int8_x != 0));
  });
}
