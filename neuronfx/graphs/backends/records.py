"""Backends as records: what a backend is (:class:`Backend`), what it builds (:class:`Built`),
and the progress bar and build loop the backends share. The table of backends is
``graphs.backends.BACKENDS``.

Every graph, whatever built it, is called ``graph(weights, kv, inputs)`` with ``kv`` the KV
cache (one LayerKV per layer) and ``inputs`` its phase's step-input record, and returns a dict
of output tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch
from tqdm.auto import tqdm

from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.phases.inputs import KVCache, empty_kv

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
    - ``traces``: whether ``build`` traces the model (tracing and codegen leave hundreds of MB of
      garbage, which ``neuronfx.compile`` then collects and hands back to the OS).
    - ``prepare()``: start, in the background, the work every build needs first (inductor: the
      C++ kernel library, compiler probes, precompiled header), so that it overlaps the
      checkpoint load; ``build`` waits for it. Call after ``check``.
    - ``prepare_weights(plan, weights) -> weights``: the weights in the layout this backend's
      graphs take, given the converted checkpoint (inductor: int8 layer weights packed for
      ``vpdpbusd`` where the plan multiplies them by int8 activations; the others: unchanged).
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
    traces: bool = True
    prepare: Callable[[], None] = attrs.field(default=lambda: None)
    choices: Callable[[Plan], dict[str, object]] = attrs.field(default=lambda plan: {})  # none by default
    prepare_weights: Callable[[Plan, Weights], Weights] = attrs.field(default=lambda plan, weights: weights)


def progress_bar(plan: Plan, progress: bool, total: int | None = None) -> tqdm | LogBar:
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
    bar = progress_bar(plan, progress, len(plan.graphs))
    for spec in plan.graphs:
        bar.set_postfix_str(f"{spec.phase} {spec.batch_size}x{spec.bucket}")
        t0 = time.perf_counter()
        graphs[spec.key] = builder(plan, spec, weights, template_kv)
        seconds[spec.key] = time.perf_counter() - t0
        bar.update(1)
    bar.close()
    return graphs, seconds


def nothing_to_check() -> None:
    """The ``check`` of a backend without optional dependencies."""
    return None


def no_files(plan: Plan, graphs: Mapping[GraphKey, Graph], compiled_dir: str | None, out: Path) -> list[str]:
    """The ``save`` of a backend whose graphs are rebuilt on load: nothing written."""
    return []
