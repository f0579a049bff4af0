"""Backends as records: how a plan's GraphSpecs become callables, and what of them is saved.

Every graph, whatever built it, is called ``graph(weights, kv, inputs)`` with ``kv`` the KV
cache (one LayerKV per layer) and ``inputs`` its phase's step-input record, and returns a dict
of output tensors. :data:`BACKENDS` is the one table keyed by backend name; nothing outside
``graphs/`` branches on a backend's name.

- eager: the GraphModule itself with the reference ops; the reference for every test.
- export: ``torch.export.export`` per (phase, batch, bucket) with the reference ops; the KV
  cache is updated in place (the exported program keeps the ``index_put_`` on the input) and
  weights are inputs, so all programs share one copy. Saved as ``graphs/*.pt2``, each holding
  its program only (its example inputs are kept as meta tensors: no weights, no KV cache).
- inductor: ``torch.compile`` (inductor) of each part of a phase with the CPU kernel ops,
  precompiled so it saves and loads without re-tracing (``graphs/inductor.py``); the default.
  On CUDA: torch ops and Triton kernels, each graph captured as a CUDA graph
  (``graphs/cuda_graphs.py``).
- neuron: needs torch-neuronx / neuronx-distributed (optional extra ``neuron``), imported lazily.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import attrs
import torch
from torch.utils._pytree import tree_map_only
from tqdm.auto import tqdm

from neuronfx.config.inputs import leaves
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.errors import BackendUnavailableError, ConfigError
from neuronfx.graphs import compile_workers, cuda_graphs, inductor
from neuronfx.graphs.gemm_choice import widen_16bit_prefill
from neuronfx.graphs.inputs import KVCache, empty_kv, example_inputs
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.ops import REFERENCE_OPS
from neuronfx.graphs.phases import FlatGraphModule, build_module

Graph = Callable[..., dict[str, torch.Tensor]]
GraphKey = tuple[str, int, int]
logger = logging.getLogger("neuronfx.compile")


@attrs.frozen(kw_only=True)
class Built:
    """Every graph of a plan, as a backend built or loaded them.

    - ``graphs``: (phase, batch_size, bucket) -> callable ``graph(weights, kv, inputs)``.
    - ``seconds``: (phase, batch_size, bucket) -> seconds spent building or loading it.
    - ``compiled_dir``: a private directory of compiled files the graphs use (inductor: its
      kernel cache), owned by the runtime that holds them; None when there is none.
    """

    graphs: dict[GraphKey, Graph]
    seconds: dict[GraphKey, float]
    compiled_dir: str | None = None


@attrs.frozen(kw_only=True)
class Backend:
    """One backend.

    - ``check()``: raise BackendUnavailableError when its optional dependencies are missing
      (cheap; call before loading weights).
    - ``build(plan, weights, progress, kernels) -> Built``: compile every graph of ``plan``;
      ``kernels`` (a directory or None): the compile cache's kernel store, which a backend with
      compiled kernels starts from and adds the kernels it compiled to (inductor).
    - ``save(plan, graphs, compiled_dir, out) -> [relative file names]``: write the graph files
      a saved runtime or a compile-cache entry holds (none for eager).
    - ``load(plan, weights, src) -> Built``: the graphs from what ``save`` wrote in ``src``
      (checked by the caller's manifest first).
    - ``cached``: whether the compile cache is on by default (it holds graph files worth keeping).
    - ``prepare()``: start, in the background, the work every build needs first (inductor: the
      C++ kernel library, compiler probes, precompiled header), so that it overlaps the
      checkpoint load; ``build`` waits for it. Call after ``check``.
    - ``choices(plan) -> dict``: what this machine or process decided that the built graphs bake
      in (part of the compile-cache key: graphs built under one choice are not served under
      another; inductor: the thread count, the 16-bit prefill path; export and eager: nothing,
      their graphs run the same ATen ops whatever the thread count).
    """

    name: str
    check: Callable[[], None]
    build: Callable[[Plan, Weights, bool], Built]
    save: Callable[[Plan, Mapping[GraphKey, Graph], str | None, Path], list[str]]
    load: Callable[[Plan, Weights, Path], Built]
    cached: bool
    prepare: Callable[[], None] = attrs.field(default=lambda: None)
    choices: Callable[[Plan], dict[str, object]] = attrs.field(default=lambda plan: {})  # none by default


def _bar(plan: Plan, progress: bool, total: int | None = None) -> tqdm | LogBar:
    """The progress of a plan's compile, one step per graph: a bar on stderr with ``progress``,
    else one INFO line per graph through the ``neuronfx.compile`` logger (a server's log)."""
    if not progress:
        return LogBar(f"compile ({plan.inference.backend})", total)
    return tqdm(total=total, desc=f"compile ({plan.inference.backend})", unit="graph")


class LogBar:
    """A progress bar's ``update`` / ``set_postfix_str`` / ``close`` as log lines, one per step:
    "compile (export): 3 of 10 graphs done after 12.3 s; prefill 2x256" (the bar's status text
    as it was then; it changes while a step runs, so it is only remembered)."""

    def __init__(self, desc: str, total: int | None) -> None:
        self.desc, self.total, self.n, self.postfix = desc, total, 0, ""
        self.t0 = time.perf_counter()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        logger.info("%s: %d of %s graphs done after %.1f s%s", self.desc, self.n, self.total, time.perf_counter() - self.t0,
                    f"; {self.postfix}" if self.postfix else "")

    def close(self) -> None:
        return None


def build_each(plan: Plan, weights: Weights, builder: Callable[[Plan, GraphSpec, Weights, KVCache], Graph],
               progress: bool) -> tuple[dict[GraphKey, Graph], dict[GraphKey, float]]:
    """``builder(plan, spec, weights, template_kv)`` for every graph of ``plan``, timed, with a
    progress bar; the template KV cache is the trace-time cache (live states own their own)."""
    template_kv = empty_kv(plan)
    graphs, seconds = {}, {}
    bar = _bar(plan, progress, len(plan.graphs))
    for spec in plan.graphs:
        bar.set_postfix_str(f"{spec.phase} {spec.batch_size}x{spec.bucket}")
        t0 = time.perf_counter()
        graphs[spec.key] = builder(plan, spec, weights, template_kv)
        seconds[spec.key] = time.perf_counter() - t0
        bar.update(1)
    bar.close()
    return graphs, seconds


def _nothing_to_check() -> None:
    return None


# --- eager --------------------------------------------------------------------------------------


def _eager_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache) -> Graph:
    return build_module(plan, spec, REFERENCE_OPS)


def _eager_build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    graphs, seconds = build_each(plan, weights, _eager_graph, progress)
    return Built(graphs=graphs, seconds=seconds)


def _no_files(plan: Plan, graphs: Mapping[GraphKey, Graph], compiled_dir: str | None, out: Path) -> list[str]:
    return []


EAGER = Backend(name="eager", check=_nothing_to_check, build=_eager_build, save=_no_files,
                load=lambda plan, weights, src: _eager_build(plan, weights, False), cached=False)


# --- export -------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class ExportedGraph:
    """An exported (phase, batch, bucket) graph: the ExportedProgram (what is saved) and its
    runnable module, which takes the flat convention of :class:`FlatGraphModule`."""

    program: torch.export.ExportedProgram
    module: Callable[..., dict[str, torch.Tensor]]

    def __call__(self, weights: Weights, kv: KVCache, inputs: object) -> dict[str, torch.Tensor]:
        return self.module(weights, [(layer.k, layer.v) for layer in kv], *leaves(inputs))


_DEBUG_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node")
"""Node metadata saying where each op came from in neuronfx's source: 45% of a saved SmolLM2
program (checkout paths included), read back and kept by every load, never used to run it."""


def _exported(program: torch.export.ExportedProgram) -> ExportedGraph:
    """``program`` and its runnable module, made light to keep, save and load:

    - example inputs replaced by meta tensors of the same structure, shapes and dtypes. They are
      the weights and the template KV cache: ``torch.export.save`` wrote them into every graph
      file (SmolLM2, batch 2: 609 MB of each 612 MB .pt2) and every load read a copy back;
    - debug metadata (:data:`_DEBUG_META`) dropped;
    - the module built without export's input guards and checks: they check every input's shape
      on every call (a generated assert per input dimension, hundreds per graph, and building
      them costs 0.6 s per SmolLM2 graph), while the runtime builds each graph's inputs from its
      GraphSpec (the weights from the plan's model config, which the compile-cache key holds).
    """
    if program.example_inputs is not None:
        program.example_inputs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), program.example_inputs)
    for node in program.graph.nodes:
        for key in _DEBUG_META:
            node.meta.pop(key, None)
    module = program.module(check_guards=False)
    module.validate_inputs = False
    return ExportedGraph(program=program, module=module)


def _export_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache) -> Graph:
    # ``kv`` is the template cache, not a live state: tracing may write into it.
    module = FlatGraphModule(build_module(plan, spec, REFERENCE_OPS), spec.record)
    args = (weights, [(layer.k, layer.v) for layer in kv], *leaves(example_inputs(plan, spec)))
    return _exported(torch.export.export(module, args, strict=False))


def _export_build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    graphs, seconds = build_each(plan, weights, _export_graph, progress)
    return Built(graphs=graphs, seconds=seconds)


def _export_file(spec: GraphSpec) -> str:
    return f"graphs/{spec.phase}-b{spec.batch_size}-t{spec.bucket}.pt2"


def _export_save(plan: Plan, graphs: Mapping[GraphKey, Graph], compiled_dir: str | None, out: Path) -> list[str]:
    (out / "graphs").mkdir(parents=True, exist_ok=True)
    for spec in plan.graphs:
        torch.export.save(graphs[spec.key].program, str(out / _export_file(spec)))  # type: ignore[attr-defined]
    return [_export_file(spec) for spec in plan.graphs]


def _export_load(plan: Plan, weights: Weights, src: Path) -> Built:
    graphs, seconds = {}, {}
    with _cached_schema_hints():
        for spec in plan.graphs:
            t0 = time.perf_counter()
            graphs[spec.key] = _exported(torch.export.load(str(src / _export_file(spec))))  # files saved with data shed it here
            seconds[spec.key] = time.perf_counter() - t0
    return Built(graphs=graphs, seconds=seconds)


def _typing_with_cached_hints() -> types.ModuleType:
    """A copy of the ``typing`` module whose ``get_type_hints`` is cached. Torch's export
    deserializer resolves the hints of the same few dozen schema classes for every node it reads
    (about 100,000 times per SmolLM2 graph, half of ``torch.export.load``'s time; pytorch issue
    196452); the classes are fixed, so the cached hints are the ones it would compute."""
    module = types.ModuleType("typing")
    module.__dict__.update(vars(typing))
    hints: dict[tuple, dict] = {}

    def get_type_hints(obj: object, globalns: dict | None = None, localns: dict | None = None,
                       include_extras: bool = False) -> dict:
        key = (obj, id(globalns), id(localns), include_extras)
        if key not in hints:
            hints[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return hints[key]

    module.get_type_hints = get_type_hints  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _cached_schema_hints() -> Iterator[None]:
    """Loads in this block resolve torch's export schema type hints once
    (:func:`_typing_with_cached_hints`); a torch whose deserializer no longer reads them through
    its module's ``typing`` is left as it is."""
    from torch._export.serde import serialize

    if getattr(serialize, "typing", None) is not typing:
        yield
        return
    serialize.typing = _typing_with_cached_hints()
    try:
        yield
    finally:
        serialize.typing = typing


EXPORT = Backend(name="export", check=_nothing_to_check, build=_export_build, save=_export_save, load=_export_load, cached=True)


# --- inductor -----------------------------------------------------------------------------------


def _inductor_build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    inductor.prepare_graphs(plan.inference.device)
    directory = inductor.private_dir(kernels if kernels is not None and kernels.is_dir() else None)
    builder = functools.partial(inductor.build_graph, shared={})  # the buckets of a phase share compiled parts
    if cuda_graphs.uses_cuda_graphs(plan):
        builder = cuda_graphs.capturing(builder)  # capture each graph as it is built, under the bar
    graphs, seconds = compile_workers.build(plan, weights, directory, builder, functools.partial(_bar, plan, progress))
    if kernels is not None:
        inductor.publish_kernels(directory, kernels)
    return Built(graphs=graphs, seconds=seconds, compiled_dir=str(directory))


def _inductor_load(plan: Plan, weights: Weights, src: Path) -> Built:
    inductor.prepare_graphs(plan.inference.device)  # the kernel ops the loaded graphs call, the ISA probes their loading needs
    directory = inductor.private_dir(src / inductor.INDUCTOR_DIR)
    graphs, seconds = {}, {}
    for spec in plan.graphs:
        t0 = time.perf_counter()
        graphs[spec.key] = inductor.in_dir(directory, inductor.load_graph, plan, spec, src)
        seconds[spec.key] = time.perf_counter() - t0
    if cuda_graphs.uses_cuda_graphs(plan):
        graphs = cuda_graphs.capture_all(plan, graphs, weights)
    return Built(graphs=graphs, seconds=seconds, compiled_dir=str(directory))


def _inductor_choices(plan: Plan) -> dict[str, object]:
    """torch's intra-op thread count (inductor's generated C++ is compiled for it and its
    compiled functions guard on it: they refuse to run under another), and the 16-bit prefill
    path of a 16-bit CPU plan (:func:`neuronfx.graphs.ops.cpu_kernel_ops`), measured once per
    machine (graphs/gemm_choice.py; none on CUDA, where no CPU kernel is bound)."""
    choices: dict[str, object] = {"num_threads": torch.get_num_threads()}
    dtype = plan.inference.dtype
    if dtype != "float32" and plan.inference.device == "cpu":
        choices["widen_16bit"] = widen_16bit_prefill(dtype)
    return choices


INDUCTOR = Backend(name="inductor", check=compile_workers.check_env, build=_inductor_build, save=inductor.save,
                   load=_inductor_load, cached=True, prepare=inductor.start_warm_up, choices=_inductor_choices)


# --- neuron -------------------------------------------------------------------------------------


def _neuron_check() -> None:
    try:
        import torch_neuronx  # noqa: F401
    except Exception as exc:  # the PyPI placeholder raises on import, not just ImportError
        raise BackendUnavailableError(
            "backend='neuron' needs torch-neuronx and neuronx-distributed from AWS's Neuron package "
            "index (pip install 'neuronfx[neuron]' on a Trainium/Inferentia host); use backend='eager', "
            "'export' or 'inductor' elsewhere."
        ) from exc


def _neuron_build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    _neuron_check()
    raise BackendUnavailableError("backend='neuron' tracing is not implemented yet; use 'eager', 'export' or 'inductor'.")


NEURON = Backend(name="neuron", check=_neuron_check, build=_neuron_build, save=_no_files,
                 load=lambda plan, weights, src: _neuron_build(plan, weights, False), cached=False)


BACKENDS: dict[str, Backend] = {b.name: b for b in (EAGER, EXPORT, INDUCTOR, NEURON)}
"""The one table of backends, keyed by ``InferenceConfig.backend``."""


def get_backend(name: str) -> Backend:
    """The record of backend ``name``; ConfigError naming the choices for any other name."""
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r} is not one of {sorted(BACKENDS)}.")
    return BACKENDS[name]


def check_backend(name: str) -> None:
    """Raise BackendUnavailableError if backend ``name``'s optional dependencies are missing
    (cheap; call it before loading weights)."""
    get_backend(name).check()


def prepare_backend(name: str) -> None:
    """Start backend ``name``'s preparation in the background (``Backend.prepare``); call it
    after :func:`check_backend`, before loading weights."""
    get_backend(name).prepare()
