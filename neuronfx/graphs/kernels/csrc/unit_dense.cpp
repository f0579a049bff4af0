// One of the kernel library's two translation units (library.py BUILD_UNITS): torch's headers
// are parsed once per unit instead of once per source. Measured 2026-12-06 on a 2-core AMD EPYC
// (AVX2): the library built in 23 s and 40 CPU s as two units, 40 s and 70 CPU s as five.
#include "small_gemm.cpp"
#include "quant_prefill.cpp"
#include "topk.cpp"
