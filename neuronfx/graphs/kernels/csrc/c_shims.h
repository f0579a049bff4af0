// C entry points of the decode-path ops for inductor's C++ wrapper (custom_ops_to_c_shims,
// declared from the ops' schemas by c_shims.py): the compiled part calls the kernel
// directly instead of through the dispatcher, which per call looked the op up by name, boxed its
// arguments into IValues and made a handle per tensor (about a third of a batch-1 step's
// mallocs, measured with perf on SmolLM2, 2026-12-07). A shim's name is aoti_torch_cpu_<op>,
// its arguments the schema's: Tensor a handle, Tensor? a pointer to one (null: None), int
// int64_t, bool int32_t, the result written to *ret0. A kernel's exception becomes an error code.
#pragma once
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

namespace nfx_shim {
inline const at::Tensor& tensor(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }
inline c10::optional<at::Tensor> optional(AtenTensorHandle* h) {
  return h ? c10::optional<at::Tensor>(tensor(*h)) : c10::nullopt;
}
inline AtenTensorHandle result(at::Tensor t) { return torch::aot_inductor::new_tensor_handle(std::move(t)); }
}  // namespace nfx_shim

#define NFX_SHIM(op, ...) extern "C" AOTITorchError aoti_torch_cpu_##op(__VA_ARGS__)
