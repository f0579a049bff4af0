"""The inductor backend's graphs: compiled with torch's precompile API, saved and loaded without
re-tracing.

Each part of a (phase, batch, bucket) graph (prologue, one layer group reused for every group,
epilogue) is compiled with ``torch.compile(fullgraph=True, dynamic=False).aot_compile`` on its
first call: the result is an ``AOTCompiledFunction`` that ``save_compiled_function`` writes to a
file and ``torch.compiler.load_compiled_function`` reads back with no dynamo tracing and no
inductor lowering. The kernels it calls are C++ libraries in inductor's cache directory, so each
runtime compiles inside a private copy of that directory (``compiled_dir``), which saved runtimes
and compile-cache entries ship (``inductor/``).

What a cold compile costs, and what cuts it: Python (dynamo, AOT, inductor's lowering and code
generation, about 1.3 s per traced layer) and one C++ compiler run per distinct generated kernel
(about 1-1.5 CPU s each, most of it loading the precompiled header and linking). So the layer
group and the epilogue are compiled once per (phase, batch) with the bucket's dimension dynamic
and shared by the graphs of every bucket (:data:`BUCKET_DIMS`; the runtime still sees one graph
per (phase, batch, bucket)), prefill traces fewer layers per call than decode
(:data:`PREFILL_LAYER_GROUP`), the one-off compiler runs start early (the kernel library
during the checkpoint load, :func:`start_warm_up`; the vector-ISA probes and precompiled header
while it builds, :func:`prepare_graphs`), and idle cores
compile whole (phase, batch) units in worker processes (``graphs/compile_workers.py``). Weights and KV cache stay inputs (KV mutated in
place), shared by all graphs. The graph math gets :func:`neuronfx.graphs.ops.compiled_ops`
(the CPU kernels on a CPU, torch ops and Triton on CUDA, where ``graphs/cuda_graphs.py``
captures each built graph as a CUDA graph); a CPU plan on one rank gets inductor's C++ wrapper
(:func:`inductor_options`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from neuronfx.config.attention import layer_period
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.errors import ArtifactError
from neuronfx.graphs.cuda_graphs import unwrap
from neuronfx.graphs.device import device_scope
from neuronfx.graphs.inputs import KVCache, example_inputs
from neuronfx.graphs.kernels import small_gemm_available
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.ops import compiled_ops
from neuronfx.graphs.phases import (
    GraphModule,
    PhaseParts,
    build_module,
    chunk_layers,
    decode_epilogue,
    decode_layers,
    draft_epilogue,
    phase_num_layers,
    prefill_epilogue,
    prefill_layers,
    speculate_epilogue,
)

PART_NAMES = ("prologue", "layers", "epilogue")
INDUCTOR_DIR = "inductor"
_SKIPPED_SUFFIXES = (".lock", ".pyc")  # inductor's lock files and bytecode are not shipped

MAX_LAYER_GROUP = 10
"""Layers per compiled decode-type call: bigger groups cut per-call overhead (about 50 us each,
a fifth of it guards), smaller ones cut compile time (about 1.3 s of Python per traced layer,
SmolLM2: the generated kernels repeat per layer and are deduplicated only after codegen)."""
PREFILL_LAYER_GROUP = 5
"""Layers per compiled prefill call, at most: half the decode group. Prefill's per-call overhead
is nothing against its hundreds of milliseconds, but buffers are not reused across calls and
layer boundaries are not fused; measured on SmolLM2 (fp32, one thread, 128 / 256 tokens, CPU ms
per step, min of 24): groups of 10: 355 / 708, 5: 355 / 710, 3: 355 / 717, 1: 367 / 737, while
the prefill compile (both buckets) took 23.6, 13.2, 10.2 and 7.4 CPU seconds."""


def layer_group_size(num_layers: int, limit: int = MAX_LAYER_GROUP, period: int = 1) -> int:
    """Largest divisor of ``num_layers`` that is a multiple of ``period`` (the layers' structure
    repeats every ``period`` layers, ``config.attention.layer_period``) and not above ``limit``
    unless ``period`` is (SmolLM2's 30 layers -> 10)."""
    return max(d for d in range(period, max(min(num_layers, limit), period) + 1, period) if num_layers % d == 0)


def phase_group_size(plan: Plan, phase: str) -> int:
    """Layers per compiled call of ``phase``'s graphs (:data:`PREFILL_LAYER_GROUP` for prefill
    and chunk, whose calls are long enough that their overhead does not count,
    :data:`MAX_LAYER_GROUP` at most for the others)."""
    n = phase_num_layers(plan, phase)
    limit = PREFILL_LAYER_GROUP if phase in ("prefill", "chunk") else MAX_LAYER_GROUP
    return layer_group_size(n, limit, period=layer_period(plan.model, n))


BUCKET_DIMS: dict[Callable, tuple[tuple[int, int], ...]] = {
    prefill_layers: ((2, 1), (3, 3), (4, 3), (6, 3), (6, 4)),  # h (B, T, hidden), cos/sin (R, B, 1, T, D), mask (M, B, 1, T, T)
    prefill_epilogue: ((2, 1),),  # h (B, T, hidden)
    decode_layers: ((7, 4),),  # mask (M, B, 1, T, S)
    chunk_layers: ((8, 4),),  # mask (M, B, 1, T, S); T is the chunk size in every chunk graph
    decode_epilogue: (),
    speculate_epilogue: (),
    draft_epilogue: (),
}
"""The parts one compile serves for every bucket of a (phase, batch): (argument, dim) of each
bucket-sized dimension of their arguments, compiled as a dynamic size. Prologues are compiled
per bucket (they build the bucket's masks from its length). Under tensor parallelism every part
is compiled per bucket (sequence-parallel prefill writes ``bucket`` positions of a padded T)."""

BACKED_PARTS = (chunk_layers,)
"""Parts whose one bucket dim is compiled backed (duck-sized), not unbacked: the chunk layers
call SDPA on the slot's window, and SDPA guards on its key length (``Eq(S, 0)``), which an
unbacked size cannot answer. The cost: the bucket equal to the KV length gets a version of its
own (see :class:`SharedCompile`)."""


INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
"""Inductor options of every part: no size, stride, alignment or scalar checks in the generated
wrapper. Each is a Python call per buffer per step (a SmolLM2 decode layer had about 15), and
what they check (that the kernels' fake implementations give the real shapes, which
tests/test_kernels.py checks) cannot change between calls of a static-shape graph."""


def inductor_options(plan: Plan) -> dict:
    """:data:`INDUCTOR_OPTIONS`, and for a CPU plan on one rank a C++ wrapper (``cpp_wrapper``):
    the part's kernel calls and buffer handling run as compiled C++ instead of a Python
    function, and the ``neuronfx::`` ops are called through the dispatcher (each returns
    tensors, not lists, so none calls back into Python). A SmolLM2 Q4_1 decode step was 1.05x
    and 1.06x faster with it at batch 1 and 1.01x at batch 8 (in-process A/Bs of 10 rounds,
    ``scripts/bench_cpp_wrapper.py``); a cold compile took about as long (51.9 s against 51.5 s).
    CUDA plans keep the Python wrapper their CUDA-graph capture was written against, and
    tensor-parallel plans too: the C++ wrapper cannot call the functional collectives (torch
    2.13: "arg type Any is not yet supported by custom_op_wrapper")."""
    return INDUCTOR_OPTIONS | {"cpp_wrapper": plan.inference.device == "cpu" and plan.tp_degree == 1}


def _aot_compile(fn: Callable, args: tuple, options: dict) -> Callable:
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options).aot_compile((args, {}))


class SharedCompile:
    """The compiled versions of one part that the buckets of a (phase, batch) share: a bucket
    reuses the first version whose guards accept its arguments, else compiles one more (with
    the bucket dims ``dims`` dynamic). One version is the rule; more appear where a shape
    guard splits the buckets, e.g. a product switching to ``small_gemm`` at 8 rows or less."""

    def __init__(self, dims: tuple[tuple[int, int], ...], backed: bool = False, options: dict | None = None):
        self.dims = dims
        self.backed = backed  # mark even a single dim backed (BACKED_PARTS)
        self.options = INDUCTOR_OPTIONS if options is None else options
        self.versions: list = []

    def compiled_for(self, fn: Callable, args: tuple) -> Callable:
        for version in self.versions:
            if version.guard_check(*args):
                return version
        # One bucket dim (decode's S) is marked unbacked: no size of it is special to the trace,
        # where a backed one guards S != the KV length (the slice would be the whole cache) and
        # the last bucket would need a version of its own. Several dims (prefill's T in h, RoPE
        # and mask) must stay one symbol, which only backed (duck-sized) dims are. Either way a
        # hint, not a demand: a dim the trace must specialise stays static, and the guards send
        # the other buckets to a version of their own.
        unbacked = len(self.dims) == 1 and not self.backed
        mark = torch._dynamo.decorators.mark_unbacked if unbacked else torch._dynamo.maybe_mark_dynamic
        for index, dim in self.dims:
            mark(args[index], dim)
        self.versions.append(_aot_compile(fn, args, self.options))
        return self.versions[-1]


class PrecompiledPart:
    """One graph part: compiled ahead of time on its first call (with that call's arguments as
    the example; through ``shared`` when the part is one of several buckets'), or given an
    already compiled (loaded) function."""

    def __init__(self, fn: Callable | None, compiled: Callable | None = None, shared: SharedCompile | None = None,
                 options: dict | None = None):
        self.fn = fn
        self.compiled = compiled
        self.shared = shared
        self.options = INDUCTOR_OPTIONS if options is None else options
        self.guards_checked = False

    def __call__(self, *args: torch.Tensor) -> object:
        if self.compiled is None:
            self.compiled = _aot_compile(self.fn, args, self.options) if self.shared is None else self.shared.compiled_for(self.fn, args)
        if self.guards_checked:
            return self.compiled(*args)
        out = self.compiled(*args)  # dynamo's guards checked: RuntimeError if these are not the arguments it was built for
        # Then never again: a SmolLM2 decode step (5 part calls, a layer group has about 120
        # tensor arguments) took 1.03x as long with them (A/B in one process, 12 rounds). Later
        # calls get the same weights, and check_inputs and the State checks keep inputs and KV
        # cache to the same shapes and dtypes. (A part shared by buckets is disabled for all of
        # them: SharedCompile.compiled_for checks each bucket's first arguments itself.)
        self.compiled.disable_guard_check()
        self.guards_checked = True
        return out


def _wrapper(plan: Plan, spec: GraphSpec, shared: dict[tuple, SharedCompile]) -> Callable[[functools.partial], PrecompiledPart]:
    """The ``wrap`` of :func:`phases.phase_parts` for ``spec``: the parts of :data:`BUCKET_DIMS`
    go through the (phase, batch) entry of ``shared`` (on one process), the others compile alone."""

    options = inductor_options(plan)

    def wrap(fn: functools.partial) -> PrecompiledPart:
        dims = BUCKET_DIMS.get(fn.func) if plan.tp_degree == 1 else None
        if dims is None:
            return PrecompiledPart(fn, options=options)
        key = (spec.phase, spec.batch_size, fn.func)
        return PrecompiledPart(fn, shared=shared.setdefault(key, SharedCompile(dims, fn.func in BACKED_PARTS, options)))

    return wrap


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) + 1.0


def _compile_probe() -> None:
    with contextlib.suppress(Exception), torch.no_grad():  # the build repeats the step and reports its failure
        torch.compile(_probe, fullgraph=True, dynamic=False)(torch.ones(64))


def _kernels_at_low_priority() -> None:
    """:func:`small_gemm_available` with this thread's (and so its compiler processes') nice
    value raised on Linux, where nice is per thread: on a new machine the library's build (about
    40 CPU seconds) otherwise takes the cores from the checkpoint load it overlaps."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + 10, 19))
    small_gemm_available()


WARM_UP_STEPS = (small_gemm_available, _compile_probe)
"""What every inductor build needs before its first kernel, all C++ compiler runs: the
``small_gemm`` library (about 40 CPU seconds, once per machine; it warns and falls back by
itself), and inductor's vector-ISA probes (about 6; once per machine in the default cache, where
inside a private directory every compile repeated them) and precompiled header (about 7, once
per machine), the last two by compiling a one-kernel function in inductor's default cache."""


def warm_up() -> None:
    """:data:`WARM_UP_STEPS`, one after the other."""
    for step in WARM_UP_STEPS:
        step()


_warm_up_threads: list[threading.Thread] = []  # the ones started in this process, if any


def start_warm_up() -> None:
    """Start the kernel library's load (its build, on a new machine) in a background thread at
    lower priority (once per process), so that it overlaps the checkpoint load;
    :func:`wait_warm_up` joins it. Loading compiled graphs needs only the library; a build also
    needs the probe (:func:`prepare_graphs`). The probe is not started here: it is Python
    (dynamo, inductor) for about 3 s even when every cache is warm, and beside the load it held
    the GIL that long (SmolLM2's load took 4.6 s instead of 1.8 s)."""
    if not _warm_up_threads:
        thread = threading.Thread(target=_kernels_at_low_priority, name="neuronfx-warm-up-kernels", daemon=True)
        _warm_up_threads.append(thread)
        thread.start()


def wait_warm_up() -> None:
    """Join the warm-up thread when it was started (the build must not race it)."""
    for thread in _warm_up_threads:
        thread.join()


def prepare_graphs(device: str) -> None:
    """What building or loading a CPU plan's graphs needs first: the probe
    (:func:`_compile_probe`; loading compiled graphs in a private directory without it repeated
    the vector-ISA probes there, 7 s), run here while the kernel library may still be building
    in the warm-up thread, then that thread joined and the library loaded. A CUDA plan
    (``device``) needs neither: its graphs call no CPU kernel."""
    if device != "cpu":
        wait_warm_up()
        return
    _compile_probe()
    wait_warm_up()
    small_gemm_available()


def private_dir(source: Path | None = None) -> Path:
    """A new private inductor cache directory (a copy of ``source`` when given): inductor writes
    into its cache while it works, so shared copies (artifacts, cache entries, the kernel store)
    stay read-only."""
    target = Path(tempfile.mkdtemp(prefix="neuronfx-inductor-"))
    if source is not None:
        shutil.copytree(source, target, dirs_exist_ok=True,
                        ignore=lambda _d, found: [n for n in found if _skipped(n)])
    return target


def _skipped(name: str) -> bool:
    """Inductor's lock files and bytecode, and the store's files being written."""
    return name.endswith(_SKIPPED_SUFFIXES) or name == "__pycache__" or name.startswith(".tmp-")


def publish_kernels(directory: Path, store: Path) -> int:
    """Copy the files of a runtime's private ``directory`` that ``store`` lacks into it (the
    kernel store of the compile cache: later builds start from a copy of it, so a kernel
    compiled once is not compiled again; inductor names its files by a hash of their source, so
    a file of one name is the same file in every build). Each file is written to a temp name and
    renamed: readers see it whole or not at all. Returns the number of files added."""
    added = 0
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if not path.is_file() or any(_skipped(part) for part in rel.parts):
            continue
        target = store / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{target.name}")
        shutil.copy2(path, tmp)
        os.replace(tmp, target)
        added += 1
    return added


def build_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache,
                shared: dict[tuple, SharedCompile] | None = None) -> GraphModule:
    """Compile one (phase, batch, bucket) graph now: one run on the template ``kv`` (call it
    inside the runtime's private cache directory, see :func:`in_dir`). ``shared``: the
    :class:`SharedCompile` of the graphs built so far for this plan, which this graph reuses
    and extends (None: a new one, nothing shared)."""
    wrap = _wrapper(plan, spec, {} if shared is None else shared)
    ops = compiled_ops(plan.inference.dtype, plan.inference.device, plan.inference.activation_format)
    graph = build_module(plan, spec, ops, group_size=phase_group_size(plan, spec.phase), wrap=wrap)
    with torch.no_grad(), device_scope(plan):
        graph(weights, kv, example_inputs(plan, spec))
    return graph


def in_dir(directory: Path, fn: Callable, *args: object) -> object:
    """``fn(*args)`` with inductor's cache directory set to ``directory``."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # importing inductor costs 2 s: only when compiling

    with temporary_cache_dir(str(directory)):
        return fn(*args)


def part_files(spec: GraphSpec) -> list[str]:
    """Relative file names of a graph's three parts."""
    return [f"precompiled/{spec.phase}-b{spec.batch_size}-t{spec.bucket}-{name}.bin" for name in PART_NAMES]


def _parts(graph: object) -> tuple[PrecompiledPart, ...]:
    """The compiled parts of a graph this backend built; ArtifactError for any other graph."""
    graph = unwrap(graph)  # a CUDA-graph capture saves the compiled graph it replays
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
    for graph in graphs.values():
        _parts(graph)  # all checked before anything is written
    names = [name for spec in plan.graphs for name in save_parts(spec, graphs[spec.key], out)]
    shutil.copytree(compiled_dir, out / INDUCTOR_DIR, dirs_exist_ok=True,
                    ignore=lambda _d, found: [n for n in found if n.endswith(_SKIPPED_SUFFIXES) or n == "__pycache__"])
    return names + _tree_files(out / INDUCTOR_DIR, INDUCTOR_DIR)


def save_parts(spec: GraphSpec, graph: object, out: Path) -> list[str]:
    """Write the compiled parts of ``spec``'s graph under ``out``; their relative names
    (:func:`part_files`). ArtifactError for a graph this backend did not build."""
    (out / "precompiled").mkdir(parents=True, exist_ok=True)
    for name, part in zip(part_files(spec), _parts(graph)):
        part.compiled.save_compiled_function(str(out / name))
    return part_files(spec)


def load_graph(plan: Plan, spec: GraphSpec, src: Path) -> GraphModule:
    """The graph from its saved parts (inductor's cache directory must hold its kernels, or they
    are compiled again from the saved source)."""
    if plan.inference.device == "cpu":  # CUDA graphs call no neuronfx kernel
        small_gemm_available()  # compiled code may call neuronfx's custom ops: register them first
    fns = []
    for name in part_files(spec):
        with open(src / name, "rb") as f:
            fns.append(PrecompiledPart(None, torch.compiler.load_compiled_function(f)))
    parts = PhaseParts(prologue=fns[0], layers=fns[1], epilogue=fns[2], group_size=phase_group_size(plan, spec.phase))
    return GraphModule(parts, spec.phase, phase_num_layers(plan, spec.phase))
