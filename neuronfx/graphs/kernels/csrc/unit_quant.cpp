// One of the kernel library's two translation units (see unit_dense.cpp). quant_gemm.cpp and
// quant_prefill.cpp each define their own Format and check_weight: they stay in separate units.
#include "quant_gemm.cpp"
#include "w8a8_gemm.cpp"
