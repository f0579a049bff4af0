// neuronfx::store_int8_kv: K and V rows quantized to an int8 KV cache's rows and written into
// the cache in place, the cache write of every phase on the CPU kernels' ops bundle
// (graphs/kernels/bundles.py, kernel_store_kv). Inductor's own code for the same write built each
// 68-byte row (the values, then the scale's bytes, as a padded sum) in int64 index vectors: about
// ten times the bf16 cache's write, 0.8 ms of a batch-8 SmolLM2 step (docs/performance.md).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstring>

namespace {

// x (D floats, stride sx) -> dst: D int8 values round(x * (1 / absmax) * 127) clamped to
// [-127, 127] and then absmax / 127 as 4 little-endian fp32 bytes, the same operations in the
// same order as kv_rows.quantize_rows in eager torch (127 / absmax is torch's reciprocal times
// 127). A row holding a NaN has absmax NaN: values 0 (torch's float-to-int8 conversion of a NaN
// on x86) and scale NaN; an infinity: values 0 (the finite ones times 0, the infinite NaN), scale
// inf.
// Unit: the values are contiguous (sx = 1, as a K or V row's head dim is in every phase): with
// a runtime stride GCC built each vector of values one insert at a time.
template <bool Unit>
inline void quantize_row(const float* x, int64_t sx, int64_t D, int8_t* dst) {
  if constexpr (Unit) sx = 1;
  float amax = 0.f;
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) {
    const float v = x[d * sx];
    nan |= std::isnan(v);
    amax = std::max(amax, std::fabs(v));
  }
  if (nan) amax = NAN;  // torch's amax propagates NaN
  const float inv = amax > 0.f ? (1.f / amax) * 127.f : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float q = std::nearbyint(x[d * sx] * inv);  // round half to even, as torch.round
    dst[d] = std::isnan(q) ? 0 : static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  const float scale = amax / 127.f;
  std::memcpy(dst + D, &scale, sizeof(float));
}

// The checks of one cache and its rows: cache (num_blocks, H_kv, block_size, D + 4) int8, last
// dim contiguous; x (B, T, H_kv, D) float32 / bfloat16 / float16, any strides.
void check_rows(const at::Tensor& cache, const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "store_int8_kv: rows must be float32, bfloat16 or float16, not ", x.scalar_type());
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.dim() == 4 && cache.stride(3) == 1,
              "store_int8_kv: a cache must be an int8 (num_blocks, H_kv, block_size, D + 4) tensor with a contiguous last dim");
  TORCH_CHECK(x.dim() == 4 && x.size(2) == cache.size(1) && x.size(3) + 4 == cache.size(3) && x.size(0) == blocks.size(0) &&
                  x.size(1) == blocks.size(1),
              "store_int8_kv: rows must be (B, T, H_kv, D): blocks' (B, T), the cache's H_kv and D = its row width - 4");
}

// Fetches the cache lines rows (B, T, H, D) go to (bp, op: (B, T) int64, checked) for writing.
// Always inlined: GCC 12 deletes a call that only prefetches, finding it free of side effects.
__attribute__((always_inline)) inline void prefetch_rows(const at::Tensor& cache, const at::Tensor& x, const int64_t* bp,
                                                         const int64_t* op) {
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3);
  const int8_t* cp = cache.data_ptr<int8_t>();
  for (int64_t bt = 0; bt < x.size(0) * T; ++bt)
    for (int64_t h = 0; h < H; ++h) {
      const int8_t* dst = cp + bp[bt] * cache.stride(0) + h * cache.stride(1) + op[bt] * cache.stride(2);
      __builtin_prefetch(dst, 1, 3);
      __builtin_prefetch(dst + D + 3, 1, 3);  // the row's last byte: its second line
    }
}

// Rows (b, t, h) of x into cache[blocks[b, t], h, offsets[b, t]] (bp, op: (B, T) int64, checked).
void write_rows(at::Tensor& cache, const at::Tensor& x, const int64_t* bp, const int64_t* op) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3), rows = x.size(0) * T * H;
  const float* xp = xf.data_ptr<float>();
  int8_t* cp = cache.data_ptr<int8_t>();
  const int64_t x0 = xf.stride(0), x1 = xf.stride(1), x2 = xf.stride(2), x3 = xf.stride(3);
  const int64_t c0 = cache.stride(0), c1 = cache.stride(1), c2 = cache.stride(2);
  // a decode step's few rows run inline (below the grain: no fork); a prefill's spread
  at::parallel_for(0, rows, 1024, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bt = r / H, h = r % H, b = bt / T, t = bt % T;
      const float* row = xp + b * x0 + t * x1 + h * x2;
      int8_t* dst = cp + bp[bt] * c0 + h * c1 + op[bt] * c2;
      if (x3 == 1) quantize_row<true>(row, 1, D, dst);
      else quantize_row<false>(row, x3, D, dst);
    }
  });
}

// K and V rows k, v (B, T, H_kv, D) into the int8 caches k_cache, v_cache (num_blocks, H_kv,
// block_size, D + 4), row (b, t, h) at [blocks[b, t], h, offsets[b, t]]; blocks and offsets
// (B, T) int64. One call for both: a custom op call from a compiled graph costs a few us.
void store_int8_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& blocks,
                   const at::Tensor& offsets) {
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && blocks.dim() == 2 &&
                  blocks.sizes() == offsets.sizes(),
              "store_int8_kv: blocks and offsets must be (B, T) int64");
  check_rows(k_cache, k, blocks);
  check_rows(v_cache, v, blocks);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "store_int8_kv: k_cache and v_cache must have one shape");
  const at::Tensor bl = blocks.contiguous(), of = offsets.contiguous();
  const int64_t* bp = bl.data_ptr<int64_t>();
  const int64_t* op = of.data_ptr<int64_t>();
  const int64_t nb = k_cache.size(0), bs = k_cache.size(2);
  for (int64_t i = 0; i < bl.numel(); ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < nb && op[i] >= 0 && op[i] < bs, "store_int8_kv: block ", bp[i], " offset ", op[i],
                " outside the caches' ", nb, " blocks of ", bs);
  // A decode step's K and V lines fetched all at once before the first store: each store waited
  // for its own line otherwise (48 rows of batch 8 in 18 us; they lie in memory since the last
  // step). A prefill's many rows are written as they come.
  if (bl.numel() * k.size(2) <= 256) {
    prefetch_rows(k_cache, k, bp, op);
    prefetch_rows(v_cache, v, bp, op);
  }
  write_rows(k_cache, k, bp, op);
  write_rows(v_cache, v, bp, op);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) {
  m.def("store_int8_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor blocks, Tensor offsets) -> ()");
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) { m.impl("store_int8_kv", &store_int8_kv); }
