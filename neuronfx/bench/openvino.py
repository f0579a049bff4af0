"""OpenVINO GenAI as a compared engine of ``neuronfx bench latency --compare openvino``: its
continuous-batching pipeline (``openvino_genai.ContinuousBatchingPipeline``) on the CPU, on an
IR of the same weights that optimum-intel exports once (:mod:`neuronfx.bench.openvino_export`).

Only the benchmark needs it: openvino-genai, optimum-intel and nncf are the ``[bench-openvino]``
extra, never runtime dependencies, imported when the comparison starts
(:func:`import_genai` names the extra when one is missing).

A case: each of the B prompts is one request (``add_request`` of its token ids as an int64
``ov.Tensor`` (1, prompt_len), made before the clock starts, as llama.cpp's batch is filled),
greedy (``do_sample=False``), eos ignored, exactly ``gen_len`` tokens (``min_new_tokens =
max_new_tokens``). Then ``step()`` until every request has finished, each call timed on the
host's clock: the first step prefills every prompt and samples each row's first token (TTFT,
as ``time_neuronfx``'s prefill step), each later step decodes one token per row (one ITL),
the definitions of ``neuronfx.bench.timing``. The scheduler is sized so that this holds
(``max_num_batched_tokens`` >= B x prompt_len, so no prompt is split over steps; ``max_num_seqs``
>= B; KV cache room for every row), and a case that took another number of steps is an error.

Settings: ``INFERENCE_NUM_THREADS`` = the benchmark's thread count; ``INFERENCE_PRECISION_HINT``
= the benchmark's ``--dtype`` (f32, bf16 or f16; OpenVINO's CPU default is bf16 where the CPU has
it, which a float32 comparison must not get); every other setting is OpenVINO's CPU default,
named in the engine's label where it changes the arithmetic: the KV cache precision (u8 by
default, grouped scales) and the dynamic int8 quantization of activations in products with
compressed weights (``DYNAMIC_QUANTIZATION_GROUP_SIZE``, 32 by default).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from neuronfx.bench.openvino_export import INSTALL_HINT, OVWeights
from neuronfx.bench.timing import Engine, Timed
from neuronfx.errors import BackendUnavailableError

PRECISION_HINTS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""``--dtype`` -> OpenVINO's ``INFERENCE_PRECISION_HINT``."""


def import_genai() -> tuple[Any, Any]:
    """``(openvino_genai, openvino)``; BackendUnavailableError naming the extra when missing."""
    try:
        import openvino
        import openvino_genai
    except ImportError as exc:
        raise BackendUnavailableError(f"the OpenVINO engines (bench latency --compare openvino, bench engines --engines openvino-*) "
                                      f"need openvino-genai: {INSTALL_HINT}.") from exc
    return openvino_genai, openvino


@attrs.frozen(kw_only=True)
class PipelineSizes:
    """What the pipeline must hold at once: ``max_batch`` requests, ``max_prompt`` prompt tokens
    each, ``max_tokens`` positions each (prompt + generated)."""

    max_batch: int
    max_prompt: int
    max_tokens: int


def kv_cache_gib(config: dict[str, Any], sizes: PipelineSizes) -> int:
    """GiB of KV cache for ``sizes`` (every row at ``max_tokens`` positions), counted at 4 bytes
    a value (OpenVINO's u8 default needs less), rounded up; at least 1. ``config`` is the IR's
    HF config.json."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    nbytes = 2 * layers * kv_heads * head_dim * 4 * sizes.max_batch * sizes.max_tokens
    return max(1, -(-nbytes // 2**30))


def scheduler_config(genai: Any, config: dict[str, Any], sizes: PipelineSizes) -> Any:
    """The SchedulerConfig of the pipeline: a whole case's prompts in one step, all its rows at
    once, room for their KV cache; prefix caching off (the prompts share nothing)."""
    sc = genai.SchedulerConfig()
    sc.max_num_batched_tokens = max(sizes.max_batch * sizes.max_prompt, sc.max_num_batched_tokens)
    sc.max_num_seqs = max(sizes.max_batch, sc.max_num_seqs)
    sc.cache_size = kv_cache_gib(config, sizes)
    sc.enable_prefix_caching = False
    return sc


def greedy_config(genai: Any, gen_len: int) -> Any:
    """A GenerationConfig for exactly ``gen_len`` greedy tokens, eos ignored."""
    config = genai.GenerationConfig()
    config.max_new_tokens = gen_len
    config.min_new_tokens = gen_len
    config.ignore_eos = True
    config.do_sample = False
    return config


def run_openvino(genai: Any, ov: Any, pipe: Any, prompts: list[list[int]], gen_len: int) -> tuple[Timed, list[list[int]]]:
    """Greedy run of ``prompts`` (B rows of token ids) for ``gen_len`` tokens per row:
    ((TTFT, [ITL per decode step]) in seconds, the B rows of generated token ids). Raises
    RuntimeError when the scheduler did not prefill every prompt in the first step."""
    config = greedy_config(genai, gen_len)
    inputs = [ov.Tensor(np.asarray([row], dtype=np.int64)) for row in prompts]
    handles = [pipe.add_request(i, ids, config) for i, ids in enumerate(inputs)]
    stamps = []
    t0 = time.perf_counter()
    while pipe.has_non_finished_requests():
        pipe.step()
        stamps.append(time.perf_counter())
    tokens = [[int(t) for t in handle.read_all()[0].generated_ids] for handle in handles]
    if len(stamps) != gen_len or any(len(row) != gen_len for row in tokens):
        raise RuntimeError(f"OpenVINO took {len(stamps)} steps for {gen_len} tokens per row (rows of {[len(r) for r in tokens]} "
                           "tokens): the scheduler split the prefill or the generation did not stop where asked")
    return (stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]), tokens


def cpu_defaults(ov: Any, weights: OVWeights) -> str:
    """OpenVINO's CPU defaults that change the arithmetic, for the engine's label: "kv u8" (KV
    cache precision), with compressed weights ", dq 32" too (the group of the dynamic int8
    quantization of activations in their products; 0 = off)."""
    core = ov.Core()
    label = f"kv {core.get_property('CPU', 'KV_CACHE_PRECISION').get_type_name()}"
    return label if weights.bits is None else f"{label}, dq {core.get_property('CPU', 'DYNAMIC_QUANTIZATION_GROUP_SIZE')}"


@contextmanager
def openvino_engine(ir: Path, weights: OVWeights, dtype: str, threads: int, sizes: PipelineSizes) -> Iterator[Engine]:
    """OpenVINO GenAI's continuous-batching pipeline on the IR in ``ir`` (exported with
    ``weights``), computing in ``dtype`` on ``threads`` threads, sized for ``sizes``; held while
    the block runs. Its ``tokens`` give the generated ids of a case (for token agreement).
    Raises BackendUnavailableError (naming the extra) when openvino-genai is missing."""
    genai, ov = import_genai()
    config = json.loads((ir / "config.json").read_text())
    properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": PRECISION_HINTS[dtype]}
    pipe = genai.ContinuousBatchingPipeline(str(ir), scheduler_config(genai, config, sizes), "CPU", properties)
    label = f"{PRECISION_HINTS[dtype]}/{weights.name} ({cpu_defaults(ov, weights)})"
    yield Engine(name="openvino", backend="cb-cpu", dtype=label,
                 time=lambda prompts, gen_len: run_openvino(genai, ov, pipe, prompts, gen_len)[0],
                 tokens=lambda prompts, gen_len: run_openvino(genai, ov, pipe, prompts, gen_len)[1])
