// One of the kernel library's two translation units (library.py BUILD_UNITS): torch's headers
// are parsed once per unit instead of once per source. Measured 2026-12-06 on a 2-core AMD EPYC
// (AVX2), ninja -j4: 26.7 s and 45 CPU s as two units, 35.8 s and 70 CPU s as five.
#include "small_gemm.cpp"
#include "causal_attention.cpp"  // after small_gemm.cpp, whose ISA macros it reads
#include "quant_prefill.cpp"
#include "topk.cpp"
#include "kv_write.cpp"
