"""C entry points of the decode step's kernel ops for inductor's C++ wrapper: with
``aot_inductor.custom_ops_to_c_shims`` set to :func:`c_shims`, a compiled part calls
``aoti_torch_cpu_<op>`` (``csrc/c_shims.h``, defined beside each kernel) directly instead of
through the dispatcher, which looked each call's op up by name and boxed its arguments
(docs/performance.md, 2026-12-07 afternoon: batch 1 1.07x). The library is reopened
``RTLD_GLOBAL`` when it loads (``library.make_symbols_global``) so that the parts find them.
"""

from __future__ import annotations

import torch

from neuronfx.graphs.kernels.library import library_name, make_symbols_global, small_gemm_available

C_SHIM_OPS = ("quant_gemm", "quant_gemm_multi", "quant_glu", "small_gemm", "small_gemm_multi", "small_glu", "cached_attention",
              "w8a8_gemm", "w8a8_packed", "w8a8_packed_multi", "w8a8_packed_glu", "w4a8_packed", "w4a8_packed_multi",
              "w4a8_packed_glu")
"""The ops of a decode step with a C entry point (``csrc/c_shims.h``): inductor's C++ wrapper
calls them directly instead of through the dispatcher. The others keep it: prefill's run once a
layer per prefill, top-k once a step, and the int8 KV cache's write, once a layer, mutates its
caches and returns nothing (a shim of another form than :func:`c_shim_declaration`'s)."""

C_SHIM_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t", "bool": "int32_t"}
"""The C type of each schema argument type a shim takes (inductor's C++ wrapper's conventions)."""


def c_shim_declaration(op: torch._ops.OpOverload) -> str:
    """The C declaration of ``op``'s shim, from its schema: ``AOTITorchError
    aoti_torch_cpu_<op>(<arguments>, AtenTensorHandle* ret0)`` (one tensor result). KeyError for
    an argument type without a C form (:data:`C_SHIM_TYPES`)."""
    schema = op._schema
    args = [f"{C_SHIM_TYPES[str(a.type)]} {a.name}" for a in schema.arguments] + ["AtenTensorHandle* ret0"]
    return f"AOTITorchError aoti_torch_cpu_{schema.name.split('::')[-1]}({', '.join(args)})"


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """{op: [its C declaration]} of :data:`C_SHIM_OPS`, inductor's
    ``aot_inductor.custom_ops_to_c_shims``; empty without the kernel library or where its symbols
    could not be made global (``library.make_symbols_global``)."""
    if not small_gemm_available() or not make_symbols_global(library_name()):
        return {}
    ops = [getattr(torch.ops.neuronfx, name).default for name in C_SHIM_OPS]
    return {op: [c_shim_declaration(op)] for op in ops}
