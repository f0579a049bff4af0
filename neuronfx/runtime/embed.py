"""Embeddings: :func:`embed` runs prompts through an embedding runtime's "embed" graphs
(``InferenceConfig(task="embed")``, ``graphs/phases/embed.py``) and returns one pooled vector per
prompt. No state: an embed graph keeps no KV cache, so a call changes nothing and any number of
prompts may be given (they run longest first, ``batch_size`` per graph call).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.inputs import EmbedInputs
from neuronfx.errors import ConfigError, InputError
from neuronfx.graphs.phases.inputs import empty_kv
from neuronfx.runtime.batch import call_graph
from neuronfx.runtime.checks import check_prompts
from neuronfx.runtime.runtime import Runtime, check_runtime

Tensor = torch.Tensor


def is_embedding(runtime: Runtime) -> bool:
    """Whether ``runtime`` was compiled for embeddings (``task="embed"``), not generation."""
    return runtime.plan.inference.task == "embed"


def check_embedding_runtime(runtime: object) -> None:
    """Raise InputError for a ``runtime`` that is not a Runtime, ConfigError for a generation
    runtime (it has no embed graphs), naming the fix."""
    check_runtime(runtime)
    if not is_embedding(runtime):  # type: ignore[arg-type]
        raise ConfigError("this runtime generates (task='generate') and has no embed graphs; compile the model for embeddings "
                          "with InferenceConfig(task='embed', pooling='last' or 'mean') (CLI: --task embed).")


def check_embed_prompts(runtime: Runtime, prompts: object) -> list[list[int]]:
    """``prompts`` as lists of token ids; InputError unless it is a non-empty list of lists,
    EmptyPromptError / PromptTooLongError (> max_context_length) / TokenOutOfVocabError for
    the first bad prompt."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError(f"ids={prompts!r:.60} must be a non-empty list of prompts, each a list of token ids, e.g. [[1, 2, 3]].")
    for b, row in enumerate(prompts):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise InputError(f"prompt {b} is a {type(row).__name__}; each prompt is a list of token ids.")
    rows = [list(row) for row in prompts]
    check_prompts(runtime, rows)
    return rows


def embed(runtime: Runtime, ids: Sequence[Sequence[int]]) -> Tensor:
    """Embed each prompt of ``ids`` (lists of token ids, any count) -> (N, hidden) float32, row i
    prompt i's pooled final hidden state (the plan's ``pooling``, L2-normalised when
    ``normalize``). Prompts run longest first, at most ``batch_size`` per graph call, each call
    in the smallest batch and prompt buckets that hold it. Raises ConfigError for a generation
    runtime, InputError / EmptyPromptError / PromptTooLongError / TokenOutOfVocabError for bad
    prompts, all before anything runs."""
    check_embedding_runtime(runtime)
    rows = check_embed_prompts(runtime, ids)
    plan = runtime.plan
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out = torch.empty(len(rows), plan.model.hidden_size, dtype=torch.float32)
    kv = empty_kv(plan)  # the one-position placeholder the graphs take and never touch
    step = plan.inference.batch_size
    for start in range(0, len(order), step):
        group = order[start:start + step]
        out[group] = embed_rows(runtime, kv, [rows[i] for i in group])
    return out


def embed_rows(runtime: Runtime, kv: object, rows: list[list[int]]) -> Tensor:
    """One embed graph call over ``rows`` (checked prompts, at most ``batch_size``), padded to
    its batch and prompt buckets -> (len(rows), hidden) float32."""
    plan = runtime.plan
    bsz = select_bucket(plan.batch_buckets, len(rows), "batch")
    bucket = select_bucket(plan.prefill_buckets, max(map(len, rows)), "prompt length")
    input_ids = torch.zeros(bsz, bucket, dtype=torch.int32)
    lens = torch.ones(bsz, dtype=torch.int32)
    for b, row in enumerate(rows):
        input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
        lens[b] = len(row)
    positions = torch.arange(bucket, dtype=torch.int32).expand(bsz, bucket).contiguous()
    inputs = EmbedInputs(input_ids=input_ids, position_ids=positions, seq_ids=torch.zeros(bsz, dtype=torch.int32), prompt_lens=lens)
    return call_graph(runtime, kv, "embed", bsz, bucket, inputs)["embeddings"][:len(rows)].float()  # type: ignore[arg-type]
