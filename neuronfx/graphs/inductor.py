"""The inductor backend's graphs: compiled with torch's precompile API, saved and loaded without
re-tracing.

Each part of a (phase, batch, bucket) graph (prologue, one layer group reused for every group,
epilogue) is compiled with ``torch.compile(fullgraph=True, dynamic=False).aot_compile`` on its
first call: the result is an ``AOTCompiledFunction`` that ``save_compiled_function`` writes to a
file and ``torch.compiler.load_compiled_function`` reads back with no dynamo tracing and no
inductor lowering. The kernels it calls are C++ libraries in inductor's cache directory, so each
runtime compiles inside a private copy of that directory (``compiled_dir``), which saved runtimes
and compile-cache entries ship (``inductor/``). Weights and KV cache stay inputs (KV mutated in
place), shared by all graphs. The graph math gets :func:`neuronfx.graphs.ops.cpu_kernel_ops`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

from neuronfx.config.attention import layer_period
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.errors import ArtifactError
from neuronfx.graphs.inputs import KVCache, example_inputs
from neuronfx.graphs.kernels import small_gemm_available
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.ops import cpu_kernel_ops
from neuronfx.graphs.phases import GraphModule, PhaseParts, build_module, phase_num_layers

PART_NAMES = ("prologue", "layers", "epilogue")
INDUCTOR_DIR = "inductor"
_SKIPPED_SUFFIXES = (".lock", ".pyc")  # inductor's lock files and bytecode are not shipped

MAX_LAYER_GROUP = 10
"""Layers per compiled call: bigger groups cut per-call overhead (about 0.2 ms each), smaller
ones cut compile time (it grows with the traced graph)."""


def layer_group_size(num_layers: int, limit: int = MAX_LAYER_GROUP, period: int = 1) -> int:
    """Largest divisor of ``num_layers`` that is a multiple of ``period`` (the layers' structure
    repeats every ``period`` layers, ``config.attention.layer_period``) and not above ``limit``
    unless ``period`` is (SmolLM2's 30 layers -> 10)."""
    return max(d for d in range(period, max(min(num_layers, limit), period) + 1, period) if num_layers % d == 0)


class PrecompiledPart:
    """One graph part: compiled ahead of time on its first call (with that call's arguments as
    the example), or given an already compiled (loaded) function."""

    def __init__(self, fn: Callable | None, compiled: Callable | None = None):
        self.fn = fn
        self.compiled = compiled

    def __call__(self, *args: torch.Tensor) -> object:
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, fullgraph=True, dynamic=False).aot_compile((args, {}))
        return self.compiled(*args)


def private_dir(source: Path | None = None) -> Path:
    """A new private inductor cache directory (a copy of ``source`` when given): inductor writes
    into its cache while it works, so shared copies (artifacts, cache entries) stay read-only."""
    target = Path(tempfile.mkdtemp(prefix="neuronfx-inductor-"))
    if source is not None:
        shutil.copytree(source, target, dirs_exist_ok=True)
    return target


def build_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache) -> GraphModule:
    """Compile one (phase, batch, bucket) graph now: one run on the template ``kv`` (call it
    inside the runtime's private cache directory, see :func:`in_dir`)."""
    n = phase_num_layers(plan, spec.phase)
    group = layer_group_size(n, period=layer_period(plan.model, n))
    graph = build_module(plan, spec, cpu_kernel_ops(plan.inference.dtype), group_size=group, wrap=PrecompiledPart)
    with torch.no_grad():
        graph(weights, kv, example_inputs(plan, spec))
    return graph


def in_dir(directory: Path, fn: Callable, *args: object) -> object:
    """``fn(*args)`` with inductor's cache directory set to ``directory``."""
    with temporary_cache_dir(str(directory)):
        return fn(*args)


def part_files(spec: GraphSpec) -> list[str]:
    """Relative file names of a graph's three parts."""
    return [f"precompiled/{spec.phase}-b{spec.batch_size}-t{spec.bucket}-{name}.bin" for name in PART_NAMES]


def _parts(graph: object) -> tuple[PrecompiledPart, ...]:
    """The compiled parts of a graph this backend built; ArtifactError for any other graph."""
    if not isinstance(graph, GraphModule) or not isinstance(graph.parts.prologue, PrecompiledPart):
        raise ArtifactError("this inductor runtime was not built by neuronfx.compile (no precompiled parts); compile it with neuronfx.compile.")
    return graph.parts.prologue, graph.parts.layers, graph.parts.epilogue


def _tree_files(directory: Path, prefix: str) -> list[str]:
    return sorted(
        f"{prefix}/{p.relative_to(directory).as_posix()}" for p in directory.rglob("*")
        if p.is_file() and not p.name.endswith(_SKIPPED_SUFFIXES) and "__pycache__" not in p.parts
    )


def save(plan: Plan, graphs: Mapping[tuple, object], compiled_dir: str | None, out: Path) -> list[str]:
    """Write every graph's compiled parts and the runtime's kernel directory under ``out``;
    returns their relative names. Raises ArtifactError when the compiled files are gone or the
    graphs were not built by this backend."""
    if compiled_dir is None or not Path(compiled_dir).is_dir():
        raise ArtifactError(
            f"this inductor runtime's compiled files ({compiled_dir!r}) are gone; compile it again "
            "with neuronfx.compile and save that runtime."
        )
    parts = {key: _parts(graph) for key, graph in graphs.items()}  # all checked before anything is written
    (out / "precompiled").mkdir(parents=True, exist_ok=True)
    names = []
    for spec in plan.graphs:
        for name, part in zip(part_files(spec), parts[spec.key]):
            part.compiled.save_compiled_function(str(out / name))
            names.append(name)
    shutil.copytree(compiled_dir, out / INDUCTOR_DIR, dirs_exist_ok=True,
                    ignore=lambda _d, found: [n for n in found if n.endswith(_SKIPPED_SUFFIXES) or n == "__pycache__"])
    return names + _tree_files(out / INDUCTOR_DIR, INDUCTOR_DIR)


def load_graph(plan: Plan, spec: GraphSpec, src: Path) -> GraphModule:
    """The graph from its saved parts (inductor's cache directory must hold its kernels, or they
    are compiled again from the saved source)."""
    small_gemm_available()  # compiled code may call neuronfx's custom ops: register them first
    fns = []
    for name in part_files(spec):
        with open(src / name, "rb") as f:
            fns.append(PrecompiledPart(None, torch.compiler.load_compiled_function(f)))
    layers = phase_num_layers(plan, spec.phase)
    group = layer_group_size(layers, period=layer_period(plan.model, layers))
    parts = PhaseParts(prologue=fns[0], layers=fns[1], epilogue=fns[2], group_size=group)
    return GraphModule(parts, spec.phase, layers)
