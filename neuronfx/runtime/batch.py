"""The host side of a graph call: the sampler's inputs (:func:`sampler_inputs`,
:func:`logits_bias`), the random numbers of a step (:func:`draws`, :func:`seeded_uniform`),
and the checked graph call (:func:`call_graph`, the one place graph-input tensors are checked).
The step pipeline (``pipeline.py``) builds on these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuronfx.config.inputs import SamplerInputs, check_inputs, dense_strides
from neuronfx.config.plan import bitmask_words
from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.errors import InputError
from neuronfx.graphs.phases.device import device_scope, plan_device, to_device, to_host
from neuronfx.graphs.phases.inputs import KVCache
from neuronfx.runtime.runtime import Runtime

Tensor = torch.Tensor


# --- random numbers -----------------------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer (Steele et al. 2014): a bijection of 64-bit ints that scatters
    nearby inputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, index: int, stream: int = 0) -> float:
    """The uniform in [0, 1) for draw ``index`` (0-based, tokens sampled so far) of a request
    seeded with ``seed``, in random stream ``stream`` (0: the sampled token; speculative
    decoding uses 1 for drafting, 2 for acceptance, 3 for the resampled or bonus token): a pure
    function of its arguments, so a seeded request samples the same tokens whatever shares its
    batch and whichever slot it holds (vLLM keeps one torch.Generator per seeded request for the
    same reason). Other streams start from the seed mixed with the stream number, so no stream
    of one seed repeats a stream of a nearby seed. Mixing: splitmix64 (Steele et al. 2014)."""
    base = seed if stream == 0 else _mix64(seed ^ _mix64(stream * _GOLDEN & _MASK64))
    z = _mix64((base + (index + 1) * _GOLDEN) & _MASK64)
    return float(torch.rand(1, generator=torch.Generator().manual_seed(z >> 1)))


def draws(key: int, params: Sequence[SamplingParams], generated: Sequence[int], bsz: int) -> tuple[Tensor, int]:
    """(bsz uniforms, next key). Unseeded rows draw from the state's key (pure in ``key``);
    seeded rows from their own (seed, index)."""
    g = torch.Generator().manual_seed(key)
    rand = torch.rand(bsz, generator=g)
    for r, (sp, n) in enumerate(zip(params, generated)):
        if sp.seed is not None:
            rand[r] = seeded_uniform(sp.seed, n)
    return rand, int(torch.randint(0, 2**62, (1,), generator=g))


# --- the sampler's inputs ------------------------------------------------------------------------


def pad(rows: Sequence, n: int, fill: object) -> list:
    """``rows`` with ``fill`` appended up to ``n`` entries."""
    return list(rows) + [fill] * (n - len(rows))


def stop_ids(eos_token_ids: Sequence[int], sp: SamplingParams) -> list[int]:
    """Tokens min_tokens holds back: the model's eos ids (unless ignore_eos) and stop_token_ids."""
    return ([] if sp.ignore_eos else list(eos_token_ids)) + list(sp.stop_token_ids)


def logits_bias(runtime: Runtime, params: Sequence[SamplingParams], generated: Sequence[int], rows: int | None = None) -> Tensor:
    """(rows, V) float32 (rows defaults to n = len(params); padding rows are 0): each row's
    ``logit_bias`` (OpenAI's, ids checked < V by ``check_sampling``), plus -inf on the stop ids of
    rows that have generated fewer than their ``min_tokens`` tokens; 0 elsewhere. Every step
    (prefill, decode, chunk, each speculated position) builds its bias here, so the same host
    tensor reaches every rank."""
    bias = torch.zeros(len(params) if rows is None else rows, runtime.plan.model.vocab_size, dtype=torch.float32)
    for r, (sp, done) in enumerate(zip(params, generated)):
        if sp.logit_bias:
            ids, values = zip(*sp.logit_bias)
            bias[r, list(ids)] = torch.tensor(values, dtype=torch.float32)
        if done < sp.min_tokens:
            bias[r, stop_ids(runtime.plan.model.eos_token_ids, sp)] = float("-inf")
    return bias


def sampler_inputs(runtime: Runtime, params: Sequence[SamplingParams], counts: Tensor, prompt_mask: Tensor, bias: Tensor,
                   rand: Tensor, bsz: int, bitmask: Tensor | None = None) -> SamplerInputs:
    """The sampler's record for ``len(params)`` real rows, padded to ``bsz`` rows (greedy, zero
    counts, mask, bias and rand, all tokens allowed). ``counts`` (n, V) int32, ``prompt_mask``
    (n, V) bool, ``bias`` (n, V) float32, ``rand`` (n,) float32, ``bitmask`` (n, W) int32 or
    None (no row constrained: all ones, -1); n <= rows <= bsz of each is used as given."""
    width = runtime.plan.topk_width
    rows = pack_sampling(params, width) + pack_sampling([SamplingParams()] * (bsz - len(params)), width)
    words = bitmask_words(runtime.plan.model.vocab_size)
    allowed = torch.full((bsz, words), -1, dtype=torch.int32)
    if bitmask is not None:
        allowed[: bitmask.shape[0]] = bitmask
    return SamplerInputs(
        sampling_params=torch.tensor(rows, dtype=torch.float32),
        output_counts=pad_rows(counts, bsz), prompt_mask=pad_rows(prompt_mask, bsz),
        logits_bias=pad_rows(bias, bsz), rand=pad_rows(rand, bsz), token_bitmask=allowed,
    )


def dense(t: Tensor) -> Tensor:
    """``t`` itself when it has dense row-major strides (``config.inputs.dense_strides``), else a
    dense copy: a view such as ``u[:, i]`` of one row passes ``is_contiguous()`` with stride
    k - 1, which a compiled graph's guards refuse (and, once they are no longer checked, would
    read wrong)."""
    return t if t.stride() == dense_strides(t.shape) else t.clone(memory_format=torch.contiguous_format)


def pad_rows(t: Tensor, bsz: int) -> Tensor:
    """``t`` with zero rows appended up to ``bsz`` rows, dense (:func:`dense`)."""
    if t.shape[0] == bsz:
        return dense(t)
    out = torch.zeros(bsz, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def dense_record(value: tuple) -> tuple:
    """Step-input record ``value`` (nested records included) with every tensor :func:`dense`."""
    return type(value)(*(dense_record(v) if isinstance(v, tuple) else dense(v) if isinstance(v, Tensor) else v for v in value))


def call_graph(runtime: Runtime, kv: KVCache, phase: str, bsz: int, bucket: int, inputs: object) -> dict[str, Tensor]:
    """Run graph (phase, bsz, bucket) of ``runtime`` on ``kv`` after checking ``inputs`` against
    its GraphSpec. Raises InputError for a graph the plan does not have, ``inputs`` that are not
    the phase's record, or a tensor whose shape, dtype or layout does not match (naming the
    field). Token ids, slots and positions are the caller's to check (the public steps check
    them once, before anything runs). ``inputs`` are host tensors: on a CUDA plan they are copied
    to its device without waiting (``graphs/phases/device.py``) and the outputs come back to the host,
    the step's one wait for the device; on the CPU nothing moves. A tensor of the right shape
    and dtype whose strides are not dense row-major (a strided view) is copied first
    (:func:`dense`): no input reaches a compiled part that its guards would refuse."""
    try:
        spec = runtime.plan.graph(phase, bsz, bucket)
    except KeyError:
        graphs = sorted(g.key for g in runtime.plan.graphs)
        raise InputError(f"the plan has no {phase!r} graph for batch {bsz} and bucket {bucket}; it has {graphs}.") from None
    if not isinstance(inputs, spec.record):
        raise InputError(f"{phase} graph inputs are a {type(inputs).__name__}; build a {spec.record.__name__} from its GraphSpec.")
    inputs = dense_record(inputs)
    check_inputs(spec.inputs, inputs, f"{phase} graph (batch {bsz}, bucket {bucket})")
    plan = runtime.plan
    with torch.no_grad(), device_scope(plan):  # inference only; compiled graphs are specialised for no-grad
        return to_host(runtime.graphs[spec.key](runtime.weights, kv, to_device(inputs, plan_device(plan))))
