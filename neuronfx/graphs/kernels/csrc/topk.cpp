// The k largest values of each row of a (B, V) fp32 matrix, sorted descending, with their
// indices: the sampler's top-k over the vocabulary (neuronfx/graphs/phases/sampling.py).
//
// torch.topk sorts a partial selection per row; here a row is scanned once against the k-th best
// value so far (a heap of k), 16 values per compare where AVX-512 is there: past the first few
// thousand logits almost none beats it, so the scan runs at memory speed. Order: larger first,
// NaN above every number (as torch.topk), equal values by lower index.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>
#if defined(__AVX512F__)
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

// One row x (V) -> vals, idx (k), k <= V. The heap's front is the worst item kept; a later value
// (a higher index) enters only when strictly better, so ties keep the lower index.
void row_topk(const float* x, int64_t V, int64_t k, float* vals, int64_t* idx) {
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronfx, m) { m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(neuronfx, CPU, m) { m.impl("topk_rows", &topk_rows); }
