// Prefill attention under the causal mask: the T new tokens of each row attend themselves (token
// i sees tokens 0..i), grouped-query heads as HF's repeat_kv (query head h reads KV head
// h / (H / H_kv)), scale 1 / sqrt(D) as SDPA's default.
//
// One task per (row, query head, tile of 8 query rows); the tiles at or past a row's length
// (pad tokens after a shorter prompt) are not computed. A tile's scores cover the keys up to its
// last row only (the causal triangle, to the next 32 keys), in three passes over a score buffer
// that stays in cache: the scores, 8 rows against 32 keys per step from keys transposed once per
// (row, KV head); then each row's max, exp and sum; then the weighted sum of the values, 8 rows
// against 32 value columns per step. torch's CPU flash attention (SDPA with is_causal) runs its
// score and value products as BLAS calls on blocks of 32 queries x 512 keys and computes whole
// blocks past the diagonal (docs/performance.md, prefill attention).
// Included after small_gemm.cpp (unit_dense.cpp): the ISA macros, exp8 and hsum come from there.

#include "exp16.h"

namespace {

constexpr int64_t kCausalRows = 8;   // query rows per tile
constexpr int64_t kCausalKeys = 32;  // keys per step of the score pass


// The keys (T, D) of one (row, KV head), position stride ks, transposed in blocks of 32 keys:
// kt[(j / 32) * D * 32 + d * 32 + j % 32] = k_j[d], zero past T (Tp a multiple of 32). A block
// is one contiguous (D, 32) stream, 32 keys' values of one d two vector loads (rows of the whole
// (D, Tp) transpose lay 4 KB apart at 1,024 keys, all in one L1 set).
void transpose_keys(const float* k, int64_t ks, int64_t T, int64_t D, int64_t Tp, float* kt) {
  for (int64_t j0 = 0; j0 < Tp; j0 += kCausalKeys)
    for (int64_t d = 0; d < D; ++d) {
      float* dst = kt + j0 * D + d * kCausalKeys;
      for (int64_t j = 0; j < kCausalKeys; ++j) dst[j] = j0 + j < T ? k[(j0 + j) * ks + d] : 0.f;
    }
}

// s[r * ld + j] = qs[r] . k_j for the 8 rows of qs (8, D) and keys j < n (n a multiple of 32).
void tile_scores(const float* qs, const float* kt, int64_t D, int64_t n, float* s, int64_t ld) {
#ifdef NFX_ATTN_AVX512
  for (int64_t j0 = 0; j0 < n; j0 += kCausalKeys) {
    const float* block = kt + j0 * D;
    __m512 acc[kCausalRows][2];
#pragma GCC unroll 8
    for (int r = 0; r < kCausalRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k0 = _mm512_loadu_ps(block + d * kCausalKeys), k1 = _mm512_loadu_ps(block + d * kCausalKeys + 16);
#pragma GCC unroll 8
      for (int r = 0; r < kCausalRows; ++r) {
        const __m512 qb = _mm512_set1_ps(qs[r * D + d]);
        acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kCausalRows; ++r) {
      _mm512_storeu_ps(s + r * ld + j0, acc[r][0]);
      _mm512_storeu_ps(s + r * ld + j0 + 16, acc[r][1]);
    }
  }
#elif defined(NFX_AVX2)
  // 4 rows x 16 keys per pass: 8 accumulators of AVX2's 16 registers
  for (int64_t j0 = 0; j0 < n; j0 += kCausalKeys) {
    const float* block = kt + j0 * D;
    for (int64_t half = 0; half < kCausalKeys; half += 16)
      for (int64_t r0 = 0; r0 < kCausalRows; r0 += 4) {
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m256 k0 = _mm256_loadu_ps(block + d * kCausalKeys + half), k1 = _mm256_loadu_ps(block + d * kCausalKeys + half + 8);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            const __m256 qb = _mm256_set1_ps(qs[(r0 + r) * D + d]);
            acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          _mm256_storeu_ps(s + (r0 + r) * ld + j0 + half, acc[r][0]);
          _mm256_storeu_ps(s + (r0 + r) * ld + j0 + half + 8, acc[r][1]);
        }
      }
  }
#else
  for (int64_t r = 0; r < kCausalRows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a += qs[r * D + d] * kt[(j / kCausalKeys) * kCausalKeys * D + d * kCausalKeys + j % kCausalKeys];
      s[r * ld + j] = a;
    }
#endif
}

// Row i's scores s[0..i] (of n in the buffer) -> their softmax weights before normalising,
// zeros for the keys after i; returns 1 / their sum. A NaN score, or +inf (inf - inf), makes the
// row NaN as SDPA's softmax does: exp's clamp at -87 would turn a NaN into a tiny weight, so NaN
// differences are kept as they are (-inf scores get exp(-87), about 1e-38, where SDPA has 0).
float causal_weights(float* s, int64_t i, int64_t n) {
  const int64_t len = i + 1;
  float sum = 0.f;
  int64_t j = 0;
#ifdef NFX_ATTN_AVX512
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  if (j < len)
    vmax = _mm512_mask_max_ps(vmax, static_cast<__mmask16>((1u << (len - j)) - 1), vmax, _mm512_loadu_ps(s + j));
  j = 0;
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= len; j += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(s + j), m);
    const __m512 p = _mm512_mask_mov_ps(exp16(d), _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), d);
    _mm512_storeu_ps(s + j, p);
    acc = _mm512_add_ps(acc, p);
  }
  if (j < len) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - j)) - 1);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m);
    const __m512 p = _mm512_maskz_mov_ps(tail, _mm512_mask_mov_ps(exp16(d), _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), d));
    _mm512_storeu_ps(s + j, p);  // zeros past i within these 16
    acc = _mm512_add_ps(acc, p);
    j += 16;
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(NFX_AVX2)
  // lanes at or past len: -inf for the max, weight 0 (exp8 of -inf is a tiny positive, not 0)
  const __m256 lanes = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f), minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 vmax = minus_inf;
  for (; j < len; j += 8) {
    const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps(static_cast<float>(len - j)), _CMP_LT_OQ);
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + j), valid));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))));
  __m256 acc = _mm256_setzero_ps();
  for (j = 0; j < len; j += 8) {
    const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps(static_cast<float>(len - j)), _CMP_LT_OQ);
    const __m256 d = _mm256_sub_ps(_mm256_blendv_ps(m, _mm256_loadu_ps(s + j), valid), m);
    const __m256 p = _mm256_and_ps(valid, _mm256_blendv_ps(exp8(d), d, _mm256_cmp_ps(d, d, _CMP_UNORD_Q)));
    _mm256_storeu_ps(s + j, p);  // zeros past i within these 8
    acc = _mm256_add_ps(acc, p);
  }
  sum = hsum(acc);
#else
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
  for (; j < len; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
#endif
  for (; j < n; ++j) s[j] = 0.f;
  return 1.f / sum;
}

// out[r * os + :D] = inv[r] * sum_{j < n} p[r * ld + j] v_j for r < rows (v_j at v + j * vs).
void tile_values_scalar(const float* p, int64_t ld, const float* v, int64_t vs, int64_t n, int64_t D, const float* inv,
                        float* out, int64_t os, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) {
      float a = 0.f;
      for (int64_t j = 0; j < n; ++j) a += p[r * ld + j] * v[j * vs + d];
      out[r * os + d] = a * inv[r];
    }
}

// tile_values_scalar's result, in vector tiles where the ISA has them.
void tile_values(const float* p, int64_t ld, const float* v, int64_t vs, int64_t n, int64_t D, const float* inv,
                 float* out, int64_t os, int64_t rows) {
#ifdef NFX_ATTN_AVX512
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int64_t w = std::min<int64_t>(32, D - d0);
    const __mmask16 m0 = static_cast<__mmask16>(w >= 16 ? 0xFFFF : (1u << w) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(w >= 32 ? 0xFFFF : w <= 16 ? 0 : (1u << (w - 16)) - 1);
    __m512 acc[kCausalRows][2];
#pragma GCC unroll 8
    for (int r = 0; r < kCausalRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * vs + d0;
      const __m512 v0 = _mm512_maskz_loadu_ps(m0, vj), v1 = _mm512_maskz_loadu_ps(m1, vj + 16);
#pragma GCC unroll 8
      for (int r = 0; r < kCausalRows; ++r) {
        const __m512 pb = _mm512_set1_ps(p[r * ld + j]);
        acc[r][0] = _mm512_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    // every row through a fixed-size buffer: a store loop bounded by ``rows`` made GCC keep the
    // accumulators on the stack (a spill and reload per FMA)
    alignas(64) float res[kCausalRows][32];
#pragma GCC unroll 8
    for (int r = 0; r < kCausalRows; ++r) {
      const __m512 scale = _mm512_set1_ps(inv[r]);
      _mm512_store_ps(res[r], _mm512_mul_ps(acc[r][0], scale));
      _mm512_store_ps(res[r] + 16, _mm512_mul_ps(acc[r][1], scale));
    }
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_mask_storeu_ps(out + r * os + d0, m0, _mm512_load_ps(res[r]));
      _mm512_mask_storeu_ps(out + r * os + d0 + 16, m1, _mm512_load_ps(res[r] + 16));
    }
  }
#elif defined(NFX_AVX2)
  if (D % 16 != 0) return tile_values_scalar(p, ld, v, vs, n, D, inv, out, os, rows);
  // 4 rows x 16 columns per pass, results through a fixed-size buffer as above
  for (int64_t d0 = 0; d0 < D; d0 += 16)
    for (int64_t r0 = 0; r0 < kCausalRows; r0 += 4) {
      __m256 acc[4][2];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v + j * vs + d0), v1 = _mm256_loadu_ps(v + j * vs + d0 + 8);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const __m256 pb = _mm256_set1_ps(p[(r0 + r) * ld + j]);
          acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
        }
      }
      alignas(32) float res[4][16];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 scale = _mm256_set1_ps(inv[r0 + r]);
        _mm256_store_ps(res[r], _mm256_mul_ps(acc[r][0], scale));
        _mm256_store_ps(res[r] + 8, _mm256_mul_ps(acc[r][1], scale));
      }
      for (int64_t r = 0; r < 4 && r0 + r < rows; ++r) std::memcpy(out + (r0 + r) * os + d0, res[r], sizeof(res[r]));
    }
#else
  tile_values_scalar(p, ld, v, vs, n, D, inv, out, os, rows);
#endif
}

// q (B, H, T, D), k and v (B, H_kv, T, D) float32, any strides but a contiguous last dim;
// lengths (B,) int32 / int64 or none: row b's tokens from lengths[b] on (pads after a shorter
// prompt) are not computed and come out as zeros -> (B, H, T, D) float32, a view of a
// (B, T, H, D) tensor (the layout the output projection reads).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& lengths) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k and v must be 4-D (B, heads, T, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "causal_attention: q, k and v must be float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == D,
              "causal_attention: k and v must be (B, H_kv, T, D) = (", B, ", H_kv, ", T, ", ", D, "), got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "causal_attention: ", H, " query heads over ", Hkv, " KV heads");
  std::vector<int64_t> len(B, T);
  if (lengths.has_value()) {
    const auto& l = *lengths;
    TORCH_CHECK(l.dim() == 1 && l.size(0) == B && (l.scalar_type() == at::kInt || l.scalar_type() == at::kLong),
                "causal_attention: lengths must be int32 or int64 of shape (", B, "), got ", l.scalar_type(), " ", l.sizes());
    const auto lc = l.to(at::kLong).contiguous();
    for (int64_t b = 0; b < B; ++b) len[b] = std::clamp<int64_t>(lc.data_ptr<int64_t>()[b], 0, T);
  }
  auto out = at::empty({B, T, H, D}, q.options());
  if (B * H * T * D == 0) return out.transpose(1, 2);
  const auto qc = q.stride(3) == 1 ? q : q.contiguous();
  const auto kc = k.stride(3) == 1 ? k : k.contiguous();
  const auto vc = v.stride(3) == 1 ? v : v.contiguous();
  const int64_t Tp = (T + kCausalKeys - 1) / kCausalKeys * kCausalKeys, group = H / Hkv;
  auto keys_t = at::empty({B * Hkv, D, Tp}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const int64_t qs0 = qc.stride(0), qs1 = qc.stride(1), qs2 = qc.stride(2), vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  float *ktp = keys_t.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      transpose_keys(kp + (i / Hkv) * kc.stride(0) + (i % Hkv) * kc.stride(1), kc.stride(2), T, D, Tp, ktp + i * D * Tp);
  });
  // Tasks in (row, head) order, each head's tiles in the order 0, last, 1, last - 1, ...; each
  // thread runs one contiguous range of equal estimated work (a tile's keys; rows differ in
  // length), so a head's keys and values stay in one core's cache (every head's costliest tiles
  // first, taken from a shared counter, lost that and ran slower at 8 rows of 128).
  const int64_t tiles = (T + kCausalRows - 1) / kCausalRows, total = B * H * tiles;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto tile_start = [&](int64_t i) {
    const int64_t nth = i % tiles;
    return (nth % 2 == 0 ? nth / 2 : tiles - 1 - nth / 2) * kCausalRows;
  };
  auto live_rows = [&](int64_t i) {  // the tile's rows before its row's length
    return std::max<int64_t>(0, std::min(kCausalRows, len[i / tiles / H] - tile_start(i)));
  };
  std::vector<double> work(total + 1, 0.0);  // work[i]: the estimated work of tasks before i
  for (int64_t i = 0; i < total; ++i) {
    const int64_t live = live_rows(i);
    work[i + 1] = work[i] + (live > 0 ? static_cast<double>(tile_start(i) + live + 16) : 1.0);
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  auto range_start = [&](int64_t c) {
    if (c >= threads) return total;
    return static_cast<int64_t>(std::lower_bound(work.begin(), work.end() - 1, work[total] * c / threads) - work.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t c0, int64_t c1) {
    // score rows 16 floats longer than Tp: rows a multiple of 4 KB apart share one L1 set
    const int64_t ld = Tp + 16;
    std::vector<float> qs(kCausalRows * D), s(kCausalRows * ld), inv(kCausalRows);
    for (int64_t i = range_start(c0); i < range_start(c1); ++i) {
      const int64_t bh = i / tiles, b = bh / H, h = bh % H, kvh = h / group, t0 = tile_start(i), live = live_rows(i);
      float* o = op + (b * T + t0) * H * D + h * D;
      for (int64_t r = live; r < std::min(kCausalRows, T - t0); ++r) std::fill(o + r * H * D, o + r * H * D + D, 0.f);
      if (live == 0) continue;
      const int64_t rows = live, keys = t0 + rows;  // keys 0..t0 + rows - 1
      const float* qrow = qp + b * qs0 + h * qs1 + t0 * qs2;
      for (int64_t r = 0; r < kCausalRows; ++r)
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = r < rows ? qrow[r * qs2 + d] * scale : 0.f;
      const int64_t n = (keys + kCausalKeys - 1) / kCausalKeys * kCausalKeys;
      tile_scores(qs.data(), ktp + (b * Hkv + kvh) * D * Tp, D, n, s.data(), ld);
      for (int64_t r = 0; r < kCausalRows; ++r) {
        if (r < rows) {
          inv[r] = causal_weights(s.data() + r * ld, t0 + r, keys);
        } else {
          std::fill(s.begin() + r * ld, s.begin() + r * ld + keys, 0.f);
          inv[r] = 0.f;
        }
      }
      tile_values(s.data(), ld, vp + b * vs0 + kvh * vs1, vs2, keys, D, inv.data(), o, H * D, rows);
    }
  });
  return out.transpose(1, 2);
}

std::string causal_attention_isa() {
#ifdef NFX_ATTN_AVX512
  return "avx512";
#elif defined(NFX_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, Tensor? lengths=None) -> Tensor");
  m.def("causal_attention_isa() -> str", &causal_attention_isa);
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) { m.impl("causal_attention", &causal_attention); }
