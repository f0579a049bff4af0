"""``neuronfx check-accuracy``'s library: neuronfx against transformers on the same weights.

Three checks, all on one compiled runtime (``output_logits=True``) and one transformers causal LM
in float32 (:func:`reference_model`, built from the HF-named state dict the runtime was compiled
from, or from the dequantized weights of a quantized plan):

- **greedy tokens**: ``neuronfx.generate`` against transformers' ``generate(do_sample=False)``
  for each prompt, ``max_new_tokens`` tokens each (eos stops neither engine, so every prompt
  compares the same number of tokens); the first position where they differ, or identical.
- **teacher-forced logits**: neuronfx is fed the reference's tokens (prefill the prompt, then one
  decode step per reference token) so both engines see the same context at every position
  however early they diverge (NxDI's ``logit_validation`` does the same); at every position the
  fp32 logits are compared: max abs error, top-1 agreement, and NxDI's tolerance map
  (``accuracy_report.TOLERANCE_BANDS``, semantics in ``accuracy_report.position_errors``).
- **perplexity** of a text file under both engines, on the same chunks of tokens.

A front end (like the benchmarks): it drives the runtime's step functions and builds
transformers models; nothing below it imports it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import neuronfx
from neuronfx.bench.accuracy_report import (
    TOLERANCE_BANDS,
    AccuracyReport,
    Band,
    Divergence,
    PerplexityResult,
    PromptResult,
    compare_logits,
    first_divergence,
    max_abs_error,
)
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import CheckpointError, ConfigError, InputError, SequenceLengthExceededError
from neuronfx.io.checkpoints import Checkpoint
from neuronfx.runtime.generate import normalize_prompts
from neuronfx.runtime.runtime import Runtime, check_runtime
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, check_prompts, decode_step, prefill_step

Tensor = torch.Tensor

DEFAULT_CHATS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
)
"""The user messages checked when no prompt is given (through the tokenizer's chat template)."""


# --- the reference --------------------------------------------------------------------------------


def reference_model(source: Checkpoint | Any, state_dict: dict[str, Tensor]) -> Any:
    """transformers' causal LM for ``source`` (a :class:`~neuronfx.io.checkpoints.Checkpoint`, or a
    transformers ``PretrainedConfig``) with the HF-named ``state_dict`` as its weights, in
    float32, eval mode. Built by transformers' own loader (``from_pretrained(None, config=...,
    state_dict=...)``), so both checkpoint layouts of MoE experts and tied embeddings load as
    transformers loads them; float32 tensors are shared, not copied.

    Raises CheckpointError when ``state_dict`` lacks a weight the model needs, has one it does
    not know, or one of the wrong shape (transformers would initialise or skip it at random)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_config = source.hf_config if isinstance(source, Checkpoint) else source
    if hf_config is None:
        raise CheckpointError("the checkpoint carries no transformers config; load it with neuronfx.io.checkpoints.load_checkpoint.")
    not_tensors = [name for name, t in state_dict.items() if not isinstance(t, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(f"state_dict values {not_tensors[:3]} are not tensors (a lazy checkpoint?); "
                              "load the checkpoint with lazy=False.")
    with torch.device("meta"):  # the class transformers picks for this config, at no cost
        model_class = type(AutoModelForCausalLM.from_config(hf_config))
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" would interleave with our report
    try:
        model, info = model_class.from_pretrained(None, config=hf_config, state_dict=dict(state_dict), dtype=torch.float32,
                                                  output_loading_info=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    bad = {k: sorted(info[k])[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[k]}
    if bad:
        raise CheckpointError(f"the reference model cannot take this state_dict: {bad}; pass the HF-named weights of "
                              f"this {hf_config.model_type} checkpoint.")
    return model.eval()


@torch.no_grad()
def reference_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], Tensor]:
    """transformers' greedy ``generate`` for one prompt: (``max_new_tokens`` token ids, their raw
    logits [max_new_tokens, vocab] float32). eos does not stop it (``eos_token_id=[]``: an unset
    one would be taken from the model's generation config). Raises ConfigError when a logits
    processor of the model's generation config (repetition penalty, suppressed tokens, ...) made
    a token other than the raw logits' argmax: neuronfx's greedy tokens are that argmax."""
    from transformers import GenerationConfig

    ids = torch.tensor([list(prompt)])
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0,
                              repetition_penalty=1.0, output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens, logits = out.sequences[0, ids.shape[1]:].tolist(), torch.stack([step[0] for step in out.logits]).float()
    if tokens != logits.argmax(-1).tolist():
        raise ConfigError(f"the reference's generate picked {tokens[:8]} but its raw logits' argmax is "
                          f"{logits.argmax(-1).tolist()[:8]}: its generation config processes logits ({model.generation_config}); "
                          "build the reference with neuronfx.bench.accuracy.reference_model.")
    return tokens, logits


@torch.no_grad()
def reference_nll(model: Any, chunks: Sequence[Sequence[int]]) -> tuple[float, int]:
    """(sum of -log p(token | the tokens before it in its chunk), tokens scored) under ``model``,
    one forward pass per chunk; float64 sum."""
    total, count = 0.0, 0
    for chunk in chunks:
        ids = torch.tensor([list(chunk)])
        logits = model(ids).logits[0, :-1].float()  # (L - 1, vocab): position t predicts token t + 1
        total += nll_sum(logits, ids[0, 1:])
        count += len(chunk) - 1
    return total, count


def nll_sum(logits: Tensor, targets: Tensor) -> float:
    """sum over rows of -log_softmax(logits[r])[targets[r]]; ``logits`` [n, vocab] float32."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(-logp.gather(1, targets.long()[:, None]).sum())


# --- neuronfx ----------------------------------------------------------------------------------


def neuronfx_greedy(runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """``neuronfx.generate``'s greedy tokens per prompt, eos ignored (speculative decoding when
    the runtime can)."""
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [list(p) for p in prompts],
                                  max_new_tokens=max_new_tokens, sampling=SamplingParams(ignore_eos=True))
    return [list(t) for t in result.token_ids]


def teacher_forced_logits(runtime: Runtime, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[Tensor]:
    """neuronfx's logits [len(continuations[b]), vocab] float32 per prompt, teacher-forced: row b
    prefills ``prompts[b]`` (logits for the first continuation token), then decodes
    ``continuations[b][:-1]`` one token per step (logits for the next). Prompts run
    ``batch_size`` at a time; needs a runtime with ``output_logits=True``."""
    size = runtime.plan.inference.batch_size
    out: list[Tensor] = []
    for start in range(0, len(prompts), size):
        out += _forced_batch(runtime, prompts[start:start + size], continuations[start:start + size])
    return out


def _forced_batch(runtime: Runtime, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[Tensor]:
    greedy = SamplingParams()
    slots = list(range(len(prompts)))
    step, state = prefill_step(runtime, neuronfx.init_state(runtime),
                               PrefillBatch(seq_ids=slots, prompts=[list(p) for p in prompts], sampling=[greedy] * len(slots)))
    logits = [[step.logits[r].clone()] for r in slots]
    for i in range(max(len(c) for c in continuations) - 1):
        rows = [r for r in slots if i + 1 < len(continuations[r])]
        step, state = decode_step(runtime, state, DecodeBatch(seq_ids=rows, input_ids=[continuations[r][i] for r in rows],
                                                              sampling=[greedy] * len(rows)))
        for j, r in enumerate(rows):
            logits[r].append(step.logits[j].clone())
    return [torch.stack(row) for row in logits]


# --- perplexity ----------------------------------------------------------------------------------


def perplexity(runtime: Runtime, reference: Any, ids: Sequence[int]) -> PerplexityResult:
    """Perplexity of ``ids`` under neuronfx (teacher-forced decode steps) and ``reference``.

    The first ``batch_size * sequence_length`` tokens are cut into chunks of ``sequence_length``
    (the KV cache of one slot; a last chunk of one token is dropped), each scored with its own
    context only, all chunks in one batched pass: neuronfx prefills each chunk's first token and
    decodes the rest, one token per step. perplexity = exp(sum of -log p(token | earlier tokens
    of its chunk) / tokens scored), the same chunks for both engines. Raises InputError for
    fewer than 2 tokens."""
    inf = runtime.plan.inference
    ids = [int(t) for t in ids][: inf.batch_size * inf.sequence_length]
    chunks = [c for c in (ids[i:i + inf.sequence_length] for i in range(0, len(ids), inf.sequence_length)) if len(c) >= 2]
    if not chunks:
        raise InputError(f"the text has {len(ids)} token(s); perplexity needs at least 2.")
    check_prompts(runtime, [c[:1] for c in chunks])  # token ids inside the vocabulary
    ours = teacher_forced_logits(runtime, [c[:1] for c in chunks], [c[1:] for c in chunks])
    ours_nll = sum(nll_sum(logits, torch.tensor(c[1:])) for logits, c in zip(ours, chunks))
    theirs_nll, count = reference_nll(reference, chunks)
    return PerplexityResult(tokens=len(ids), predicted=count, chunks=len(chunks), neuronfx=math.exp(ours_nll / count),
                            transformers=math.exp(theirs_nll / count))


# --- prompts and the whole check ---------------------------------------------------------------------


def chat_prompts(tokenizer: Any, messages: Sequence[str]) -> list[list[int]]:
    """Token ids of each user message through the tokenizer's chat template (with the
    generation prompt). Raises InputError when the tokenizer has no chat template."""
    try:
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]) for m in messages]
    except ValueError as exc:  # transformers: "Cannot use chat template functions ... no chat template"
        raise InputError(f"chat messages need a chat template and this tokenizer has none ({exc}); give raw prompts.") from exc


def default_prompts(tokenizer: Any) -> list[list[int]]:
    """:data:`DEFAULT_CHATS` through the chat template, or as raw text when the tokenizer has none."""
    try:
        return chat_prompts(tokenizer, DEFAULT_CHATS)
    except InputError:
        return [list(tokenizer(m)["input_ids"]) for m in DEFAULT_CHATS]


def check_accuracy(
    runtime: Runtime,
    reference: Any,
    tokenizer: Any = None,
    prompts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 32,
    text_file: str | os.PathLike | None = None,
    bands: Sequence[Band] = TOLERANCE_BANDS,
    reference_name: str = "transformers float32",
) -> AccuracyReport:
    """Compare ``runtime`` with ``reference`` (a transformers causal LM, e.g. from
    :func:`reference_model`) on greedy tokens, teacher-forced logits and (with ``text_file``)
    perplexity; see the module docstring.

    ``prompts``: token ids per prompt (default: :func:`default_prompts` of ``tokenizer``).
    ``tokenizer`` decodes tokens in the report and tokenizes ``text_file`` (UTF-8). ``bands``:
    the tolerance map (default NxDI's). Everything is checked before anything runs: raises
    ConfigError for a runtime without ``output_logits`` or a reference of another vocabulary,
    InputError (no prompts and no tokenizer, a text file without a tokenizer or unreadable,
    ``max_new_tokens`` < 1),
    SequenceLengthExceededError (prompt + ``max_new_tokens`` > ``sequence_length``), the
    prompt errors of ``runtime.steps.check_prompts``."""
    prompts = _checked_prompts(runtime, tokenizer, prompts, max_new_tokens)
    text_ids = _text_ids(tokenizer, text_file) if text_file is not None else None
    vocab = reference.config.get_text_config().vocab_size
    if vocab != runtime.plan.model.vocab_size:
        raise ConfigError(f"the reference has vocab_size={vocab} but the runtime's model has {runtime.plan.model.vocab_size}; "
                          "build the reference from the weights the runtime was compiled from (reference_model).")
    theirs = [reference_greedy(reference, p, max_new_tokens) for p in prompts]
    ours_tokens = neuronfx_greedy(runtime, prompts, max_new_tokens)
    ours_logits = teacher_forced_logits(runtime, prompts, [tokens for tokens, _ in theirs])
    refs = [logits for _, logits in theirs]
    results = tuple(
        _prompt_result(tokenizer, p, mine, tokens, ref, forced, max_new_tokens)
        for p, mine, (tokens, ref), forced in zip(prompts, ours_tokens, theirs, ours_logits, strict=True)
    )
    return AccuracyReport(engine=engine_name(runtime), reference=reference_name, max_new_tokens=max_new_tokens, prompts=results,
                          logits=compare_logits(refs, ours_logits, bands),
                          perplexity=None if text_ids is None else perplexity(runtime, reference, text_ids))


def engine_name(runtime: Runtime) -> str:
    """The report's engine line, e.g. "neuronfx inductor float32 weights gguf int8 activations KV cache int8"."""
    inf = runtime.plan.inference
    return (f"neuronfx {inf.backend} {inf.dtype}" + (f" weights {inf.weight_format}" if inf.weight_format != "float" else "")
            + (" int8 activations" if inf.activation_format == "int8" else "") + (f" tp {inf.tp_degree}" if inf.tp_degree > 1 else "")
            + (f" KV cache {inf.kv_cache_dtype}" if inf.kv_cache_dtype != "auto" else ""))


def _checked_prompts(runtime: Runtime, tokenizer: Any, prompts: Sequence[Sequence[int]] | None, max_new_tokens: int) -> list[list[int]]:
    """The prompts check_accuracy runs (the default ones without ``prompts``), checked with the
    runtime and the token budget; raises what :func:`check_accuracy` documents."""
    check_runtime(runtime)
    inf = runtime.plan.inference
    if not inf.output_logits:
        raise ConfigError("check_accuracy compares logits and this runtime returns none; compile it with "
                          "InferenceConfig(output_logits=True).")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1.")
    if prompts is None and tokenizer is None:
        raise InputError("no prompts and no tokenizer: pass prompts= (token ids) or tokenizer= for the default chat prompts.")
    prompts = default_prompts(tokenizer) if prompts is None else normalize_prompts(prompts)
    check_prompts(runtime, prompts)
    for b, p in enumerate(prompts):
        if len(p) + max_new_tokens > inf.sequence_length:
            raise SequenceLengthExceededError(f"prompt {b} has {len(p)} tokens + max_new_tokens={max_new_tokens} > "
                                              f"sequence_length={inf.sequence_length}; lower max_new_tokens or compile with a "
                                              "larger sequence_length.")
    return prompts


def _text_ids(tokenizer: Any, text_file: str | os.PathLike) -> list[int]:
    if tokenizer is None:
        raise InputError(f"text_file={str(text_file)!r} needs a tokenizer: pass tokenizer=.")
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read text_file={str(text_file)!r}: {exc}; give a UTF-8 text file.") from exc
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < 2:
        raise InputError(f"text_file={str(text_file)!r} has {len(ids)} token(s); perplexity needs at least 2.")
    return ids


def _prompt_result(tokenizer: Any, prompt: list[int], ours: list[int], theirs: list[int], ref: Tensor, forced: Tensor,
                   num_tokens: int) -> PromptResult:
    def text(t: int | None) -> str | None:
        return None if tokenizer is None or t is None else tokenizer.decode([t])

    index = first_divergence(ours, theirs)
    divergence = None
    if index is not None:
        mine = ours[index] if index < len(ours) else None
        other = theirs[index] if index < len(theirs) else None
        divergence = Divergence(index=index, ours=mine, theirs=other, ours_text=text(mine), theirs_text=text(other))
    return PromptResult(
        prompt_ids=tuple(prompt), prompt_text=None if tokenizer is None else tokenizer.decode(prompt, skip_special_tokens=True),
        num_tokens=num_tokens, divergence=divergence, max_abs_error=max_abs_error(ref, forced),
        top1_agreement=float((ref.argmax(-1) == forced.argmax(-1)).float().mean()),
    )
