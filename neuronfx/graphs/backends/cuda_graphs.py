"""CUDA graphs: each (phase, batch, bucket) graph of a CUDA inductor plan captured once and replayed.

A compiled decode step is a few hundred small kernels; launched one by one from Python, the GPU
waits on the host between them. A CUDA graph records the whole step once and replays it with
one launch (vLLM ``vllm/v1/worker/gpu/cudagraph_utils.py`` captures one per batch size; gpt-fast
compiles ``decode_one_token`` with ``mode="reduce-overhead"``). neuronfx's graphs are static in
shape per (phase, batch, bucket) already, so each is captured as it is, with:

- static input buffers: one device tensor per field of the step-input record, which a replay's
  inputs are copied into (device to device; ``runtime/batch.call_graph`` has already moved the
  host record to the device without waiting);
- the weights and the KV cache as the captured addresses: the KV cache is updated in place by
  the replay, as by any call. A capture is valid for the KV tensors it was captured with: a call
  with another KV cache (another State from ``init_state``) runs the step once as a plain call
  and captures again for that cache (a few ms per graph, once per state; alternating two states
  re-captures at every switch);
- outputs copied out (``clone``) after each replay, before the next replay overwrites them.

Warm-up and the first capture happen at compile time, under the compile's progress bar
(:func:`capturing`); all graphs of a runtime share one memory pool (they never run at once, and
their outputs are copied out). Only single-rank CUDA plans are captured: under tensor
parallelism the nccl collectives run outside graphs. ``NEURONFX_CUDA_GRAPHS=0`` turns capture
off (the compiled graphs then run as plain calls), e.g. to tell a capture problem from a
compile problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from neuronfx.config.inference_checks import is_cuda
from neuronfx.config.inputs import from_leaves, leaves
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.errors import ConfigError
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.phases.device import device_scope
from neuronfx.graphs.phases.inputs import KVCache, empty_kv, example_inputs

Tensor = torch.Tensor
ENV_VAR = "NEURONFX_CUDA_GRAPHS"


def enabled() -> bool:
    """``$NEURONFX_CUDA_GRAPHS``: unset or "1" on, "0" off; ConfigError for anything else."""
    value = os.environ.get(ENV_VAR, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ConfigError(f"{ENV_VAR}={value!r} must be 1 (capture CUDA graphs, the default) or 0 (plain calls).")
    return value == "1"


def uses_cuda_graphs(plan: Plan) -> bool:
    """Whether the inductor backend captures ``plan``'s graphs: a CUDA plan of one rank, with
    :func:`enabled`."""
    return is_cuda(plan.inference.device) and plan.tp_degree == 1 and enabled()


def kv_key(weights: Weights, kv: KVCache) -> tuple[int, ...]:
    """What a capture baked in: the weights' identity and every K and V tensor's address."""
    return (id(weights), *(t.data_ptr() for layer in kv for t in layer))


class CapturedGraph:
    """One (phase, batch, bucket) graph replayed as a CUDA graph; called like the graph it wraps:
    ``graph(weights, kv, inputs) -> {name: tensor}`` with ``inputs`` on the plan's device.

    ``graph`` is the wrapped (compiled) graph, ``spec`` its GraphSpec, ``pool`` the memory pool
    shared by the runtime's captures (``torch.cuda.graph_pool_handle()``)."""

    def __init__(self, plan: Plan, spec: GraphSpec, graph: Callable, pool: object):
        self.plan = plan
        self.spec = spec
        self.graph = graph
        self.pool = pool
        self.key: tuple[int, ...] | None = None
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        self.static: list[Tensor] = []
        self.outputs: Mapping[str, Tensor] = {}

    def __call__(self, weights: Weights, kv: KVCache, inputs: object) -> dict[str, Tensor]:
        if kv_key(weights, kv) != self.key:
            return self.capture(weights, kv, inputs)
        for buffer, value in zip(self.static, leaves(inputs)):
            buffer.copy_(value, non_blocking=True)
        self.cuda_graph.replay()  # type: ignore[union-attr]
        return _copied(self.outputs)

    def capture(self, weights: Weights, kv: KVCache, inputs: object) -> dict[str, Tensor]:
        """Run the step once as a plain call on a side stream (its outputs are this call's; it
        also warms up lazy initialisation: cuBLAS handles, Triton's first launches), then
        capture it for ``kv``. Re-running a step writes the same K/V at the same positions, so
        the capture (which records, and runs nothing) leaves the cache as the plain call did."""
        with torch.no_grad(), device_scope(self.plan):  # streams, graph and pool of the plan's GPU
            static = [t.clone() for t in leaves(inputs)]
            record = from_leaves(self.spec.record, static)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                result = _copied(self.graph(weights, kv, record))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.graph(weights, kv, record)
        self.cuda_graph, self.static, self.outputs, self.key = graph, static, outputs, kv_key(weights, kv)
        return result


def _copied(outputs: Mapping[str, object]) -> dict[str, object]:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in outputs.items()}


def capturing(builder: Callable[[Plan, GraphSpec, Weights, KVCache], Callable]) -> Callable[..., CapturedGraph]:
    """``builder(plan, spec, weights, kv) -> graph`` (the inductor backend's, which compiles and
    runs the graph once on the template ``kv``) followed by the graph's first capture on that
    ``kv``, so warm-up and capture happen inside the compile and its progress bar. One memory
    pool per builder (per runtime)."""
    pool = torch.cuda.graph_pool_handle()

    def build(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache) -> CapturedGraph:
        captured = CapturedGraph(plan, spec, builder(plan, spec, weights, kv), pool)
        captured.capture(weights, kv, example_inputs(plan, spec))
        return captured

    return build


def capture_all(plan: Plan, graphs: Mapping[tuple, Callable], weights: Weights) -> dict[tuple, Callable]:
    """Loaded graphs (a saved runtime, a compile-cache entry) captured on a template KV cache."""
    pool = torch.cuda.graph_pool_handle()
    kv = empty_kv(plan)
    out = {}
    for spec in plan.graphs:
        out[spec.key] = CapturedGraph(plan, spec, graphs[spec.key], pool)
        out[spec.key].capture(weights, kv, example_inputs(plan, spec))
    return out


def unwrap(graph: object) -> object:
    """The compiled graph inside a :class:`CapturedGraph` (what is saved); others as they are."""
    return graph.graph if isinstance(graph, CapturedGraph) else graph
