"""``neuronfx bench kv-blocks``: the blocks KV layout against the slots layout, every figure in one run.

1. Capacity: one KV memory budget (``--slots`` slots of ``--sequence-length`` positions: what
   the slots layout holds), a mixed workload of ``--requests`` seeded requests (prompt and
   output lengths log-uniform in ``--prompt-lens`` and ``--output-lens``, greedy, eos ignored)
   through the reference scheduler on each layout: the peak number of running requests, output
   tok/s (generated tokens over the wall time of the whole schedule), preemptions, and whether
   every output equals the other layout's and, for the first ``--solo`` requests, its lone run.
   Targets: peak running >= 4x the slots layout's, output tok/s higher.
2. Decode speed: ITL p50 of greedy decoding at batch 1 and 8 (``--prompt-tokens`` prompts,
   ``--gen-tokens`` tokens) on each layout, ``--rounds`` alternating rounds. Target: the blocks
   layout within 5% of slots.

The blocks layout's runtime holds ``--max-num-seqs`` request slots (its batch size, compiled
at ``--batch-buckets`` rows, by default the plan's 1, 2, 4, ...) and ``--slots x
--sequence-length / --block-size`` blocks; both layouts chunk prompts at ``--chunk`` tokens (the
blocks layout recomputes preempted requests through the chunk graphs) and store the KV cache in
``--kv-cache-dtype``. ``--slots`` and ``--max-num-seqs`` are at least 8 (figure 2's batch)."""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any

import neuronfx
from neuronfx.bench.options import Log, add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.rounds import ab_rounds, format_ab, median
from neuronfx.bench.types import Benchmark
from neuronfx.bench.workload import check_range, random_ids
from neuronfx.config.inference import ACTIVATION_FORMATS, WEIGHT_FORMATS
from neuronfx.config.kv import KV_CACHE_DTYPES, canonical_kv_cache_dtype
from neuronfx.errors import InputError
from neuronfx.io import checkpoints
from neuronfx.runtime.requests import Queue, submit
from neuronfx.runtime.scheduler import step

NO_EOS: frozenset[int] = frozenset()
DECODE_ROWS = (1, 8)
"""Batch sizes of figure 2 (decode speed)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --threads, the budget, the workload and the rounds."""
    add_model(p)
    add_engine(p, backend="inductor")
    add_threads(p)
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="float", help="weights of both plans (default float)")
    p.add_argument("--activation-format", choices=ACTIVATION_FORMATS, default="float",
                   help="int8 activations of quantized weights: float (default), int8 or auto (inductor)")
    p.add_argument("--slots", type=int, default=8, help="the KV budget: slots of the slots layout (default 8)")
    p.add_argument("--sequence-length", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16, help="kv_block_size of the blocks layout (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="request slots of the blocks layout (default 64)")
    p.add_argument("--batch-buckets", type=int, nargs="+", default=None, metavar="ROWS",
                   help="compiled batch sizes of the blocks layout, ending at --max-num-seqs (default 1, 2, 4, ... as the plan's)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, type=canonical_kv_cache_dtype, default="auto",
                   help="KV cache dtype of both layouts (default auto: the plan's dtype)")
    p.add_argument("--chunk", type=int, default=256, help="prefill_chunk_size of both layouts (default 256)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 1500), metavar=("MIN", "MAX"))
    p.add_argument("--output-lens", type=int, nargs=2, default=(16, 400), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--solo", type=int, default=4, help="requests also run alone, their outputs compared (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="decode-speed prompts (default 128)")
    p.add_argument("--gen-tokens", type=int, default=64, help="decode-speed tokens per row (default 64)")
    p.add_argument("--rounds", type=int, default=4, help="decode-speed rounds, the layouts alternating (default 4)")


def log_uniform(rng: random.Random, bounds: tuple[int, int]) -> int:
    """An int in [lo, hi] whose log is uniform: many short, some long (chat traffic's shape)."""
    lo, hi = bounds
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def workload(args: argparse.Namespace, vocab: int) -> list[neuronfx.Request]:
    """``--requests`` seeded greedy requests (eos ignored) of log-uniform prompt and output lengths."""
    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        n, gen = log_uniform(rng, args.prompt_lens), log_uniform(rng, args.output_lens)
        out.append(neuronfx.Request(prompt=tuple(random_ids(vocab, n, args.seed * 100_003 + i)),
                                    sampling=neuronfx.SamplingParams(max_tokens=gen, ignore_eos=True)))
    return out


def serve(runtime: neuronfx.Runtime, requests: list[neuronfx.Request]) -> dict[str, Any]:
    """Schedule ``requests`` to completion: outputs, peak running, preemptions, output tok/s."""
    state, queue, peak, outputs = neuronfx.init_state(runtime), Queue(), 0, {}
    for i, r in enumerate(requests):
        queue = submit(queue, i, r)
    t0 = time.perf_counter()
    while not queue.idle:
        events, state, queue = step(runtime, state, queue, NO_EOS)
        peak = max(peak, len(queue.running) + len(queue.prefilling))
        for e in events:
            outputs.setdefault(e.index, []).append(e.token_id)
    seconds = time.perf_counter() - t0
    generated = sum(len(v) for v in outputs.values())
    return {"outputs": [outputs[i] for i in range(len(requests))], "peak_running": peak, "preemptions": queue.preemptions,
            "seconds": seconds, "output_tok_s": generated / seconds, "generated": generated}


def compile_layouts(ckpt: Any, args: argparse.Namespace, log: Log) -> dict[str, neuronfx.Runtime]:
    """The two runtimes: the same plan but the KV layout (and the blocks layout's request slots
    and batch buckets)."""
    blocks = args.slots * args.sequence_length // args.block_size
    base = dict(backend=args.backend, dtype=args.dtype, max_context_length=args.sequence_length,
                sequence_length=args.sequence_length, prefill_chunk_size=args.chunk, weight_format=args.weight_format,
                activation_format=args.activation_format, kv_cache_dtype=args.kv_cache_dtype)
    sides = {"slots": dict(batch_size=args.slots),
             "blocks": dict(batch_size=args.max_num_seqs, kv_layout="blocks", kv_block_size=args.block_size, num_kv_blocks=blocks,
                            batch_buckets=tuple(args.batch_buckets) if args.batch_buckets else None)}
    # both plans first: a bad option is a ConfigError before minutes of compiling the other layout
    plans = {name: neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(**base, **options)) for name, options in sides.items()}
    runtimes = {}
    for name, plan in plans.items():
        t0 = time.perf_counter()
        runtimes[name] = neuronfx.compile(plan, ckpt.state_dict, progress=False)
        log(f"compiled {name}: {time.perf_counter() - t0:.0f} s, KV cache {plan.kv.nbytes / 2**20:.0f} MiB {plan.kv.shape}")
    return runtimes


def capacity(runtimes: dict[str, neuronfx.Runtime], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Figure 1: each layout's schedule of the workload, and the output checks."""
    requests = workload(args, vocab)
    runs = {name: serve(rt, requests) for name, rt in runtimes.items()}
    solo = [serve(runtimes["blocks"], [r])["outputs"][0] for r in requests[:args.solo]]
    return {name: {k: v for k, v in run.items() if k != "outputs"} for name, run in runs.items()} | {
        "same_outputs": runs["slots"]["outputs"] == runs["blocks"]["outputs"],
        "solo_equal": solo == runs["blocks"]["outputs"][:args.solo],
        "prompt_tokens": sum(len(r.prompt) for r in requests), "blocks_batch_buckets": list(runtimes["blocks"].plan.batch_buckets),
        "kv_dtypes": {name: rt.plan.kv.dtype for name, rt in runtimes.items()}}


def decode_speed(runtimes: dict[str, neuronfx.Runtime], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Figure 2: ITL p50 per round at batch 1 and 8, the layouts alternating."""
    out = {}
    for b in DECODE_ROWS:
        prompts = [random_ids(vocab, args.prompt_tokens, 7 + i) for i in range(b)]
        out[b] = ab_rounds({"slots": runtimes["slots"], "blocks": runtimes["blocks"]}, prompts, args.gen_tokens, args.rounds)
    return out


def report(cap: dict[str, Any], speed: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> list[str]:
    """The figures as lines, each target marked met or not."""
    s, b = cap["slots"], cap["blocks"]
    peak_x, tok_x = b["peak_running"] / s["peak_running"], b["output_tok_s"] / s["output_tok_s"]
    lines = [f"capacity: {args.requests} requests, prompts {args.prompt_lens[0]}-{args.prompt_lens[1]} and outputs "
             f"{args.output_lens[0]}-{args.output_lens[1]} tokens (log-uniform, seed {args.seed}; {cap['prompt_tokens']} prompt "
             f"tokens), KV budget {args.slots} x {args.sequence_length} positions ({args.kv_cache_dtype}), {args.backend} "
             f"{args.dtype}, weights {args.weight_format}, activations {args.activation_format}, batch buckets of the blocks "
             f"layout {cap['blocks_batch_buckets']}:"]
    for name, run in (("slots", s), ("blocks", b)):
        lines.append(f"  {name:6s} peak running {run['peak_running']:3d}, output {run['output_tok_s']:7.1f} tok/s "
                     f"({run['generated']} tokens in {run['seconds']:.1f} s), preemptions {run['preemptions']}")
    lines += [f"  peak running blocks / slots {peak_x:.2f}x (target >= 4x: {'met' if peak_x >= 4 else 'NOT met'}); output tok/s "
              f"{tok_x:.2f}x (target > 1x: {'met' if tok_x > 1 else 'NOT met'})",
              f"  outputs equal across layouts: {cap['same_outputs']}; the first {args.solo} equal to their lone runs: "
              f"{cap['solo_equal']}"]
    for rows, itl in speed.items():
        lines += format_ab(f"decode batch {rows}:", itl, "blocks", "slots")
        ratio = median([x / y for x, y in zip(itl["blocks"], itl["slots"])])
        lines.append(f"  batch {rows}: blocks ITL {ratio:.3f}x slots (target <= 1.05x: {'met' if ratio <= 1.05 else 'NOT met'})")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the options, compile both layouts, measure both figures."""
    for name in ("slots", "sequence_length", "block_size", "max_num_seqs", "chunk", "requests", "prompt_tokens", "gen_tokens",
                 "rounds"):
        check_at_least(name, getattr(args, name), 1)
    check_at_least("solo", args.solo, 0)
    for name in ("slots", "max_num_seqs"):
        if getattr(args, name) < DECODE_ROWS[-1]:
            raise InputError(f"--{name.replace('_', '-')}={getattr(args, name)} is below {DECODE_ROWS[-1]}: figure 2 decodes "
                             f"batch {DECODE_ROWS[-1]} on both layouts; raise it to at least {DECODE_ROWS[-1]}.")
    if args.batch_buckets and args.batch_buckets[-1] != args.max_num_seqs:
        raise InputError(f"--batch-buckets ends at {args.batch_buckets[-1]}; the blocks layout's largest batch bucket is its "
                         f"batch size --max-num-seqs={args.max_num_seqs}: end the list there or change --max-num-seqs.")
    check_range("prompt-lens", args.prompt_lens, 1)
    check_range("output-lens", args.output_lens, 1)
    set_threads(args.threads)
    log = logger(args)
    ckpt = checkpoints.load_checkpoint(args.model or checkpoints.default_model_path())
    runtimes = compile_layouts(ckpt, args, log)
    vocab = ckpt.config.vocab_size
    cap = capacity(runtimes, args, vocab)
    speed = decode_speed(runtimes, args, vocab)
    for line in report(cap, speed, args):
        log(line)
    return {"capacity": cap, "decode_itl_s": speed}


BENCHMARK = Benchmark(name="kv-blocks", help="the blocks KV layout against slots: requests served at once under one KV budget, "
                      "output tok/s, preemptions, decode speed", description=__doc__, add_arguments=add_arguments, run=run)
