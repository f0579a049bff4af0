"""Greedy speculation gives plain greedy decoding's tokens on the default backend, on the real
model: SmolLM2-135M-Instruct, fp32, inductor, batch 1, 10 chat prompts, 64 tokens each (eos
ignored), for k = 2..5 and every kind of draft: self-speculation (the first 10 layers), prompt
lookup (``speculative_method="ngram"``, prompt_lookup_min 1: it drafts often) and a draft model
(SmolLM2 itself, its own inductor runtime). One compile per k serves all three: the draft model
is attached to it, and prompt lookup runs its speculate graphs under the same plan with
``speculative_method="ngram"`` (a speculate graph does not depend on who drafted; the draft
graphs go unused), as tests/test_ngram.py does. Prints one line per (k, draft) and exits 1 on
any difference. About 10 minutes cold on 2 cores.

Usage: ``.venv/bin/python scripts/check_speculation_exact.py [--ks 2 3 4 5] [--prompts 10]``
"""

from __future__ import annotations

import argparse
import sys

import attrs

import neuronfx
from neuronfx.bench.grounded_prompts import GROUNDED_TASKS
from neuronfx.bench.speculative import chat_prompts
from neuronfx.io import checkpoints

QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.", "How does a bicycle stay upright?",
    "Give me a recipe for a simple tomato soup.", "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.", GROUNDED_TASKS[4], GROUNDED_TASKS[10],
)


def compile_plan(ckpt: object, **inference: object) -> neuronfx.Runtime:
    """SmolLM2 on inductor, batch 1, prompts up to 256 tokens, 384 per slot."""
    plan = neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(batch_size=1, max_context_length=256, sequence_length=384,
                                                                    **inference))
    return neuronfx.compile(plan, ckpt.state_dict, progress=False)


def tokens(runtime: neuronfx.Runtime, prompts: list[list[int]], speculative: bool) -> list[tuple[tuple[int, ...], object]]:
    """(greedy tokens, speculation stats) of each prompt alone, 64 tokens, eos ignored."""
    sampling = neuronfx.SamplingParams(ignore_eos=True, max_tokens=64)
    out = []
    for p in prompts:
        result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [p], sampling=sampling, speculative=speculative)
        out.append((result.token_ids[0], (result.speculation or (None,))[0]))
    return out


def check(name: str, got: list, want: list) -> bool:
    """Print one line: equal prompts, drafted and accepted tokens; True when all equal."""
    same = sum(g[0] == w[0] for g, w in zip(got, want))
    drafted, accepted = sum(g[1].drafted for g in got), sum(g[1].accepted for g in got)
    print(f"{name:34s} identical {same}/{len(want)}  drafted {drafted}  accepted {accepted}", flush=True)
    return same == len(want)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--prompts", type=int, default=len(QUESTIONS))
    args = p.parse_args(argv)
    path = checkpoints.default_model_path()
    ckpt = checkpoints.load_checkpoint(path)
    prompts = chat_prompts(checkpoints.load_tokenizer(path), QUESTIONS[: args.prompts])
    draft = compile_plan(ckpt, output_logits=True)
    want = tokens(draft, prompts, speculative=False)
    ok = True
    for k in args.ks:
        rt = compile_plan(ckpt, speculation_length=k, draft_layers=10)
        ok &= check(f"k={k} self-speculation (10 layers)", tokens(rt, prompts, True), want)
        ok &= check(f"k={k} draft model", tokens(neuronfx.with_draft(rt, draft), prompts, True), want)
        inference = attrs.evolve(rt.plan.inference, draft_layers=0, speculative_method="ngram", prompt_lookup_min=1)
        ngram = attrs.evolve(rt, plan=attrs.evolve(rt.plan, inference=inference))
        ok &= check(f"k={k} prompt lookup (min 1, max 4)", tokens(ngram, prompts, True), want)
    print("all identical" if ok else "DIFFERENCES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
