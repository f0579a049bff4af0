"""The request workload of the serving benchmarks (``neuronfx bench serving`` over HTTP,
``neuronfx bench throughput`` in process): prompt windows of a token sequence and generation
lengths, drawn from one seed, so the same seed gives every engine the same requests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from importlib import resources
from typing import Any

import attrs
import torch

from neuronfx.errors import InputError

DEFAULT_TEXT = "bench_text.txt"
"""The default prompt text, in ``neuronfx/data``: public-domain English passages."""


@attrs.frozen(kw_only=True)
class WorkloadRequest:
    """One request: its prompt's token ids and the tokens it asks for (max_tokens = min_tokens)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


def make_workload(ids: Sequence[int], num_requests: int, prompt_range: tuple[int, int], gen_range: tuple[int, int],
                  seed: int = 0) -> tuple[WorkloadRequest, ...]:
    """``num_requests`` requests drawn from ``random.Random(seed)``: a prompt length and a
    generation length uniform in the inclusive ranges (tokens), and a window of that many of
    ``ids`` (repeated as needed) at a random offset. Raises InputError for no ids or a range
    that is not 1 <= MIN <= MAX."""
    check_range("prompt-lens", prompt_range, 1)
    check_range("gen-lens", gen_range, 1)
    if not ids:
        raise InputError("the prompt text has no tokens; give a --text-file with some text.")
    ids = list(ids) * (1 + prompt_range[1] // len(ids))  # room for a window of the longest prompt anywhere
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n, gen = rng.randint(*prompt_range), rng.randint(*gen_range)
        start = rng.randrange(len(ids) - n + 1)
        requests.append(WorkloadRequest(prompt_ids=tuple(ids[start:start + n]), max_tokens=gen))
    return tuple(requests)


def random_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids in [3, vocab_size) from a seeded generator: a workload source for a model
    without a tokenizer (ids below 3 are the usual special tokens)."""
    return torch.randint(3, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def default_text() -> str:
    """The default prompt text: public-domain English passages shipped with neuronfx."""
    return resources.files("neuronfx").joinpath("data").joinpath(DEFAULT_TEXT).read_text(encoding="utf-8")  # one name a call: Python 3.10


def check_range(name: str, bounds: Sequence[int], low: int) -> tuple[int, int]:
    """(lo, hi) of an inclusive length range; InputError naming ``--name`` unless low <= lo <= hi."""
    if len(bounds) != 2 or not low <= bounds[0] <= bounds[1]:
        raise InputError(f"--{name}={list(bounds)} must be two lengths MIN MAX with {low} <= MIN <= MAX.")
    return bounds[0], bounds[1]


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids without special tokens (the workload's source)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
