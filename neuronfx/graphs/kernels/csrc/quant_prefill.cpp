// Quantized-weight products for prefill (many rows of x): out = x @ dequantize(w).T (+ bias) in
// fp32, tile by tile. Prefill is bound by arithmetic, which torch's blocked fp32 GEMM does best,
// but dequantizing the whole weight first (what a graph of torch ops does) writes and re-reads
// 4 bytes per weight from memory, costing as much as the GEMM itself at 128 rows. Here a tile
// of weight rows (about 1 MiB of fp32) is dequantized into a buffer that stays in cache and
// multiplied at once (at::mm_out into the tile's columns of out), so no full-size float copy of
// the weight ever exists. Layouts as quant_gemm.cpp (graphs/models/quant.py); the values are
// exactly quant.dequantize's, so the result equals F.linear(x, dequantize(w)) up to the GEMM's
// summation order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum Format : int64_t { kInt8 = 0, kInt4 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 4 };
constexpr int64_t kTileBytes = 1 << 20;  // fp32 bytes of one dequantized tile: fits a core's L2
constexpr int64_t kWholeRows = 2048;     // from this many rows of x on, one tile holds the whole weight

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

struct Weight {
  int64_t format, N, K, row_bytes, g;  // g: int4's group size
  const uint8_t* data;
  const at::Tensor* scale;
  const at::Tensor* offset;
};

template <typename S>
inline const S* ptr(const at::Tensor* t) { return t->data_ptr<S>(); }

// 32 weights of one GGUF block: 16 bytes of nibbles (element j low, j + 16 high) or 32 int8.
inline void block(const uint8_t* b, int64_t format, float* w) {
  const float d = half_at(b);
  if (format == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = q[j] * d;
    return;
  }
  const float o = format == kQ4_1 ? half_at(b + 2) : -8.0f * d;
  const uint8_t* q = b + (format == kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) w[j] = (q[j] & 0x0F) * d + o;
  for (int j = 0; j < 16; ++j) w[j + 16] = (q[j] >> 4) * d + o;
}

// int4 row n: per group of g, byte j holds element j (low nibble) and j + g/2 (high).
template <typename S>
void int4_row(const Weight& w, int64_t n, float* dst) {
  const int64_t groups = w.scale->size(1), half = w.g / 2;
  const S* sc = ptr<S>(w.scale) + n * groups;
  const S* of = ptr<S>(w.offset) + n * groups;
  const uint8_t* r = w.data + n * w.row_bytes;
  float tmp[256];
  for (int64_t gi = 0; gi < groups; ++gi) {
    const float s = static_cast<float>(sc[gi]), o = static_cast<float>(of[gi]);
    const uint8_t* q = r + gi * half;
    const int64_t k0 = gi * w.g;
    float* out = k0 + w.g <= w.K ? dst + k0 : tmp;  // the last group may hold K's padding
    for (int64_t j = 0; j < half; ++j) out[j] = (q[j] & 0x0F) * s + o;
    for (int64_t j = 0; j < half; ++j) out[j + half] = (q[j] >> 4) * s + o;
    if (out == tmp && k0 < w.K) std::memcpy(dst + k0, tmp, (w.K - k0) * sizeof(float));
  }
}

template <typename S>
void int8_row(const Weight& w, int64_t n, float* dst) {
  const int8_t* q = reinterpret_cast<const int8_t*>(w.data + n * w.row_bytes);
  const float s = static_cast<float>(ptr<S>(w.scale)[n]);
  for (int64_t k = 0; k < w.K; ++k) dst[k] = q[k] * s;
}

// Row n of the weight, its first K values, into dst (fp32).
void dequant_row(const Weight& w, int64_t n, float* dst) {
  const bool f32 = w.scale != nullptr && w.scale->scalar_type() == at::kFloat;
  if (w.format == kInt8) return f32 ? int8_row<float>(w, n, dst) : int8_row<c10::BFloat16>(w, n, dst);
  if (w.format == kInt4) return f32 ? int4_row<float>(w, n, dst) : int4_row<c10::BFloat16>(w, n, dst);
  const uint8_t* r = w.data + n * w.row_bytes;
  const int64_t bytes = w.format == kQ4_1 ? 20 : w.format == kQ4_0 ? 18 : 34;
  for (int64_t b = 0; b < w.K / 32; ++b) block(r + b * bytes, w.format, dst + b * 32);
}

// The weight's layout checked against x's K (as quant_gemm.cpp's check_weight, with int4 groups
// of any even size up to 256): a mismatch would read past a tensor or give a silent wrong answer.
Weight check_weight(int64_t K, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                    const c10::optional<at::Tensor>& offset, int64_t format) {
  TORCH_CHECK(data.is_contiguous() && data.dim() == 2, "quant_prefill: data must be a contiguous 2-D tensor");
  TORCH_CHECK(format >= kInt8 && format <= kQ8_0, "quant_prefill: unknown format ", format);
  TORCH_CHECK(data.scalar_type() == (format == kInt8 ? at::kChar : at::kByte), "quant_prefill: format ", format,
              " needs ", format == kInt8 ? "int8" : "uint8", " data, got ", data.scalar_type());
  const int64_t N = data.size(0);
  Weight w{format, N, K, data.size(1), 0, static_cast<const uint8_t*>(data.data_ptr()), nullptr, nullptr};
  if (format == kInt8 || format == kInt4) {
    TORCH_CHECK(scale.has_value(), "quant_prefill: int8 and int4 need a scale");
    TORCH_CHECK(scale->is_contiguous() && (scale->scalar_type() == at::kFloat || scale->scalar_type() == at::kBFloat16),
                "quant_prefill: scale must be a contiguous float32 or bfloat16 tensor, got ", scale->scalar_type());
    w.scale = &*scale;
  }
  if (format == kInt8) {
    TORCH_CHECK(scale->numel() == N, "quant_prefill: int8 needs one scale per row: ", N, ", got ", scale->numel());
    TORCH_CHECK(data.size(1) == K, "quant_prefill: int8 data has ", data.size(1), " columns, x has K = ", K);
  } else if (format == kInt4) {
    TORCH_CHECK(offset.has_value(), "quant_prefill: int4 needs an offset");
    const int64_t groups = scale->dim() == 2 ? scale->size(1) : 0;
    TORCH_CHECK(groups > 0 && scale->size(0) == N && offset->sizes() == scale->sizes() && offset->is_contiguous() &&
                    offset->scalar_type() == scale->scalar_type(),
                "quant_prefill: int4 scale and offset must be contiguous (N, groups) of one dtype, got ", scale->sizes(), " and ",
                offset->sizes());
    w.g = 2 * data.size(1) / groups;
    TORCH_CHECK(w.g * groups == 2 * data.size(1) && w.g <= 256 && w.g % 2 == 0 && K <= w.g * groups && K > w.g * (groups - 1),
                "quant_prefill: x has K = ", K, ", the int4 weight holds ", groups, " groups of ", w.g);
    w.offset = &*offset;
  } else {
    const int64_t bytes = format == kQ4_1 ? 20 : format == kQ4_0 ? 18 : 34;
    TORCH_CHECK(K % 32 == 0 && data.size(1) == K / 32 * bytes, "quant_prefill: blocks do not match K = ", K);
  }
  return w;
}

at::Tensor quant_prefill(const at::Tensor& x, const at::Tensor& data, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& offset, int64_t format, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_prefill: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "quant_prefill: x must have a non-empty last dim");
  const int64_t K = x.size(-1);
  const Weight w = check_weight(K, data, scale, offset, format);
  const int64_t N = w.N;
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->numel() == N), "quant_prefill: bias must be 1-D of ", N, " values (the weight's rows), got ",
              bias ? bias->sizes() : at::IntArrayRef{});
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor out = at::empty({M, N}, x.options());  // a tile's columns: rows of stride N, what BLAS's ldc takes
  // Past kWholeRows rows of x the conversion is a small share of the GEMM, and narrow tiles cost
  // the GEMM more than it saves (measured: 10-20% slower than one whole tile at 8192 rows).
  const int64_t tile = M >= kWholeRows ? N : std::max<int64_t>(16, kTileBytes / (4 * std::max<int64_t>(K, 1)) / 16 * 16);
  at::Tensor buf = at::empty({std::min(tile, N), K}, x.options());
  float* bp = buf.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nt = std::min(tile, N - n0);
    at::parallel_for(0, nt, 8, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) dequant_row(w, n0 + i, bp + i * K);
    });
    at::Tensor cols = out.narrow(1, n0, nt);
    at::mm_out(cols, x2, buf.narrow(0, 0, nt).t());
  }
  if (bias) out.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) {
  m.def("quant_prefill(Tensor x, Tensor data, Tensor? scale, Tensor? offset, int format, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) {
  m.impl("quant_prefill", &quant_prefill);
}
