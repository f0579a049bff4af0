"""Per-phase graph functions (prefill, decode, speculate, draft, chunk) as prologue, layer groups
and epilogue, the records those parts hand each other (``records.py``), the in-graph sampler
(``sampling.py``), the tensors at the graph boundary (``inputs.py``: the KV cache, trace example
inputs), device placement (``device.py``) and the collectives of tensor parallelism
(``collectives.py``). Ranked above ``graphs.models``, below ``graphs.kernels`` and
``graphs.backends``: phases take an ops bundle, never build one.
"""
