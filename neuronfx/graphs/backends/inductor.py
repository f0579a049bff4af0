"""The inductor backend: graphs compiled with torch's precompile API, saved and loaded without
re-tracing.

Each part of a (phase, batch, bucket) graph (prologue, one layer group reused for every group,
epilogue) is compiled with ``torch.compile(fullgraph=True, dynamic=False).aot_compile`` on its
first call (``inductor_parts.py``): the result is an ``AOTCompiledFunction`` that
``save_compiled_function`` writes to a file and ``torch.compiler.load_compiled_function`` reads
back with no dynamo tracing and no inductor lowering. The kernels it calls are C++ libraries in
inductor's cache directory, so each runtime compiles inside a private copy of that directory
(``compiled_dir``), which saved runtimes and compile-cache entries ship (``inductor_dir.py``).

What a cold compile costs, and what cuts it: Python (dynamo, AOT, inductor's lowering and code
generation, about 1.3 s per traced layer) and one C++ compiler run per distinct generated kernel
(about 1-1.5 CPU s each, most of it loading the precompiled header and linking). So the layer
group and the epilogue are compiled once per (phase, batch) with the bucket's dimension dynamic
and shared by the graphs of every bucket (``inductor_parts.BUCKET_DIMS``; the runtime still sees
one graph per (phase, batch, bucket)), prefill traces fewer layers per call than decode
(``inductor_parts.PREFILL_LAYER_GROUP``), the one-off compiler runs start early (the kernel
library during the checkpoint load, the vector-ISA probes and precompiled header while it
builds: ``warm_up.py``), and idle cores compile whole (phase, batch) units in worker processes
(``compile_workers.py``). Weights and KV cache stay inputs (KV mutated in place), shared by all
graphs. The graph math gets ``kernels.bundles.compiled_ops`` (the CPU kernels on a CPU, torch
ops and Triton on CUDA, where ``cuda_graphs.py`` captures each built graph as a CUDA graph); a
CPU plan on one rank gets inductor's C++ wrapper (``inductor_parts.inductor_options``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from neuronfx.config.plan import Plan
from neuronfx.errors import ArtifactError
from neuronfx.graphs.backends import compile_workers, cuda_graphs, inductor_dir, inductor_parts, warm_up
from neuronfx.graphs.backends.records import Backend, Built, progress_bar
from neuronfx.graphs.kernels.activation_choice import pack_weights, plan_int8_paths
from neuronfx.graphs.kernels.gemm_choice import widen_16bit_prefill
from neuronfx.graphs.kernels.library import small_gemm_available
from neuronfx.graphs.models.layers import Weights


def build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    """Compile every graph of ``plan`` in a new private kernel directory, starting from a copy of
    the kernel store ``kernels`` (when it exists) and adding to it the kernels compiled here."""
    warm_up.prepare_graphs(plan.inference.device)
    directory = inductor_dir.private_dir(kernels if kernels is not None and kernels.is_dir() else None)
    builder = functools.partial(inductor_parts.build_graph, shared={})  # the buckets of a phase share compiled parts
    if cuda_graphs.uses_cuda_graphs(plan):
        builder = cuda_graphs.capturing(builder)  # capture each graph as it is built, under the bar
    graphs, seconds = compile_workers.build(plan, weights, directory, builder, functools.partial(progress_bar, plan, progress))
    if kernels is not None:
        inductor_dir.publish_kernels(directory, kernels)
    return Built(graphs=graphs, seconds=seconds, compiled_dir=str(directory))


def load(plan: Plan, weights: Weights, src: Path) -> Built:
    """Every graph of ``plan`` from what :func:`save` wrote under ``src``, in a private copy of
    its kernel directory."""
    warm_up.prepare_graphs(plan.inference.device)  # the kernel ops the loaded graphs call, the ISA probes their loading needs
    directory = inductor_dir.private_dir(src / inductor_dir.INDUCTOR_DIR)
    graphs, seconds = {}, {}
    for spec in plan.graphs:
        t0 = time.perf_counter()
        graphs[spec.key] = inductor_dir.in_dir(directory, inductor_parts.load_graph, plan, spec, src)
        seconds[spec.key] = time.perf_counter() - t0
    if cuda_graphs.uses_cuda_graphs(plan):
        graphs = cuda_graphs.capture_all(plan, graphs, weights)
    return Built(graphs=graphs, seconds=seconds, compiled_dir=str(directory))


def save(plan: Plan, graphs: Mapping[tuple, object], compiled_dir: str | None, out: Path) -> list[str]:
    """Write every graph's compiled parts and the runtime's kernel directory under ``out``;
    returns their relative names. Raises ArtifactError when the compiled files are gone or the
    graphs were not built by this backend."""
    if compiled_dir is None or not Path(compiled_dir).is_dir():
        raise ArtifactError(
            f"this inductor runtime's compiled files ({compiled_dir!r}) are gone; compile it again "
            "with neuronfx.compile and save that runtime."
        )
    for graph in graphs.values():
        inductor_parts.compiled_parts(graph)  # all checked before anything is written
    names = [name for spec in plan.graphs for name in inductor_parts.save_parts(spec, graphs[spec.key], out)]
    return names + inductor_dir.ship(compiled_dir, out)


def choices(plan: Plan) -> dict[str, object]:
    """torch's intra-op thread count (inductor's generated C++ is compiled for it and its
    compiled functions guard on it: they refuse to run under another), and the 16-bit prefill
    path of a 16-bit CPU plan (``kernels.bundles.cpu_kernel_ops``), measured once per machine
    (``kernels/gemm_choice.py``; none on CUDA, where no CPU kernel is bound), and the products
    that take int8 activations under ``activation_format="auto"`` (``kernels/activation_choice.py``),
    and on CPU whether neuronfx's kernel library loaded (graphs built with it link its C shims
    and do not load in a process without it, ``NEURONFX_KERNELS=0``)."""
    out: dict[str, object] = {"num_threads": torch.get_num_threads()}
    if plan.inference.device == "cpu":
        out["kernels"] = small_gemm_available()
    dtype = plan.inference.dtype
    if dtype != "float32" and plan.inference.device == "cpu":
        out["widen_16bit"] = widen_16bit_prefill(dtype)
    if plan.inference.activation_format == "auto" and plan.inference.device == "cpu":
        out["int8_activations"] = plan_int8_paths(plan).describe()
    return out


INDUCTOR = Backend(name="inductor", check=compile_workers.check_env, build=build, save=save, load=load, cached=True,
                   prepare=warm_up.start_warm_up, choices=choices, prepare_weights=pack_weights)
