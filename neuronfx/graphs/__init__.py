"""Model math, per-phase graph functions, the kernels they bind and the backends that compile
them, as four subpackages ranked one way (``tests/test_layers.py`` enforces it):

- ``models``: one flat file per HF ``model_type``, the family registry lookup, shared layer
  math, the MoE MLP, quantized weight records and the ops bundle's type;
- ``phases``: the phase graph functions (prologue, layer groups, epilogue), the records they
  hand each other, the in-graph sampler, the graph-boundary tensors (KV cache, trace example
  inputs), device placement and the collectives of tensor parallelism;
- ``kernels``: the ops bundles, the C++ kernel library and the 16-bit product choice;
- ``backends``: the backend table and each backend (eager, export, inductor with its compile
  workers and CUDA graphs, neuron).

models < phases, kernels < backends: each imports only those before it; phases and kernels
never import each other (a backend hands the kernels to the math as ``Ops``).
"""
