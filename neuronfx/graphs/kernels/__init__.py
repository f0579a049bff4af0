"""The kernels a compiled graph binds: the ops bundles (``bundles.py``: plain torch reference
ops, the CPU kernel ops, the CUDA ops), the C++ kernel library and its op wrappers
(``library.py``, sources in ``csrc/``) and the measured choice of the 16-bit prefill product
(``gemm_choice.py``). Ranked above ``graphs.models`` and ``graphs.phases``; the backends import
these, never the other way round.
"""
