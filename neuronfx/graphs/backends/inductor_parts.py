"""The inductor backend's compiled parts: each part of a (phase, batch, bucket) graph
(prologue, one layer group reused for every group, epilogue) compiled with
``torch.compile(fullgraph=True, dynamic=False).aot_compile`` on its first call, saved with
``save_compiled_function`` and read back with ``torch.compiler.load_compiled_function`` (no
dynamo tracing, no inductor lowering).

The layer group and the epilogue are compiled once per (phase, batch) with the bucket's
dimension dynamic and shared by the graphs of every bucket: which dimensions those are comes
from the annotated shapes of the records the parts take (``phases/records.py``), the bucket's
symbol per part being :data:`BUCKET_DIMS`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import attrs
import torch

from neuronfx.config.attention import layer_period
from neuronfx.config.plan import SHARED_PARTS, GraphSpec, Plan
from neuronfx.errors import ArtifactError
from neuronfx.graphs.backends.cuda_graphs import unwrap
from neuronfx.graphs.kernels.activation_choice import plan_int8_paths
from neuronfx.graphs.kernels.bundles import compiled_ops
from neuronfx.graphs.kernels.c_shims import c_shims
from neuronfx.graphs.kernels.library import kernels_turned_off, small_gemm_available
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.phases.chunk import chunk_layers
from neuronfx.graphs.phases.compose import GraphModule, PhaseParts, build_module, phase_num_layers
from neuronfx.graphs.phases.decode import decode_epilogue, decode_layers, draft_epilogue, greedy_epilogue, speculate_epilogue
from neuronfx.graphs.phases.device import device_scope
from neuronfx.graphs.phases.embed import embed_epilogue, embed_layers
from neuronfx.graphs.phases.inputs import KVCache, example_inputs
from neuronfx.graphs.phases.prefill import prefill_epilogue, prefill_layers
from neuronfx.graphs.phases.records import symbol_dims
from neuronfx.version import source_fingerprint

PART_NAMES = ("prologue", "layers", "epilogue")

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
    limit = PREFILL_LAYER_GROUP if phase in ("prefill", "chunk", "embed") else MAX_LAYER_GROUP
    return layer_group_size(n, limit, period=layer_period(plan.model, n))


@attrs.frozen
class BucketDims:
    """How a part shared by the buckets of a (phase, batch) is compiled: ``symbol`` names the
    bucket-sized dimensions of its records (``phases/records.py``; None: none of its shapes
    depends on the bucket), each compiled as a dynamic size, ``backed`` (duck-sized: several
    dimensions stay one symbol) or unbacked (no size of it is special to the trace)."""

    symbol: str | None
    backed: bool = False


BUCKET_DIMS: dict[Callable, BucketDims] = {
    prefill_layers: BucketDims("T", backed=True),  # T of h, RoPE and mask must stay one symbol
    prefill_epilogue: BucketDims("T"),  # h (B, T, hidden)
    decode_layers: BucketDims("S"),  # mask (M, B, 1, T, S)
    chunk_layers: BucketDims("S", backed=True),  # SDPA guards on its key length (Eq(S, 0)): unbacked cannot answer
    decode_epilogue: BucketDims(None),
    greedy_epilogue: BucketDims(None),
    speculate_epilogue: BucketDims(None),
    draft_epilogue: BucketDims(None),
    embed_layers: BucketDims("T", backed=True),  # as prefill's
    embed_epilogue: BucketDims("T"),  # h (B, T, hidden)
}
"""The parts one compile serves for every bucket of a (phase, batch). Prologues are compiled per
bucket (they build the bucket's masks from its length). Under tensor parallelism every part is
compiled per bucket (sequence-parallel prefill writes ``bucket`` positions of a padded T).
Backed chunk layers cost the bucket equal to the KV length a version of its own (see
:class:`SharedCompile`)."""


INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
"""Inductor options of every part: no size, stride, alignment or scalar checks in the generated
wrapper. Each is a Python call per buffer per step (a SmolLM2 decode layer had about 15), and
what they check (that the kernels' fake implementations give the real shapes, which
tests/test_kernels.py checks) cannot change between calls of a static-shape graph."""


CPU_SERIAL_ELEMENTS = 32768
"""Elements below which inductor's generated C++ kernels of a CPU plan run on the calling thread
instead of an OpenMP region (:func:`cpu_min_chunk`). A SmolLM2 verify pass (5 tokens) crossed
inductor's default (512 a thread) in nine small kernels per layer group (RoPE, the KV write,
norms: a fork, barriers and a join each for under a microsecond of work) that the same layers
of a decode step (1 token) ran serially; under this bound the verify graph's layer groups have
no parallel region of their own (the kernels' ops parallelise inside). A prefill's elementwise
kernels (128 tokens x 576 features and up) stay parallel. Measured on 2 threads only."""


def cpu_min_chunk(threads: int) -> int:
    """``cpp.min_chunk_size`` for ``threads`` intra-op threads: inductor runs a kernel serially
    when its elements // threads fall below it, so :data:`CPU_SERIAL_ELEMENTS` // threads (at
    least inductor's own 512) keeps the bound in total elements whatever the thread count (the
    count is part of the compile-cache key, ``inductor.choices``)."""
    return max(512, CPU_SERIAL_ELEMENTS // max(1, threads))


def inductor_options(plan: Plan) -> dict:
    """:data:`INDUCTOR_OPTIONS`, and for a CPU plan on one rank a C++ wrapper (``cpp_wrapper``):
    the part's kernel calls and buffer handling run as compiled C++ instead of a Python
    function; the decode step's ``neuronfx::`` ops are called through their C shims
    (``kernels.c_shims``), the others through the dispatcher (each returns tensors,
    not lists, so none calls back into Python); on CPU, :func:`cpu_min_chunk` of torch's thread count. A SmolLM2 Q4_1 decode step was 1.05x
    and 1.06x faster with it at batch 1 and 1.01x at batch 8 (in-process A/Bs of 10 rounds, 2026-11;
    the script has since gone); a cold compile took about as long (51.9 s against 51.5 s).
    CUDA plans keep the Python wrapper their CUDA-graph capture was written against, and
    tensor-parallel plans too: the C++ wrapper cannot call the functional collectives (torch
    2.13: "arg type Any is not yet supported by custom_op_wrapper")."""
    cpu = plan.inference.device == "cpu"
    cpp = cpu and plan.tp_degree == 1
    return (INDUCTOR_OPTIONS | {"cpp_wrapper": cpp} | ({"aot_inductor.custom_ops_to_c_shims": c_shims()} if cpp else {})
            | ({"cpp.min_chunk_size": cpu_min_chunk(torch.get_num_threads())} if cpu else {}))


def _aot_compile(fn: Callable, args: tuple, options: dict) -> Callable:
    # torch 2.11 attaches ``aot_compile`` only under this flag (2.13 has it on by default);
    # seen on the GPU image's torch 2.11: "'function' object has no attribute 'aot_compile'".
    with torch._dynamo.config.patch(enable_aot_compile=True):
        try:
            with autograd_cache_keyed_by_source():
                return torch.compile(fn, fullgraph=True, dynamic=False, options=options).aot_compile((args, {}))
        except Exception:
            # aot_compile loads cache entries strictly: a damaged entry of the kernel store would
            # fail the compile. Once more without the cache (a real compile error raises again).
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return torch.compile(fn, fullgraph=True, dynamic=False, options=options).aot_compile((args, {}))


@contextlib.contextmanager
def autograd_cache_keyed_by_source() -> Iterator[None]:
    """AOTAutograd's cache keyed by neuronfx's source fingerprint instead of ``aot_compile``'s
    backend id. ``aot_compile`` names each compile's backend by a new uuid and torch 2.13 hashes
    that name into the key (``AOTAutogradCachePickler._reduce_aot_config``), so a part compiled
    before with the same graph, inputs and settings (another bucket ladder of the same model,
    whose entries the compile cache's kernel store holds) was never a hit: every compile lowered
    it again. The fingerprint takes the id's place so that an entry compiled from other neuronfx
    source (other kernel fakes or op schemas behind the same graph) is not one. A hit is saved
    like a miss (torch wraps the loaded entry in a serializable compiled function). Measured
    2026-12-06 (tiny llama, one thread, 2-core AMD EPYC): its plan with prefill buckets (16, 32)
    after one with (32,) compiled in 5.5 s instead of 11.5 s, 6 of its 7 parts hits. The key's
    inductor config holds the C shims' ops (``aot_inductor.custom_ops_to_c_shims``), which
    pickle has no stable form for: both caches were bypassed ("Cannot produce stable cache key
    for unpicklable type"), so the key takes each op by its name."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
    from torch._inductor.codecache import FxGraphCachePickler

    original = AOTAutogradCachePickler._reduce_aot_config
    original_init = FxGraphCachePickler.__init__

    def init(self: FxGraphCachePickler, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)
        self.dispatch_table[torch._ops.OpOverload] = op_by_name

    def reduce(self: object, aot_config: object) -> tuple:
        fn, fields = original(self, aot_config)
        # torch 2.13's layout: the id last. Any other layout is left as it is (no hits, as before).
        if fields and fields[-1] is not None and fields[-1] == aot_config.precompile_backend_id:
            fields = (*fields[:-1], source_fingerprint())
        return fn, fields

    with (_PATCH_LOCK, mock.patch.object(AOTAutogradCachePickler, "_reduce_aot_config", reduce),
          mock.patch.object(FxGraphCachePickler, "__init__", init)):
        yield


def op_by_name(op: torch._ops.OpOverload) -> tuple:
    """A cache key's pickled form of an op overload: its qualified name ("neuronfx.quant_gemm.default")."""
    return str, (str(op),)


_PATCH_LOCK = threading.Lock()
"""One compile patches the pickler at a time (patches of two threads must not interleave)."""


LAYER_PARTS = (prefill_layers, decode_layers, chunk_layers)
"""The parts that take the KV cache (a layer group's (K, V) pairs, their second argument)."""


def mark_cache_blocks(args: tuple) -> None:
    """Mark the block count (dim 0) of every K and V of a layer group's arguments unbacked: with a
    window ring a group's layers hold caches of two block counts (the ring's, the table's) and
    pick their table as data (``common.layer_pool``), so one compiled group serves every group."""
    for k, v in args[1]:
        torch._dynamo.decorators.mark_unbacked(k, 0)
        torch._dynamo.decorators.mark_unbacked(v, 0)


class SharedCompile:
    """The compiled versions of one part that the buckets of a (phase, batch) share (a part
    compiled per bucket: the graphs of that bucket, a decode graph and its greedy twin): a graph
    reuses the first version whose guards accept its arguments, else compiles one more (with
    the bucket dimensions of ``dims`` dynamic). One version is the rule; more appear where a shape
    guard splits the buckets, e.g. a product switching to ``small_gemm`` at its row limit (8 rows;
    fp32 weights 64, so explicit prefill buckets of 64 and 128 compile two versions)."""

    def __init__(self, dims: BucketDims, options: dict | None = None, cache_dims: bool = False):
        self.dims = dims
        self.options = INDUCTOR_OPTIONS if options is None else options
        self.cache_dims = cache_dims
        self.versions: list = []

    def compiled_for(self, fn: Callable, args: tuple) -> Callable:
        for version in self.versions:
            if version.guard_check(*args):
                return version
        # A lone bucket dim (decode's S) is marked unbacked: no size of it is special to the trace,
        # where a backed one guards S != the KV length (the slice would be the whole cache) and
        # the last bucket would need a version of its own. Several dims (prefill's T in h, RoPE
        # and mask) must stay one symbol, which only backed (duck-sized) dims are. Either way a
        # hint, not a demand: a dim the trace must specialise stays static, and the guards send
        # the other buckets to a version of their own.
        mark = torch._dynamo.maybe_mark_dynamic if self.dims.backed else torch._dynamo.decorators.mark_unbacked
        for tensor, dim in symbol_dims(args, self.dims.symbol) if self.dims.symbol else ():
            mark(tensor, dim)
        if self.cache_dims:
            mark_cache_blocks(args)
        self.versions.append(_aot_compile(fn, args, self.options))
        return self.versions[-1]


class PrecompiledPart:
    """One graph part: compiled ahead of time on its first call through ``shared`` (with that
    call's arguments as the example, or a version another graph compiled whose guards accept
    them), or given an already compiled (loaded) function."""

    def __init__(self, fn: Callable | None, compiled: Callable | None = None, shared: SharedCompile | None = None):
        self.fn = fn
        self.compiled = compiled
        self.shared = shared
        self.guards_checked = False

    def __call__(self, *args: torch.Tensor) -> object:
        if self.compiled is None:
            self.compiled = self.shared.compiled_for(self.fn, args)
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
    """The ``wrap`` of ``phases.compose.phase_parts`` for ``spec``: the parts of
    :data:`BUCKET_DIMS` go through the (phase, batch) entry of ``shared`` (on one
    process), the others through its (phase, batch, bucket) entry. A phase of
    ``config.plan.SHARED_PARTS`` takes the entries of the phase it names (a greedy graph runs
    its decode graph's compiled prologue and layers: compiled once, not twice)."""

    options = inductor_options(plan)
    phase = SHARED_PARTS.get(spec.phase, spec.phase)

    def wrap(fn: functools.partial) -> PrecompiledPart:
        dims = BUCKET_DIMS.get(fn.func) if plan.tp_degree == 1 else None
        cache_dims = bool(plan.kv.ring_blocks) and fn.func in LAYER_PARTS
        if dims is None:  # compiled per bucket
            key = (phase, spec.batch_size, spec.bucket, fn.func)
            return PrecompiledPart(fn, shared=shared.setdefault(key, SharedCompile(BucketDims(None), options, cache_dims)))
        if plan.inference.device != "cpu":
            # CUDA's SDPA guards on the key length (Eq(S, 0)), which an unbacked S cannot answer
            # (torch 2.11 on an H200): backed, as chunk layers are everywhere.
            dims = attrs.evolve(dims, backed=True)
        key = (phase, spec.batch_size, fn.func)
        return PrecompiledPart(fn, shared=shared.setdefault(key, SharedCompile(dims, options, cache_dims)))

    return wrap


def build_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache,
                shared: dict[tuple, SharedCompile] | None = None) -> GraphModule:
    """Compile one (phase, batch, bucket) graph now: one run on the template ``kv`` (call it
    inside the runtime's private cache directory, ``inductor_dir.in_dir``). ``shared``: the
    :class:`SharedCompile` of the graphs built so far for this plan, which this graph reuses
    and extends (None: a new one, nothing shared)."""
    wrap = _wrapper(plan, spec, {} if shared is None else shared)
    ops = compiled_ops(plan.inference.dtype, plan.inference.device, plan_int8_paths(plan))
    graph = build_module(plan, spec, ops, group_size=phase_group_size(plan, spec.phase), wrap=wrap)
    with torch.no_grad(), device_scope(plan):
        graph(weights, kv, example_inputs(plan, spec))
    return graph


def part_files(spec: GraphSpec) -> list[str]:
    """Relative file names of a graph's three parts."""
    return [f"precompiled/{spec.phase}-b{spec.batch_size}-t{spec.bucket}-{name}.bin" for name in PART_NAMES]


def compiled_parts(graph: object) -> tuple[PrecompiledPart, ...]:
    """The compiled parts of a graph this backend built; ArtifactError for any other graph."""
    graph = unwrap(graph)  # a CUDA-graph capture saves the compiled graph it replays
    if not isinstance(graph, GraphModule) or not isinstance(graph.parts.prologue, PrecompiledPart):
        raise ArtifactError("this inductor runtime was not built by neuronfx.compile (no precompiled parts); compile it with neuronfx.compile.")
    return graph.parts.prologue, graph.parts.layers, graph.parts.epilogue


def save_parts(spec: GraphSpec, graph: object, out: Path) -> list[str]:
    """Write the compiled parts of ``spec``'s graph under ``out``; their relative names
    (:func:`part_files`). ArtifactError for a graph this backend did not build."""
    (out / "precompiled").mkdir(parents=True, exist_ok=True)
    for name, part in zip(part_files(spec), compiled_parts(graph)):
        part.compiled.save_compiled_function(str(out / name))
    return part_files(spec)


def kernels_missing(loaded: bool) -> str:
    """Why a compiled part cannot find the kernels' C shims in this process, for an error."""
    if kernels_turned_off():
        return "NEURONFX_KERNELS=0 turns the kernel library off in this process"
    if not loaded:
        return "the kernel library did not build or load here (its warning above says why)"
    return "the kernel library's symbols could not be made global (its warning above says why)"


def load_graph(plan: Plan, spec: GraphSpec, src: Path) -> GraphModule:
    """The graph from its saved parts (inductor's cache directory must hold its kernels, or they
    are compiled again from the saved source). ArtifactError when a part does not load in a CPU
    process without neuronfx's kernel library (``NEURONFX_KERNELS=0``, or its build failed): the
    parts' C++ wrappers link the kernels' C shims, so loading them there fails on an undefined
    symbol (an ImportError naming ``aoti_torch_cpu_<op>``)."""
    # compiled code may call neuronfx's custom ops: register them first (CUDA graphs call none)
    kernels = plan.inference.device == "cpu" and small_gemm_available()
    fns = []
    for name in part_files(spec):
        with open(src / name, "rb") as f:
            try:
                fns.append(PrecompiledPart(None, torch.compiler.load_compiled_function(f)))
            except ImportError as exc:
                if "aoti_torch_cpu_" not in str(exc):
                    raise
                raise ArtifactError(
                    f"{src / name} does not load here ({exc}): its graphs call neuronfx's C++ kernels through their C "
                    f"shims, and {kernels_missing(kernels)}. Load it where the kernels build, or compile the model again "
                    "in this process (neuronfx.compile) and save that."
                ) from exc
    parts = PhaseParts(prologue=fns[0], layers=fns[1], epilogue=fns[2], group_size=phase_group_size(plan, spec.phase))
    return GraphModule(parts, spec.phase, phase_num_layers(plan, spec.phase))
