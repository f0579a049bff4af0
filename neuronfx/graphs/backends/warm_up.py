"""What every inductor build needs before its first kernel, started early: the ``small_gemm``
kernel library (built once per machine) in a background thread during the checkpoint load
(:func:`start_warm_up`), and inductor's vector-ISA probes and precompiled header while a build
or load prepares (:func:`prepare_graphs`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

from neuronfx.graphs.kernels.library import small_gemm_available


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) + 1.0


def _compile_probe() -> None:
    with contextlib.suppress(Exception), torch.no_grad():  # the build repeats the step and reports its failure
        torch.compile(_probe, fullgraph=True, dynamic=False)(torch.ones(64))


def kernels_at_low_priority() -> None:
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
        thread = threading.Thread(target=kernels_at_low_priority, name="neuronfx-warm-up-kernels", daemon=True)
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


