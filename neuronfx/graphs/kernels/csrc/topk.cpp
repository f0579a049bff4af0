// The k largest values of each row of a (B, V) fp32 matrix, sorted descending, with their
// indices: the sampler's top-k over the vocabulary (neuronfx/graphs/phases/sampling.py).
//
// torch.topk sorts a partial selection per row. Here (row_topk) the maximum of each chunk of 64
// values gives a bound: the k-th largest of the chunk maxima has k values at or above it, so
// every value of the k best is at or above it (or NaN). One pass takes the chunk maxima, one the
// few values that pass the bound, and only those are selected and sorted. The heap of k this
// replaces (each row scanned against the k-th best so far) took 43 us for one row at the
// sampler's k = 256 over SmolLM2's 49,152 logits, nearly all of it in heap updates while the
// bound rose, and 0.42 ms for a batch of 8 on 2 threads (2026-12-07). Order: larger first, NaN above every number
// (as torch.topk), equal values by lower index: a strict total order, so the k best are one set
// whichever way they are found, and the outputs are those of the heap.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

struct Item {
  float v;
  int64_t i;
};

// Whether a comes before b in the output.
inline bool before(const Item& a, const Item& b) {
  const bool an = std::isnan(a.v), bn = std::isnan(b.v);
  if (an != bn) return an;
  if (!an && a.v != b.v) return a.v > b.v;
  return a.i < b.i;
}

// One row x (V) -> vals, idx (k), k <= V, scanned once against the k-th best so far (a heap of
// k), 16 values per compare where AVX-512 is: for a small k (the top logprobs' 20) the bound
// rises within the first few hundred values and one pass is all (9.6 us a row against chunk
// maxima's 11.0), and for rows too short for chunk_bound.
__attribute__((noinline)) void heap_topk(const float* x, int64_t V, int64_t k, float* vals, int64_t* idx) {
  std::vector<Item> heap(k);
  for (int64_t i = 0; i < k; ++i) heap[i] = {x[i], i};
  std::make_heap(heap.begin(), heap.end(), before);
  auto offer = [&](int64_t i) {
    const Item item{x[i], i};
    if (!before(item, heap.front())) return;
    std::pop_heap(heap.begin(), heap.end(), before);
    heap.back() = item;
    std::push_heap(heap.begin(), heap.end(), before);
  };
  int64_t i = k;
#if defined(__AVX512F__)
  for (; i + 16 <= V; i += 16) {
    // not (x <= worst): greater, or NaN on either side; the scalar test decides those
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(heap.front().v), _CMP_NLE_UQ);
    while (m) {
      offer(i + __builtin_ctz(m));
      m &= m - 1;
    }
  }
#endif
  for (; i < V; ++i) offer(i);
  std::sort_heap(heap.begin(), heap.end(), before);
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = heap[j].v;
    idx[j] = heap[j].i;
  }
}

constexpr int64_t CHUNK = 64;
constexpr int64_t HEAP_MAX_K = 32;  // k up to this: heap_topk

// The largest non-NaN value of x[0, n) (-inf for none): max_ps returns its second operand when
// either is NaN, so the running maximum goes second and NaN passes over.
inline float chunk_max(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(x + i), acc);
  m = _mm512_reduce_max_ps(acc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (; i < n; ++i)
    if (x[i] > m) m = x[i];
  return m;
}

// A value t with at least k values of x at or above it: the k-th largest of the maxima of x's
// chunks of CHUNK (k distinct chunks each hold one), for V / CHUNK >= k.
float chunk_bound(const float* x, int64_t V, int64_t k) {
  std::vector<float> maxima((V + CHUNK - 1) / CHUNK);
  for (size_t c = 0; c < maxima.size(); ++c) maxima[c] = chunk_max(x + c * CHUNK, std::min<int64_t>(CHUNK, V - c * CHUNK));
  std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
  return maxima[k - 1];
}

// One row x (V) -> vals, idx (k), k <= V: the values at or above chunk_bound and the NaNs, then
// the k best of them sorted (see the file's head).
void row_topk(const float* x, int64_t V, int64_t k, float* vals, int64_t* idx) {
  if (k <= HEAP_MAX_K || V / CHUNK < k) return heap_topk(x, V, k, vals, idx);
  const float t = chunk_bound(x, V, k);
  std::vector<Item> kept;
  kept.reserve(4 * k);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (const __m512 bound = _mm512_set1_ps(t); i + 16 <= V; i += 16) {
    // not (x < t): at or above the bound, or NaN
    for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), bound, _CMP_NLT_UQ); m; m &= m - 1) {
      const int64_t j = i + __builtin_ctz(m);
      kept.push_back({x[j], j});
    }
  }
#elif defined(__AVX2__)
  for (const __m256 bound = _mm256_set1_ps(t); i + 8 <= V; i += 8) {
    for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), bound, _CMP_NLT_UQ)); m; m &= m - 1) {
      const int64_t j = i + __builtin_ctz(m);
      kept.push_back({x[j], j});
    }
  }
#endif
  for (; i < V; ++i)
    if (!(x[i] < t)) kept.push_back({x[i], i});
  // at least k kept: k values at or above t
  std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
  std::sort(kept.begin(), kept.begin() + k, before);
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = kept[j].v;
    idx[j] = kept[j].i;
  }
}

// x (B, V) float32 -> (values (B, k) float32 sorted descending, indices (B, k) int64).
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "topk_rows: x must be (B, V) float32");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_rows: k = ", k, " must be in [1, ", V, "]");
  auto xc = x.contiguous();
  auto vals = at::empty({B, k}, x.options());
  auto idx = at::empty({B, k}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) row_topk(xp + b * V, V, k, vp + b * k, ip + b * k);
  });
  return {vals, idx};
}

// One row x (V >= 1) -> its argmax as torch.argmax takes it (the first index of the largest
// value; the first NaN's where there is one: NaN ranks above every number) and whether every
// value is finite, in one pass: each lane keeps its first index of its largest value (a strict
// greater-than; 16 lanes on AVX-512, 8 on AVX2, rows under 32 / 16 values scalar), then the
// lanes' ties go to the lowest index. Inductor's fused argmax and isfinite over a verify pass's
// 5 x 49,152 logits took 0.36 ms (an OpenMP region per row, an index per lane carried through a
// generic reduction); this, 0.054 ms (2 threads, 2026-12-07).
void row_argmax(const float* x, int64_t V, int32_t* arg, bool* finite) {
  float best = x[0];
  int64_t at = 0, i = 1;
  bool nan = std::isnan(x[0]), fin = std::isfinite(x[0]);
#if defined(__AVX512F__)
  if (V >= 32) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512 top = _mm512_loadu_ps(x);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), lane = idx;
    __mmask16 odd = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(_mm512_abs_ps(top), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    for (i = 16; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      lane = _mm512_add_epi32(lane, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, gt, v);
      idx = _mm512_mask_mov_epi32(idx, gt, lane);
      odd |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    }
    alignas(64) float tops[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(tops, top);
    _mm512_store_si512(ids, idx);
    best = tops[0], at = ids[0];
    for (int l = 1; l < 16; ++l)
      if (tops[l] > best || (tops[l] == best && ids[l] < at)) best = tops[l], at = ids[l];
    // a NaN or an infinity in the lanes: the scalar pass below settles the row (rare)
    nan = false, fin = odd == 0;
    if (!fin) i = V;
  }
#elif defined(__AVX2__)
  if (V >= 16) {
    const __m256i step = _mm256_set1_epi32(8);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), inf = _mm256_set1_ps(INFINITY);
    __m256 top = _mm256_loadu_ps(x);
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lane = idx;
    // not (|v| < inf): NaN or an infinity
    __m256 odd = _mm256_cmp_ps(_mm256_and_ps(top, magnitude), inf, _CMP_NLT_UQ);
    for (i = 8; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      lane = _mm256_add_epi32(lane, step);
      const __m256 gt = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
      top = _mm256_blendv_ps(top, v, gt);
      idx = _mm256_blendv_epi8(idx, lane, _mm256_castps_si256(gt));
      odd = _mm256_or_ps(odd, _mm256_cmp_ps(_mm256_and_ps(v, magnitude), inf, _CMP_NLT_UQ));
    }
    alignas(32) float tops[8];
    alignas(32) int32_t ids[8];
    _mm256_store_ps(tops, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ids), idx);
    best = tops[0], at = ids[0];
    for (int l = 1; l < 8; ++l)
      if (tops[l] > best || (tops[l] == best && ids[l] < at)) best = tops[l], at = ids[l];
    nan = false, fin = _mm256_movemask_ps(odd) == 0;
    if (!fin) i = V;
  }
#endif
  if (!fin && i == V) {  // the vector pass saw a NaN or an infinity: the whole row in scalar order
    best = x[0], at = 0, nan = std::isnan(x[0]);
    for (i = 1; i < V; ++i) {
      if (nan) break;
      if (std::isnan(x[i])) nan = true, at = i;
      else if (x[i] > best) best = x[i], at = i;
    }
    *arg = static_cast<int32_t>(at);
    *finite = false;
    return;
  }
  for (; i < V; ++i) {  // the tail (or a short row) after the lanes
    fin &= std::isfinite(x[i]);
    if (nan) continue;
    if (std::isnan(x[i])) nan = true, at = i;
    else if (x[i] > best) best = x[i], at = i;
  }
  *arg = static_cast<int32_t>(at);
  *finite = fin;
}

// x (N, V) float32, V >= 1 -> (argmax (N,) int32, finite (N,) bool): row_argmax of each row.
std::tuple<at::Tensor, at::Tensor> argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "argmax_rows: x must be (N, V) float32, got ", x.sizes(), " ",
              x.scalar_type(), "; pass the logits as float32 rows");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V >= 1 && V < (int64_t{1} << 31), "argmax_rows: V = ", V, " must be in [1, 2^31)");
  auto xc = x.contiguous();
  auto arg = at::empty({N}, x.options().dtype(at::kInt));
  auto finite = at::empty({N}, x.options().dtype(at::kBool));
  const float* xp = xc.data_ptr<float>();
  int32_t* ap = arg.data_ptr<int32_t>();
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row_argmax(xp + r * V, V, ap + r, fp + r);
  });
  return {arg, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) {
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor x) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) {
  m.impl("topk_rows", &topk_rows);
  m.impl("argmax_rows", &argmax_rows);
}
