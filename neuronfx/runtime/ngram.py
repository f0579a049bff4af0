"""Prompt lookup (n-gram) drafts, vLLM's ``speculative_config.method="ngram"``
(``vllm/v1/spec_decode/ngram_proposer.py``; the names ``prompt_lookup_min``,
``prompt_lookup_max`` and ``num_speculative_tokens`` are vLLM's too): the sequence's last n
tokens, for the longest n from ``max_n`` down to ``min_n`` that occurs earlier in the sequence
(prompt and generated tokens), matched at its earliest occurrence; the tokens that followed that
occurrence are the drafts. Pure host code, no graph; ``speculate.py`` verifies the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence


def ngram_propose(history: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to ``num_tokens`` draft tokens for the sequence ``history`` (token ids, its last one
    the newest): find the longest n in [min_n, max_n] such that ``history[-n:]`` also occurs
    ending before the last position (occurrences may overlap the suffix), take the earliest
    such occurrence, and return the tokens that followed it (fewer than ``num_tokens`` when the
    occurrence is near the end). Empty when no n-gram of at least ``min_n`` tokens matches, or
    ``num_tokens`` <= 0. O(len(history) * max_n) time.
    """
    h = list(history)
    if num_tokens <= 0 or len(h) < 2:
        return ()
    last, end_of_suffix = h[-1], len(h) - 1
    best_len, best_end = 0, -1
    for end in range(end_of_suffix):  # end: the candidate occurrence's last index, a token follows it
        if h[end] != last:
            continue
        m = 1
        while m < max_n and end - m >= 0 and h[end - m] == h[end_of_suffix - m]:
            m += 1
        if m > best_len:  # strictly longer: the earliest occurrence of the longest n-gram wins
            best_len, best_end = m, end
    if best_len < min_n:
        return ()
    return tuple(h[best_end + 1 : best_end + 1 + num_tokens])

