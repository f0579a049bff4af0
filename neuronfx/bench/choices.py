"""``neuronfx bench choices``: n choices of one prompt (OpenAI's ``n``), forked against
prefilled, one run.

One plan (batch size n, the default model: SmolLM2). One prompt of --prompt-len random ids runs
n seeded choices through ``generate``: "fork" with ``n=n`` (one prefill, the other choices copy
its KV and decode its last token: ``runtime/fork.py``), "prefill" as n separate requests with
the same seeds (seed + c, one prefill step of n rows). The two alternate for --rounds rounds
after one warm-up of each. Reported per mode (median round): the seconds until every choice has
its first token (prefill and fork steps), decode tok/s, and whether both gave the same tokens
(they must: choice c samples as the request with seed + c)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

import neuronfx
from neuronfx.bench.options import add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.rounds import alternate, median
from neuronfx.bench.types import Benchmark
from neuronfx.io import checkpoints

SEED = 11


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --threads, -n, --prompt-len, --gen-len and --rounds."""
    add_model(p)
    add_engine(p, backend="inductor")
    add_threads(p)
    p.add_argument("-n", type=int, default=4, help="choices of the prompt (default 4; the plan's batch size)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens per choice (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="measured runs per mode, alternating (default 3)")


def run_once(runtime: neuronfx.Runtime, prompt: list[int], n: int, gen_len: int, fork: bool) -> dict[str, Any]:
    """The n choices, forked (``generate(n=n)``) or as n requests: first-token seconds, decode tok/s, tokens."""
    sampling = neuronfx.SamplingParams(temperature=1.0, seed=SEED, max_tokens=gen_len, ignore_eos=True)
    if fork:
        result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [prompt], sampling=sampling, n=n)
    else:
        each = [neuronfx.SamplingParams(temperature=1.0, seed=SEED + c, max_tokens=gen_len, ignore_eos=True) for c in range(n)]
        result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [prompt] * n, sampling=each)
    return {"first_token_s": result.prefill_s, "decode_tok_s": (result.num_generated - n) / result.decode_s,
            "tokens": [list(t) for t in result.token_ids]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compile one plan of batch size n, warm both modes up, alternate them for --rounds rounds."""
    for name in ("n", "prompt_len", "gen_len", "rounds"):
        check_at_least(name, getattr(args, name), 2 if name in ("n", "gen_len") else 1)
    set_threads(args.threads)
    ckpt = checkpoints.load_checkpoint(args.model or checkpoints.default_model_path())
    inference = neuronfx.InferenceConfig(batch_size=args.n, max_context_length=args.prompt_len,
                                         sequence_length=args.prompt_len + args.gen_len, backend=args.backend, dtype=args.dtype)
    runtime = neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    prompt = torch.randint(3, ckpt.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    modes = {"fork": lambda: run_once(runtime, prompt, args.n, args.gen_len, True),
             "prefill": lambda: run_once(runtime, prompt, args.n, args.gen_len, False)}
    for mode in modes.values():
        mode()  # warm-up
    return report(args, alternate(modes, args.rounds))


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The figures of ``runs`` (each mode's rounds), logged and returned."""
    out: dict[str, Any] = {name: {"first_token_ms": 1e3 * median([r["first_token_s"] for r in rs]),
                                  "decode_tok_s": median([r["decode_tok_s"] for r in rs])} for name, rs in runs.items()}
    out["first_token_ratio"] = median([f["first_token_s"] / p["first_token_s"] for f, p in zip(runs["fork"], runs["prefill"])])
    out["same_tokens"] = all(f["tokens"] == p["tokens"] for f, p in zip(runs["fork"], runs["prefill"]))
    log = logger(args)
    for name in ("fork", "prefill"):
        log(f"{name:>7}: every choice's first token after {out[name]['first_token_ms']:.1f} ms, {out[name]['decode_tok_s']:.1f} "
            f"decode tok/s (median of {len(runs[name])} rounds; n={args.n}, prompt {args.prompt_len} tokens)")
    log(f"fork / prefill first-token time: {out['first_token_ratio']:.3f}x (median same-round ratio); tokens "
        f"{'identical' if out['same_tokens'] else 'DIFFER'}")
    return out


BENCHMARK = Benchmark(name="choices", help="n choices of one prompt: one prefill and KV copies (fork) against n prefills",
                      description=__doc__, add_arguments=add_arguments, run=run)
