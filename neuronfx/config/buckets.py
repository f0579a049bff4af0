"""Bucket plans and bucket selection: pure functions of integers (token counts).

A bucket is the static length a graph is compiled for. Prefill buckets bound the prompt length
(tokens in the graph); decode buckets bound the attended KV length (cache_len + 1, since a
decode step writes its own K/V before attending).
"""

from __future__ import annotations

from collections.abc import Sequence

from neuronfx.errors import BucketOverflowError, ConfigError

MIN_BUCKET = 128
"""Smallest derived bucket, tokens. Same floor as NxD's ``generate_buckets(128, max)``."""


def generate_buckets(min_bucket: int, max_bucket: int) -> tuple[int, ...]:
    """Power-of-two ladder: every 2**i with ``min_bucket <= 2**i < max_bucket``, then ``max_bucket``.

    Returns a strictly increasing tuple ending at ``max_bucket`` (tokens); ``(max_bucket,)`` when
    ``max_bucket <= min_bucket``. Raises ConfigError for non-positive arguments.

    Relation to NxD (optimum-neuron v0.3/v0.4 ``generate_buckets``): NxD returns
    ``[2**i for i in range(int(log2(min)), round(log2(max)))] + [max]``. Its ``round`` drops the
    largest power of two when ``max`` is just above it ((128, 724) -> [128, 256, 724]) and its
    ``int(log2(min))`` can start below ``min`` ((100, 1000) -> [64, ...]). Here every power of two
    in ``[min, max)`` is kept, so the ladder is monotone in ``max`` and never goes below ``min``.
    """
    if min_bucket <= 0 or max_bucket <= 0:
        raise ConfigError(f"bucket bounds must be positive, got min={min_bucket}, max={max_bucket}.")
    ladder = []
    p = 1
    while p < max_bucket:
        if p >= min_bucket:
            ladder.append(p)
        p *= 2
    return tuple(ladder) + (max_bucket,)


def select_bucket(buckets: Sequence[int], needed: int, what: str = "length") -> int:
    """Smallest bucket ``>= needed`` (tokens) from a strictly increasing ``buckets``.

    Never returns a bucket smaller than ``needed``. Raises BucketOverflowError naming ``needed``
    and the largest bucket when nothing fits.

    NxD's CPU-side ``first_fit`` (NxDI) is strict (``needed < bucket``), so a 128-token prompt with
    buckets [128, 256] runs in 256 there; neuronfx graphs need exactly ``needed`` positions (decode
    writes its K/V before attending), so ``needed == bucket`` fits here.
    """
    if needed <= 0:
        raise BucketOverflowError(f"{what}={needed} must be positive.")
    if not buckets:
        raise BucketOverflowError(f"no buckets to hold {what}={needed}; give at least one bucket.")
    for b in buckets:
        if b >= needed:
            return b
    raise BucketOverflowError(
        f"{what}={needed} exceeds the largest bucket {buckets[-1]}; raise the limit that bounds it "
        "(max_context_length for prompts, sequence_length for the KV cache) and recompile."
    )


def chunk_buckets(chunk_size: int, decode_buckets: Sequence[int]) -> tuple[int, ...]:
    """Attended-length buckets (tokens) of the "chunk" graphs (prefill at an offset): the decode
    buckets ``>= chunk_size``. Every chunk graph takes T = ``chunk_size`` new tokens per row
    (a shorter chunk is right-padded), so the graphs of a batch bucket are one per attended
    length S, and a chunk of n tokens written from position p runs in the smallest S >= p + n
    (:func:`select_bucket`). Buckets below ``chunk_size`` are left out: only a chunk shorter than
    the chunk size at the start of a short sequence could use them, and the next bucket up
    serves it. Returns a strictly increasing tuple ending at ``decode_buckets[-1]``; raises
    ConfigError when ``chunk_size`` < 1 or is larger than every decode bucket.

    Graph count of the chunk phase: ``len(batch buckets) * len(chunk_buckets(C, decode buckets))``.
    """
    if chunk_size < 1 or not decode_buckets or chunk_size > decode_buckets[-1]:
        raise ConfigError(f"prefill_chunk_size={chunk_size} must be in [1, {decode_buckets[-1] if decode_buckets else 0}] "
                          "(the largest decode bucket, sequence_length); lower it.")
    return tuple(b for b in decode_buckets if b >= chunk_size)
