"""``neuronfx bench prompt-lookup``: prompt-lookup (n-gram) speculation on an input-grounded
workload (:data:`~neuronfx.bench.grounded_prompts.GROUNDED_TASKS`: rewrite, fix code, extract
fields, whose answers copy spans of their prompts), batch 1, greedy, each answer ending at eos or
``--gen-len`` tokens. Decode tok/s (tokens after the first over the seconds after it, summed
over the tasks) of neuronfx without speculation and with ``speculative_method="ngram"`` (one
runtime: its speculate graphs off and on), and with ``--compare llama.cpp`` of llama.cpp without
and with its prompt lookup (llama-cpp-python's ``LlamaPromptLookupDecoding`` on the same .gguf
and token ids, the ``[bench]`` extra), in ``--rounds`` alternating rounds; each engine's figure
is its median round. Prints whether each speculating engine's tokens equal its plain run's."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import neuronfx
from neuronfx.bench.grounded_prompts import GROUNDED_TASKS
from neuronfx.bench.llama_cpp import import_llama_cpp
from neuronfx.bench.options import add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.rounds import alternate, median
from neuronfx.bench.speculative import chat_prompts
from neuronfx.bench.types import Benchmark
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inference import ACTIVATION_FORMATS, WEIGHT_FORMATS, InferenceConfig
from neuronfx.config.plan import make_plan
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import InputError
from neuronfx.io import checkpoints
from neuronfx.runtime.runtime import Runtime

Run = Callable[[], dict[str, Any]]  # one round over every task: {"tokens": [[ids]...], "decoded": int, "decode_s": float, ...}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, the engine, the lookup's parameters, --gen-len, --tasks, --rounds, --compare."""
    add_model(p)
    add_engine(p)
    add_threads(p)
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="float", help="neuronfx's weights (default float)")
    p.add_argument("--activation-format", choices=ACTIVATION_FORMATS, default="float",
                   help="neuronfx's activations in the quantized products (default float; int8 / auto: inductor only)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafts per step (vLLM's name; default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=3, metavar="N", help="shortest n-gram matched (default 3)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, metavar="M", help="longest n-gram matched (default 4)")
    p.add_argument("--gen-len", type=int, default=128, metavar="N", help="most tokens per answer (default 128; eos ends one)")
    p.add_argument("--tasks", type=int, default=len(GROUNDED_TASKS), metavar="N", help=f"the first N tasks (default all {len(GROUNDED_TASKS)})")
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="alternating rounds; medians reported (default 3)")
    p.add_argument("--compare", choices=["llama.cpp"], default=None, help="also llama.cpp without and with prompt lookup")


def task_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Chat-template token ids of the first ``count`` grounded tasks."""
    return chat_prompts(tokenizer, GROUNDED_TASKS[:count])


def neuronfx_round(runtime: Runtime, prompts: Sequence[list[int]], gen_len: int, speculative: bool) -> dict[str, Any]:
    """Every prompt through ``generate`` (greedy, eos stops) on a fresh state; tokens, decoded
    count (all but each first), decode seconds, and for speculation drafted / accepted / passes."""
    sampling = SamplingParams(max_tokens=gen_len)
    out: dict[str, Any] = {"tokens": [], "decoded": 0, "decode_s": 0.0, "drafted": 0, "accepted": 0, "passes": 0}
    for p in prompts:
        result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [p], sampling=sampling, speculative=speculative)
        out["tokens"].append(list(result.token_ids[0]))
        out["decoded"] += len(result.token_ids[0]) - 1
        out["decode_s"] += result.decode_s
        for s in result.speculation or ():
            out["drafted"], out["accepted"], out["passes"] = out["drafted"] + s.drafted, out["accepted"] + s.accepted, out["passes"] + s.target_passes
    return out


def llama_cpp_round(llm: Any, prompts: Sequence[list[int]], gen_len: int) -> dict[str, Any]:
    """Every prompt through llama-cpp-python's ``Llama.generate`` (temperature 0: greedy; a
    draft model attached to ``llm`` speculates), stopping at its eos or ``gen_len`` tokens."""
    out: dict[str, Any] = {"tokens": [], "decoded": 0, "decode_s": 0.0}
    eos = llm.token_eos()
    for p in prompts:
        tokens, first = [], 0.0
        for t in llm.generate(p, temp=0.0, reset=True):
            tokens.append(int(t))
            if len(tokens) == 1:
                first = time.perf_counter()
            if t == eos or len(tokens) == gen_len:
                break
        out["decode_s"] += time.perf_counter() - first
        out["tokens"].append(tokens)
        out["decoded"] += len(tokens) - 1
    return out


def engine_runs(rt: Runtime, llms: dict[str, Any], prompts: Sequence[list[int]], gen_len: int) -> dict[str, Run]:
    """One round of each engine over ``prompts``: neuronfx without and with prompt lookup, then
    each llama.cpp model of ``llms`` (:func:`llama_cpp_models`)."""
    runs: dict[str, Run] = {"neuronfx": functools.partial(neuronfx_round, rt, prompts, gen_len, False),
                            "neuronfx prompt lookup": functools.partial(neuronfx_round, rt, prompts, gen_len, True)}
    return runs | {name: functools.partial(llama_cpp_round, llm, prompts, gen_len) for name, llm in llms.items()}


def llama_cpp_models(gguf: str, prompts: Sequence[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """llama-cpp-python ``Llama`` models of ``gguf``: "llama.cpp" plain and "llama.cpp prompt
    lookup" with ``LlamaPromptLookupDecoding`` (``max_ngram_size`` = --prompt-lookup-max,
    ``num_pred_tokens`` = --num-speculative-tokens). BackendUnavailableError without the extra."""
    lib = import_llama_cpp()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    n_ctx = max(len(p) for p in prompts) + args.gen_len + args.num_speculative_tokens + 1
    threads = args.threads or neuronfx_threads()
    lookup = LlamaPromptLookupDecoding(max_ngram_size=args.prompt_lookup_max, num_pred_tokens=args.num_speculative_tokens)
    plain = lib.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    looked = lib.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, draft_model=lookup)
    return {"llama.cpp": plain, "llama.cpp prompt lookup": looked}


def neuronfx_threads() -> int:
    """torch's thread count (what neuronfx runs on), for llama.cpp's."""
    import torch

    return torch.get_num_threads()


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per engine: median decode tok/s over the rounds, speedup over its plain run and
    over neuronfx's, token equality with its plain run (first round), acceptance."""
    rows = []
    for name, rounds in runs.items():
        tok_s = median([r["decoded"] / r["decode_s"] for r in rounds])
        row: dict[str, Any] = {"engine": name, "decode_tok_s": tok_s, "rounds_tok_s": [r["decoded"] / r["decode_s"] for r in rounds]}
        if rounds[0].get("drafted"):
            row["acceptance_rate"] = rounds[0]["accepted"] / rounds[0]["drafted"]
            row["tokens_per_pass"] = rounds[0]["decoded"] / rounds[0]["passes"]  # passes: speculate and decode steps
        plain = name.replace(" prompt lookup", "")
        if plain != name and plain in runs:
            row["speedup_over_plain"] = tok_s / median([r["decoded"] / r["decode_s"] for r in runs[plain]])
            row["tokens_equal_plain"] = rounds[0]["tokens"] == runs[plain][0]["tokens"]
        rows.append(row)
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["vs_neuronfx"] = row["decode_tok_s"] / base
    return rows


def report(rows: Sequence[dict[str, Any]], log: Callable[[str], Any]) -> None:
    """The table: engine, decode tok/s, x its plain run, x neuronfx plain, acceptance, equal tokens."""
    log("| engine | decode tok/s (median) | x its plain run | x neuronfx plain | acceptance | tokens = plain |")
    log("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
        log(f"| {r['engine']} | {r['decode_tok_s']:.1f} | {r.get('speedup_over_plain', 1.0):.2f}x | {r['vs_neuronfx']:.2f}x | {acc} | "
            f"{r.get('tokens_equal_plain', '')} |")


def check_options(args: argparse.Namespace) -> None:
    """InputError for values below their limits, before anything loads."""
    check_at_least("num_speculative_tokens", args.num_speculative_tokens, 1)
    check_at_least("prompt_lookup_min", args.prompt_lookup_min, 1)
    check_at_least("gen_len", args.gen_len, 2)
    check_at_least("rounds", args.rounds, 1)
    if not 1 <= args.tasks <= len(GROUNDED_TASKS):
        raise InputError(f"--tasks={args.tasks} must be in [1, {len(GROUNDED_TASKS)}].")
    if args.prompt_lookup_max < args.prompt_lookup_min:
        raise InputError(f"--prompt-lookup-max={args.prompt_lookup_max} must be >= --prompt-lookup-min={args.prompt_lookup_min}.")


def ngram_runtime(path: str, prompts: Sequence[list[int]], args: argparse.Namespace, log: Callable[[str], Any]) -> Runtime:
    """The neuronfx runtime of the run: batch 1, speculate graphs for k = K + 1, prompt lookup."""
    ckpt = checkpoints.load_checkpoint(path, dtype=torch_dtype(args.dtype), gguf_blocks=args.weight_format == "gguf")
    longest, k = max(len(p) for p in prompts), args.num_speculative_tokens + 1
    inference = InferenceConfig(batch_size=1, max_context_length=longest, sequence_length=longest + args.gen_len + k,
                                dtype=args.dtype, backend=args.backend, weight_format=args.weight_format,
                                activation_format=args.activation_format, speculation_length=k,
                                speculative_method="ngram", prompt_lookup_min=args.prompt_lookup_min,
                                prompt_lookup_max=args.prompt_lookup_max)
    return neuronfx.compile(make_plan(ckpt.config, inference), ckpt.state_dict, progress=log is print)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the options, compile, run the rounds, print the table."""
    check_options(args)
    set_threads(args.threads)
    log = logger(args)
    path = args.model or checkpoints.default_model_path()
    if args.compare == "llama.cpp" and not str(path).endswith(".gguf"):
        raise InputError(f"--compare llama.cpp reads a .gguf file; --model {path!r} is not one.")
    prompts = task_prompts(checkpoints.load_tokenizer(path), args.tasks)
    rt = ngram_runtime(path, prompts, args, log)
    llms = llama_cpp_models(str(path), prompts, args) if args.compare == "llama.cpp" else {}
    for r in engine_runs(rt, llms, prompts[:1], 8).values():  # warm-up: every engine's first calls
        r()
    rows = summarize(alternate(engine_runs(rt, llms, prompts, args.gen_len), args.rounds))
    report(rows, log)
    return {"tasks": args.tasks, "gen_len": args.gen_len, "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max, "rounds": args.rounds,
            "backend": args.backend, "dtype": args.dtype, "weight_format": args.weight_format,
            "activation_format": args.activation_format, "rows": rows}


BENCHMARK = Benchmark(name="prompt-lookup", help="prompt-lookup speculation on input-grounded tasks: neuronfx with and without "
                      "it (and llama.cpp's), same run", description=__doc__, add_arguments=add_arguments, run=run)
