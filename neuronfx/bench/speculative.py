"""``neuronfx bench speculative``: batch 1, greedy, two chat prompts, --gen-len tokens each (eos
ignored): decode tok/s of plain decode, of self-speculation for each N of --draft-layers, and of
a --draft-model, all in this run, with acceptance statistics. tok/s counts the tokens after the
first (the prefill's) over the time after the prefill."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import neuronfx
from neuronfx.bench.options import Log, add_engine, add_model, check_at_least, logger
from neuronfx.bench.types import Benchmark
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.plan import make_plan
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import InputError
from neuronfx.io import checkpoints
from neuronfx.runtime.runtime import Runtime

SPECULATE_PROMPTS = (
    "Explain in a few sentences how a CPU cache works.",
    "Write a short story about a lighthouse keeper.",
)

Generate = Callable[[list[int]], neuronfx.GenerateResult]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, the drafts and --gen-lens."""
    add_model(p)
    add_engine(p)
    p.add_argument("--speculation-length", type=int, default=4, metavar="K", help="tokens verified per target pass (default 4)")
    p.add_argument("--draft-layers", type=int, nargs="*", default=[8, 15], metavar="N",
                   help="self-speculation with the model's first N layers, one row each (default 8 15)")
    p.add_argument("--draft-model", default=None, metavar="PATH", help="also a draft model sharing the tokenizer")
    p.add_argument("--gen-lens", type=int, nargs="+", default=[128], metavar="N", help="tokens per prompt (the first value; default 128)")
    p.add_argument("--fused", action="store_true", help="also each speculating row fused (fused_speculation: one call per step)")


def chat_prompts(tokenizer: Any, questions: Sequence[str] = SPECULATE_PROMPTS) -> list[list[int]]:
    """Token ids of ``questions`` (user messages) through the tokenizer's chat template.
    Raises InputError when the tokenizer has none (transformers' ValueError)."""
    try:
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]) for q in questions]
    except ValueError as exc:
        raise InputError(f"the model's tokenizer cannot render chat prompts ({exc}); benchmark an instruct model, whose "
                         "tokenizer has a chat template (the default SmolLM2-135M-Instruct has one).") from None


def measure(name: str, generate: Generate, prompts: list[list[int]], log: Log) -> dict[str, Any]:
    """One row: decode tok/s of ``generate`` over ``prompts`` (after a 16-token warm-up) and,
    when it speculated, its acceptance rate and tokens per target pass."""
    generate(prompts[0][:16])
    decode_s, tokens, stats = 0.0, 0, []
    for p in prompts:
        result = generate(p)
        decode_s += result.decode_s
        tokens += result.num_generated - 1
        stats += list(result.speculation or ())
    row = {"name": name, "decode_tok_s": tokens / decode_s}
    if stats:
        row["acceptance_rate"] = sum(s.accepted for s in stats) / sum(s.drafted for s in stats)
        row["mean_accepted_length"] = sum(s.emitted for s in stats) / sum(s.target_passes for s in stats)
    log(f"{name:28s} decode {row['decode_tok_s']:6.1f} tok/s" + (
        f"  acceptance {row['acceptance_rate']:.2f}  tokens/pass {row['mean_accepted_length']:.2f}" if stats else ""))
    return row


def generator(runtime: Runtime, gen_len: int, speculative: bool = True) -> Generate:
    """One greedy prompt through ``runtime`` on a fresh state, ``gen_len`` tokens, eos ignored."""
    sampling = SamplingParams(ignore_eos=True, max_tokens=gen_len)
    return lambda p: neuronfx.generate(runtime, neuronfx.init_state(runtime), [p], sampling=sampling, speculative=speculative)[0]


def run_speculative_bench(checkpoint: Any, tokenizer: Any, backend: str, dtype: str, k: int, draft_layers: Sequence[int],
                          draft_checkpoint: Any = None, gen_len: int = 128, log: Log = print, fused: bool = False) -> dict[str, Any]:
    """The rows of the module docstring; the first is plain decode, each row's ``speedup`` is
    its tok/s over plain decode's; with ``fused`` each speculating row is followed by the same
    draft fused (``fused_speculation``). Raises ConfigError for a draft the plan cannot take."""
    prompts = chat_prompts(tokenizer)

    def runtime_for(ckpt: Any, **extra: Any) -> Runtime:
        inference = InferenceConfig(batch_size=1, dtype=dtype, backend=backend, **extra)
        return neuronfx.compile(make_plan(ckpt.config, inference), ckpt.state_dict, progress=log is print)

    rows = []
    variants = (False, True) if fused else (False,)
    for n in draft_layers:
        for f in variants:
            rt = runtime_for(checkpoint, speculation_length=k, draft_layers=n, fused_speculation=f)
            if not rows:
                rows.append(measure("plain decode", generator(rt, gen_len, speculative=False), prompts, log))
            rows.append(measure(f"self-speculation N={n} k={k}" + " fused" * f, generator(rt, gen_len), prompts, log))
    if draft_checkpoint is not None:
        draft = runtime_for(draft_checkpoint, output_logits=True)
        for f in variants:
            rt = runtime_for(checkpoint, speculation_length=k, fused_speculation=f)
            if not rows:
                rows.append(measure("plain decode", generator(rt, gen_len, speculative=False), prompts, log))
            rows.append(measure(f"draft model k={k}" + " fused" * f, generator(neuronfx.with_draft(rt, draft), gen_len), prompts, log))
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
    return {"k": k, "gen_len": gen_len, "dtype": dtype, "backend": backend, "rows": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the options, read the checkpoints and the tokenizer, measure."""
    check_at_least("speculation_length", args.speculation_length, 2)
    check_at_least("draft_layers", args.draft_layers, 1)
    check_at_least("gen_lens", args.gen_lens, 2)
    path = args.model or checkpoints.default_model_path()
    ckpt = checkpoints.load_checkpoint(path, dtype=torch_dtype(args.dtype))
    draft = checkpoints.load_checkpoint(args.draft_model, dtype=torch_dtype(args.dtype)) if args.draft_model else None
    return run_speculative_bench(ckpt, checkpoints.load_tokenizer(path), args.backend, args.dtype, args.speculation_length,
                                 args.draft_layers, draft, gen_len=args.gen_lens[0], log=logger(args), fused=args.fused)


BENCHMARK = Benchmark(name="speculative", help="speculative decoding at batch 1: plain decode against self-speculation and a "
                      "draft model, same run", description=__doc__, add_arguments=add_arguments, run=run)
