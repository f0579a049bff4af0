"""The misuse catalogue (docs/misuse.md): one test per case, on a tiny llama (eager).

Every case runs while a state holds two live requests (slots 0 and 2; slots 1 and 3 free). It
must raise exactly its named error, with a message naming the offending value, the limit and the
fix, and leave that state untouched: same host counts and KV cache, not consumed, and continuing
the live requests gives the tokens of a control run that never saw the bad call.

``python tests/test_misuse.py`` prints the catalogue table for docs/misuse.md.

Plan: batch_size 4 (slots 0-3, scratch slot 4), prefill buckets (8, 16, 32), decode buckets
(16, 32, 64), max_context_length 32, sequence_length 64, vocab 256, max_topk 256, max_logprobs 20.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from helpers import GREEDY, TINY, VOCAB, byte_tokenizer, kv_tensors, random_prompt, tiny_hf_model, tiny_runtime
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Gemma3Config, Gemma3TextConfig, GPT2Config, Llama4Config, LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

import neuronfx
from neuronfx import DecodeBatch, InferenceConfig, ModelConfig, PrefillBatch, Request, SamplingParams, StructuredOutputs, make_plan
from neuronfx.bench.accuracy import check_accuracy, reference_model
from neuronfx.bench.serving_client import ServingRequest, bench_server, parse_server, text_workload
from neuronfx.bench.workload import check_range
from neuronfx.cli.chat import ChatOptions, chat_loop
from neuronfx.config import RopeScaling, plan_from_json, structure
from neuronfx.errors import (
    ArtifactError,
    BatchTooLargeError,
    CheckpointError,
    ConfigError,
    EmptyPromptError,
    InputError,
    PromptTooLongError,
    SamplingParamsError,
    SequenceLengthExceededError,
    SlotError,
    StateConsumedError,
    StateMismatchError,
    TokenOutOfVocabError,
    UnsupportedModelError,
)
from neuronfx.io.checkpoints import load_checkpoint
from neuronfx.runtime.overlap import finish, overlap_step
from neuronfx.runtime.prefix import load_prefix
from neuronfx.runtime.scheduler import Queue, abort, submit

DOC = Path(__file__).resolve().parents[1] / "docs" / "misuse.md"
LIVE_PROMPTS = {0: random_prompt(7, seed=50), 2: random_prompt(12, seed=51)}
CONTINUE = 4  # tokens each live request decodes after the bad call


@attrs.frozen
class Case:
    """One catalogue row: how it is triggered (``call(ctx)``), the error and what the message names."""

    error: type[Exception]
    trigger: str  # for the docs table
    call: Callable[[Any], object]
    names: tuple[str, ...]  # substrings the message must contain: value, limit, fix


@attrs.define
class Ctx:
    """What a case may use: the runtime, the live state, a consumed state and lazy extras."""

    rt: neuronfx.Runtime
    hf: Any
    state: neuronfx.State
    consumed: neuronfx.State
    tmp: Path
    extras: dict[str, Any]


def P(seq_ids, prompts, sampling=None):
    return PrefillBatch(seq_ids=seq_ids, prompts=prompts, sampling=sampling or [GREEDY] * len(prompts))


def D(seq_ids, input_ids, sampling=None):
    return DecodeBatch(seq_ids=seq_ids, input_ids=input_ids, sampling=sampling or [GREEDY] * len(input_ids))


def prefill(c, batch):
    return neuronfx.prefill_step(c.rt, c.state, batch)


def decode(c, batch):
    return neuronfx.decode_step(c.rt, c.state, batch)


def gen(c, ids, n=4, **kw):
    return neuronfx.generate(c.rt, c.state, ids, max_new_tokens=n, **kw)


def bad_sampling(c, sp, step="prefill"):
    if step == "prefill":
        return prefill(c, P([1], [[1, 2]], [sp]))
    return decode(c, D([0], [1], [sp]))


def model_config(**overrides):
    fields = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6)
    return ModelConfig(**(fields | overrides))


def _hf_rope(rope_parameters: dict) -> LlamaConfig:
    with warnings.catch_warnings():  # transformers warns about the keys neuronfx refuses
        warnings.simplefilter("ignore")
        return LlamaConfig(**TINY, rope_parameters=rope_parameters)


def inference(**overrides):
    return InferenceConfig(**({"batch_size": 4, "max_context_length": 32, "sequence_length": 64} | overrides))


def hf_dir(c, name: str) -> Path:
    """A saved copy of the tiny HF checkpoint, one per case."""
    directory = c.tmp / name
    c.hf.save_pretrained(directory)
    return directory


def truncated_checkpoint(c) -> Path:
    directory = hf_dir(c, "truncated")
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    return directory


def unsupported_checkpoint(c) -> Path:
    directory = c.tmp / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return directory


def state_dict(c, drop=(), add=None, replace=None):
    sd = {k: v for k, v in c.hf.state_dict().items() if k not in drop}
    return sd | (add or {}) | (replace or {})


def compile_with(c, sd):
    return neuronfx.compile(c.rt.plan, sd, progress=False)


def compile_with_env(c, **env):
    """Compile the plan on the inductor backend with ``env`` set (restored after)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        plan = make_plan(c.rt.plan.model, attrs.evolve(c.rt.plan.inference, backend="inductor"))
        return neuronfx.compile(plan, c.hf.state_dict(), progress=False)


def artifact(c, damage: Callable[[Path], None]) -> Path:
    directory = c.tmp / "saved"
    shutil.copytree(c.extras["saved"], directory)
    damage(directory)
    return directory


def flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def full_slot_state(c):
    """A state whose slot 0 holds sequence_length (64) tokens: prompt 32 + 32 decodes."""
    out, state = neuronfx.prefill_step(c.rt, neuronfx.init_state(c.rt), P([0], [random_prompt(32, seed=9)]))
    token = out.tokens[0]
    for _ in range(32):
        out, state = neuronfx.decode_step(c.rt, state, D([0], [token]))
        token = out.tokens[0]
    return state, token


def decode_full_slot(c):
    state, token = full_slot_state(c)
    return neuronfx.decode_step(c.rt, state, D([0], [token]))


def all_slots_live(c):
    _, state = neuronfx.prefill_step(c.rt, neuronfx.init_state(c.rt), P([0, 1, 2, 3], [[1], [2], [3], [4]]))
    return neuronfx.generate(c.rt, state, [[5, 6]], max_new_tokens=2)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def word_tokenizer():
    """Word-level tokenizer over the tiny vocab: token i is the word "w{i}"; unknown words -> w0."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def speculate(c, batch=None, rt=None):
    batch = batch or neuronfx.SpeculateBatch(seq_ids=[0], input_ids=[1], sampling=[GREEDY])
    return neuronfx.speculate_step(rt or c.rt, c.state, batch)


def finish_twice(c):
    """finish of one Pending twice (an overlapped prefill on its own state)."""
    queue = submit(Queue(), 0, request([1, 2]), runtime=c.rt)
    _, pending, _ = overlap_step(c.rt, neuronfx.init_state(c.rt), queue, frozenset())
    finish(pending)
    return finish(pending)


def speculating_runtime(c, **overrides):
    """The tiny runtime with speculate graphs (k = 4) and self-draft graphs, eager."""
    return tiny_runtime(c.hf, speculation_length=4, draft_layers=1, **overrides)


def speculate_live(c, batch):
    """speculate_step on a speculating runtime whose slot 0 is live (its own state)."""
    rt = speculating_runtime(c)
    _, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt), P([0], [[5, 6, 7]]))
    return neuronfx.speculate_step(rt, state, batch)


def speculate_ngram(c, history):
    """speculate_step on a prompt-lookup runtime whose slot 0 is live (its own state), with ``history``."""
    rt = tiny_runtime(c.hf, speculation_length=4, speculative_method="ngram")
    out, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt), P([0], [[5, 6, 7]]))
    batch = neuronfx.SpeculateBatch(seq_ids=[0], input_ids=out.tokens, sampling=[GREEDY], history=history)
    return neuronfx.speculate_step(rt, state, batch)


def speculate_full(c):
    """speculate_step on a slot whose cache has room for fewer than k = 4 more tokens."""
    rt = speculating_runtime(c)
    out, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt), P([0], [random_prompt(32, seed=9)]))
    token = out.tokens[0]
    for _ in range(29):  # 32 + 29 = 61 tokens: 61 + 4 > sequence_length 64
        out, state = neuronfx.decode_step(rt, state, D([0], [token]))
        token = out.tokens[0]
    return neuronfx.speculate_step(rt, state, neuronfx.SpeculateBatch(seq_ids=[0], input_ids=[token], sampling=[GREEDY]))


def runtime_without_logits(c):
    """The tiny runtime compiled with output_logits=False, built once for the cases that use it."""
    if "no-logits" not in c.extras:
        c.extras["no-logits"] = tiny_runtime(c.hf, output_logits=False, on_device_sampling=True)
    return c.extras["no-logits"]


def draft_without_logits(c):
    return neuronfx.with_draft(speculating_runtime(c), runtime_without_logits(c))


def suppressing_reference(c):
    """check_accuracy against a reference (the tiny model's copy) whose generation config
    suppresses the token its raw logits pick first."""
    ref = reference_model(c.hf.config, c.hf.state_dict())
    ref.generation_config.suppress_tokens = [int(ref(torch.tensor([[1, 2]])).logits[0, -1].argmax())]
    return check_accuracy(c.rt, ref, prompts=[[1, 2]], max_new_tokens=2)


def graph_call(c, phase, bsz, bucket, inputs):
    from neuronfx.runtime.batch import call_graph

    return call_graph(c.rt, c.state.kv, phase, bsz, bucket, inputs)


def graph_input_of_wrong_shape(c):
    """A decode graph called with a step-input record whose input_ids are (1, 2), not (1, 1)."""
    from neuronfx.config.inputs import DecodeInputs
    from neuronfx.runtime.batch import call_graph

    spec = c.rt.plan.graph("decode", 1, 16)
    good = neuronfx.graphs.phases.inputs.example_inputs(c.rt.plan, spec)
    bad = DecodeInputs(input_ids=torch.zeros(1, 2, dtype=torch.int32), position_ids=good.position_ids,
                       seq_ids=good.seq_ids, block_table=good.block_table, sampler=good.sampler)
    return call_graph(c.rt, c.state.kv, "decode", 1, 16, bad)


def chunking_runtime(c):
    """The tiny runtime with prefill_chunk_size=8 (prefill bucket 8, chunk graphs), built once."""
    if "chunking" not in c.extras:
        c.extras["chunking"] = tiny_runtime(c.hf, prefill_chunk_size=8, prefill_buckets=None)
    return c.extras["chunking"]


def chunk(c, chunks, final=None, rt=None):
    batch = neuronfx.ChunkBatch(seq_ids=[1], chunks=chunks, sampling=[GREEDY], final=final or [True])
    rt = rt or chunking_runtime(c)
    return neuronfx.chunk_step(rt, neuronfx.init_state(rt) if rt is not c.rt else c.state, batch)


def request(prompt, max_tokens=4, sampling=GREEDY):
    return Request(prompt=tuple(prompt), sampling=attrs.evolve(sampling, max_tokens=max_tokens))


MAX_SEED = 2**63 - 1
SP = SamplingParams
SO = StructuredOutputs


def byte_tok(c):
    return c.extras["byte_tokenizer"]

CASES: dict[str, Case] = {
    # --- configs and plans ----------------------------------------------------------------------
    "config-batch-size-zero": Case(ConfigError, "`InferenceConfig(batch_size=0)`",
                                   lambda c: inference(batch_size=0), ("batch_size=0", ">= 1")),
    "config-bool-as-count": Case(ConfigError, "`InferenceConfig(sequence_length=True)`",
                                 lambda c: inference(sequence_length=True), ("sequence_length=True", "positive int")),
    "config-context-over-sequence": Case(ConfigError, "`max_context_length=128` with `sequence_length=64`",
                                         lambda c: inference(max_context_length=128),
                                         ("max_context_length=128", "sequence_length=64", "lower max_context_length")),
    "config-buckets-unsorted": Case(ConfigError, "`prefill_buckets=(16, 8, 32)`",
                                    lambda c: inference(prefill_buckets=(16, 8, 32)),
                                    ("(16, 8, 32)", "strictly increasing", "sort it")),
    "config-buckets-short-of-limit": Case(ConfigError, "`decode_buckets=(16, 32)` with `sequence_length=64`",
                                          lambda c: inference(decode_buckets=(16, 32)),
                                          ("ends at 32", "sequence_length=64", "append 64")),
    "config-unknown-dtype": Case(ConfigError, "`InferenceConfig(dtype=\"int8\")`",
                                 lambda c: inference(dtype="int8"), ("'int8'", "'float32'", "pick one")),
    "config-unknown-backend": Case(ConfigError, "`InferenceConfig(backend=\"tpu\")`",
                                   lambda c: inference(backend="tpu"), ("'tpu'", "'inductor'", "pick one")),
    "config-no-graph-output": Case(ConfigError, "`on_device_sampling=False, output_logits=False` (contradictory)",
                                   lambda c: inference(on_device_sampling=False, output_logits=False),
                                   ("on_device_sampling=False", "output_logits=False", "set one of them")),
    "config-draft-without-speculation": Case(ConfigError, "`draft_layers=1` with `speculation_length=0`",
                                             lambda c: inference(draft_layers=1),
                                             ("draft_layers=1", "speculation_length >= 2", "set both")),
    "config-speculation-length-one": Case(ConfigError, "`speculation_length=1`",
                                          lambda c: inference(speculation_length=1),
                                          ("speculation_length=1", "[2, sequence_length - 1 = 63]")),
    "config-speculation-length-whole-cache": Case(ConfigError, "`speculation_length=64` with `sequence_length=64` (no room after a prompt)",
                                                  lambda c: inference(speculation_length=64),
                                                  ("speculation_length=64", "[2, sequence_length - 1 = 63]")),
    "config-speculative-method-unknown": Case(ConfigError, "`speculative_method=\"eagle\"`",
                                              lambda c: inference(speculation_length=4, speculative_method="eagle"),
                                              ("speculative_method='eagle'", "'ngram'")),
    "config-ngram-without-speculation": Case(ConfigError, "`speculative_method=\"ngram\"` with `speculation_length=0`",
                                             lambda c: inference(speculative_method="ngram"),
                                             ("speculative_method='ngram'", "speculation_length=k >= 2")),
    "config-ngram-with-draft-layers": Case(ConfigError, "`speculative_method=\"ngram\"` with `draft_layers=1`",
                                           lambda c: inference(speculation_length=4, speculative_method="ngram", draft_layers=1),
                                           ("draft_layers=1", "drop draft_layers")),
    "config-fused-speculation-with-ngram": Case(ConfigError, "`fused_speculation=True` with `speculative_method=\"ngram\"`",
                                                lambda c: inference(speculation_length=4, speculative_method="ngram",
                                                                    fused_speculation=True),
                                                ("fused_speculation=True", "speculative_method=None (got 'ngram')")),
    "config-prompt-lookup-min-over-max": Case(ConfigError, "`prompt_lookup_min=5` with `prompt_lookup_max=4`",
                                              lambda c: inference(prompt_lookup_min=5),
                                              ("prompt_lookup_min=5", "prompt_lookup_max=4", "lower prompt_lookup_min")),
    "config-prefix-caching-with-speculation": Case(ConfigError, "`enable_prefix_caching=True` with `speculation_length=4`",
                                                   lambda c: inference(enable_prefix_caching=True, speculation_length=4),
                                                   ("enable_prefix_caching=True", "speculation_length=4", "drop one of them")),
    "config-prefix-block-not-dividing-chunk": Case(ConfigError, "`prefix_block_size=6` with `prefill_chunk_size=16`",
                                                   lambda c: inference(enable_prefix_caching=True, prefill_chunk_size=16,
                                                                       prefix_block_size=6),
                                                   ("prefix_block_size=6", "prefill_chunk_size=16", "pick a divisor of 16")),
    "config-prefix-block-whole-context": Case(ConfigError, "`prefix_block_size=32` with `max_context_length=32`",
                                              lambda c: inference(enable_prefix_caching=True, prefill_chunk_size=32,
                                                                  prefix_block_size=32),
                                              ("prefix_block_size=32", "max_context_length=32", "lower prefix_block_size")),
    "config-prefix-blocks-zero": Case(ConfigError, "`max_prefix_blocks=0`",
                                      lambda c: inference(max_prefix_blocks=0), ("max_prefix_blocks=0", ">= 1")),
    "plan-prefix-caching-length-dependent-rope": Case(
        ConfigError, "`enable_prefix_caching=True`, dynamic RoPE past `max_position_embeddings=16`, `max_context_length=32`",
        lambda c: make_plan(model_config(max_position_embeddings=16, rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0)),
                            inference(enable_prefix_caching=True, prefill_chunk_size=8, prefix_block_size=4)),
        ("rope_type='dynamic'", "max_context_length=32 > 16", "lower max_context_length to 16")),
    "prefix-load-without-cache": Case(InputError, "`load_prefix` on a runtime compiled without prefix caching",
                                      lambda c: load_prefix(c.rt, c.state, [1], [[1, 2]]),
                                      ("does not cache prefixes", "enable_prefix_caching=True")),
    "config-buckets-not-a-list": Case(ConfigError, "`InferenceConfig(prefill_buckets=16)`",
                                      lambda c: inference(prefill_buckets=16), ("prefill_buckets=16", "list of bucket sizes", "e.g. [16]")),
    "config-json-unknown-key": Case(ConfigError, "JSON config with an unknown key `bogus`",
                                    lambda c: structure({"batch_size": 4, "bogus": 1}, InferenceConfig),
                                    ("bogus", "remove them")),
    "config-json-wrong-type": Case(ConfigError, "JSON config with `\"batch_size\": \"4\"`",
                                   lambda c: structure({"batch_size": "4"}, InferenceConfig),
                                   ("'4'", "expected int")),
    "config-plan-json-corrupt": Case(ConfigError, "`plan_from_json` of text that is not JSON",
                                     lambda c: plan_from_json("{not json"), ("does not parse", "line 1", "plan_to_json")),
    "model-unsupported-type": Case(UnsupportedModelError, "`ModelConfig.from_hf` of a GPT-2 config",
                                   lambda c: ModelConfig.from_hf(GPT2Config()),
                                   ("model_type='gpt2'", "supported: llama, mistral, qwen2, qwen3")),
    "model-unsupported-activation": Case(UnsupportedModelError, "llama config with `hidden_act=\"gelu\"`",
                                         lambda c: ModelConfig.from_hf(LlamaConfig(**TINY, hidden_act="gelu")),
                                         ("hidden_act='gelu'", "only 'silu'")),
    "model-rope-unknown-key": Case(UnsupportedModelError, "llama `rope_parameters` of type yarn with a key yarn does not read",
                                   lambda c: ModelConfig.from_hf(_hf_rope({"rope_type": "yarn", "factor": 2.0,
                                                                            "original_max_position_embeddings": 128,
                                                                            "low_freq_factor": 1.0})),
                                   ("['low_freq_factor']", "rope_type='yarn'", "remove them")),
    "model-partial-rotary-on-llama": Case(UnsupportedModelError, "llama config with `partial_rotary_factor=0.5`",
                                          lambda c: ModelConfig.from_hf(_hf_rope({"rope_type": "default",
                                                                                   "partial_rotary_factor": 0.5})),
                                          ("partial_rotary_factor=0.5", "model_type='llama'", "only phi3")),
    "model-partial-rotary-odd": Case(ConfigError, "phi3 `partial_rotary_factor=0.2` with head_dim 16 (rotary_dim 3, odd)",
                                     lambda c: model_config(model_type="phi3", partial_rotary_factor=0.2),
                                     ("partial_rotary_factor=0.2", "rotary_dim=int(head_dim=16 * 0.2)=3", "even rotary_dim")),
    "model-longrope-factor-count": Case(ConfigError, "longrope `short_factor` with 3 values for 8 rotary frequencies",
                                        lambda c: model_config(rope_scaling=RopeScaling(
                                            rope_type="longrope", factor=2.0, short_factor=(1.0,) * 3, long_factor=(1.0,) * 8)),
                                        ("short_factor has 3 values", "expected rotary_dim // 2 = 8", "rope_parameters")),
    "model-kv-heads-not-dividing": Case(ConfigError, "`num_key_value_heads=3` with `num_attention_heads=4`",
                                        lambda c: model_config(num_key_value_heads=3),
                                        ("num_key_value_heads=3", "num_attention_heads=4", "fix the model config")),
    "model-moe-no-moe-layer": Case(UnsupportedModelError, "qwen3_moe config with `mlp_only_layers=[0, 1]` (every layer dense)",
                                   lambda c: ModelConfig.from_hf(Qwen3MoeConfig(**TINY, num_experts=4, mlp_only_layers=[0, 1])),
                                   ("mlp_only_layers=[0, 1]", "no mixture-of-experts layer", "at least one MoE layer")),
    "model-moe-top-k-above-experts": Case(ConfigError, "`num_experts_per_tok=5` with `num_experts=4`",
                                          lambda c: model_config(model_type="mixtral", num_experts=4, num_experts_per_tok=5,
                                                                 moe_intermediate_size=64),
                                          ("num_experts_per_tok=5", "num_experts=4")),
    "model-moe-experts-on-dense-family": Case(ConfigError, "`num_experts=4` for `model_type=\"llama\"`",
                                              lambda c: model_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
                                              ("num_experts=4", "model_type='llama'", "must be 0")),
    "plan-draft-layers-all": Case(ConfigError, "`draft_layers=2` on a 2-layer model",
                                  lambda c: make_plan(model_config(), inference(speculation_length=2, draft_layers=2)),
                                  ("draft_layers=2", "num_hidden_layers=2", "first layers")),
    "model-layer-types-length": Case(ConfigError, "`layer_types` with 1 entry for a 2-layer model",
                                     lambda c: model_config(layer_types=("full_attention",)),
                                     ("layer_types has 1 entries", "num_hidden_layers=2", "one per layer")),
    "model-sliding-layer-without-window": Case(ConfigError, "a `sliding_attention` layer with `sliding_window=None`",
                                               lambda c: model_config(layer_types=("full_attention", "sliding_attention")),
                                               ("'sliding_attention'", "sliding_window is None", "set sliding_window")),
    "model-layer-type-unsupported": Case(UnsupportedModelError, "`layer_types` with a `linear_attention` layer",
                                         lambda c: model_config(layer_types=("full_attention", "linear_attention")),
                                         ("['linear_attention']", "not supported", "full_attention")),
    "model-gemma3-multimodal": Case(UnsupportedModelError, "`ModelConfig.from_hf` of a multimodal `Gemma3Config` (vision tower)",
                                    lambda c: ModelConfig.from_hf(Gemma3Config(text_config=Gemma3TextConfig(**TINY).to_dict())),
                                    ("model_type='gemma3'", "Gemma3ForCausalLM", "text_config")),
    "model-gemma3-attn-softcapping": Case(UnsupportedModelError, "gemma3_text config with `attn_logit_softcapping=50.0`",
                                          lambda c: ModelConfig.from_hf(Gemma3TextConfig(**TINY, attn_logit_softcapping=50.0)),
                                          ("attn_logit_softcapping=50.0", "not supported", "unset")),
    "model-gemma3-bidirectional": Case(UnsupportedModelError, "gemma3_text config with `use_bidirectional_attention=True`",
                                       lambda c: ModelConfig.from_hf(Gemma3TextConfig(**TINY, use_bidirectional_attention=True)),
                                       ("use_bidirectional_attention=True", "not supported", "unset")),
    "model-sliding-rope-scaled": Case(UnsupportedModelError, "`rope_parameters[\"sliding_attention\"]` with linear scaling",
                                      lambda c: ModelConfig.from_hf(Gemma3TextConfig(**TINY, rope_parameters={
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})),
                                      ("sliding_attention", "rope_type='linear'", "only the 'default' RoPE")),
    "plan-tp-unsupported-family": Case(UnsupportedModelError, "`tp_degree=2` for a llama4_text model",
                                       lambda c: make_plan(model_config(model_type="llama4_text", num_experts=4, num_experts_per_tok=2,
                                                                        moe_intermediate_size=32), inference(tp_degree=2)),
                                       ("tp_degree=2", "model_type='llama4_text'", "use tp_degree=1")),
    "model-llama4-multimodal": Case(UnsupportedModelError, "a config of model_type `llama4` (the multimodal model)",
                                    lambda c: ModelConfig.from_hf(Llama4Config()),
                                    ("model_type='llama4'", "Llama4ForCausalLM", "llama4_text")),
    "plan-tp-above-heads": Case(ConfigError, "`tp_degree=8` for a model with 4 query heads",
                                lambda c: make_plan(model_config(), inference(tp_degree=8)),
                                ("tp_degree=8", "num_attention_heads=4", "tp_degree <= 4")),
    "config-chunk-size-zero": Case(ConfigError, "`InferenceConfig(prefill_chunk_size=0)`",
                                   lambda c: inference(prefill_chunk_size=0), ("prefill_chunk_size=0", ">= 1", "128")),
    "config-chunk-size-over-context": Case(ConfigError, "`prefill_chunk_size=64` with `max_context_length=32`",
                                           lambda c: inference(prefill_chunk_size=64),
                                           ("prefill_chunk_size=64", "max_context_length=32", "lower prefill_chunk_size")),
    "config-chunk-with-speculation": Case(ConfigError, "`prefill_chunk_size=8` with `speculation_length=3`",
                                          lambda c: inference(prefill_chunk_size=8, speculation_length=3),
                                          ("prefill_chunk_size=8", "speculation_length=3", "draft", "drop one")),
    "config-prefill-buckets-past-chunk": Case(ConfigError, "`prefill_buckets=(8, 16, 32)` with `prefill_chunk_size=8`",
                                              lambda c: inference(prefill_chunk_size=8, prefill_buckets=(8, 16, 32)),
                                              ("bucket 32", "prefill_chunk_size=8", "drop it")),
    "chunk-without-chunk-graphs": Case(InputError, "`chunk_step` on a runtime compiled without `prefill_chunk_size`",
                                       lambda c: chunk(c, [[1, 2]], rt=c.rt), ("no chunk graphs", "prefill_chunk_size=C")),
    "chunk-longer-than-chunk-size": Case(PromptTooLongError, "`chunk_step` with a 9-token chunk, `prefill_chunk_size=8`",
                                         lambda c: chunk(c, [[1] * 9]), ("9 tokens", "prefill_chunk_size=8", "split it")),
    "prefill-past-chunk-size": Case(PromptTooLongError, "`prefill_step` of a 9-token prompt with `prefill_chunk_size=8`",
                                    lambda c: neuronfx.prefill_step(chunking_runtime(c), neuronfx.init_state(chunking_runtime(c)),
                                                                    P([1], [[1] * 9])),
                                    ("9 tokens", "largest prefill bucket 8", "chunk_step")),
    "scheduler-token-budget-zero": Case(InputError, "`schedule(..., max_num_batched_tokens=0)`",
                                        lambda c: next(neuronfx.schedule(chunking_runtime(c), neuronfx.init_state(chunking_runtime(c)), [], frozenset(),
                                                                         max_num_batched_tokens=0)),
                                        ("max_num_batched_tokens=0", "int >= 1")),
    "config-sequence-parallel-without-tp": Case(ConfigError, "`sequence_parallel=True` with `tp_degree=1`",
                                                lambda c: inference(sequence_parallel=True),
                                                ("sequence_parallel=True", "tp_degree >= 2")),
    "config-weight-format-unknown": Case(ConfigError, "`InferenceConfig(weight_format='q4_k')`",
                                         lambda c: inference(weight_format="q4_k"), ("weight_format='q4_k'", "'int8'", "'gguf'")),
    "config-weight-group-size": Case(ConfigError, "`InferenceConfig(weight_group_size=48)`",
                                     lambda c: inference(weight_format="int4", weight_group_size=48),
                                     ("weight_group_size=48", "(32, 64, 128)")),
    "plan-group-size-not-dividing-hidden": Case(ConfigError, "`weight_group_size=128` for hidden_size 64",
                                                lambda c: make_plan(model_config(), inference(weight_format="int4", weight_group_size=128)),
                                                ("weight_group_size=128", "hidden_size=64", "divides it")),
    "config-int8-activations-float-weights": Case(ConfigError, "`activation_format='int8'` with float weights",
                                                  lambda c: inference(activation_format="int8"),
                                                  ("activation_format='int8'", "weight_format='float'", "quantized weights", "'gguf'")),
    "config-int8-activations-eager": Case(ConfigError, "`activation_format='int8'` with `backend='eager'`",
                                          lambda c: inference(backend="eager", weight_format="int4", activation_format="int8"),
                                          ("activation_format='int8'", "backend='eager'", "backend='inductor'")),
    "config-quantized-tp": Case(ConfigError, "`weight_format='int8'` with `tp_degree=2`",
                                lambda c: inference(weight_format="int8", tp_degree=2), ("weight_format='int8'", "tp_degree=2", "tp_degree=1")),
    "compile-gguf-format-from-safetensors": Case(ConfigError, "`weight_format='gguf'` for a safetensors directory",
                                                 lambda c: neuronfx.compile(make_plan(model_config(), inference(backend="eager", weight_format="gguf"),
                                                                                      checkpoint=str(hf_dir(c, "gguf-format")))),
                                                 ("weight_format='gguf'", "not a .gguf file", "'int8'")),
    "compile-gguf-format-float-weights": Case(ConfigError, "`weight_format='gguf'` given a float state dict",
                                              lambda c: neuronfx.compile(make_plan(model_config(), inference(backend="eager", weight_format="gguf")),
                                                                         c.hf.state_dict()),
                                              ("weight_format='gguf'", "no Q4_0, Q4_1 or Q8_0", "'int8'")),
    "plan-tp-without-ranks": Case(ConfigError, "`neuronfx.compile` of a `tp_degree=2` plan in one process",
                                  lambda c: neuronfx.compile(make_plan(c.rt.plan.model, inference(tp_degree=2, backend="eager")),
                                                             c.hf.state_dict(), progress=False),
                                  ("tp_degree=2 needs 2 processes", "torchrun --nproc-per-node 2", "neuronfx.launch")),
    "plan-compile-without-weights": Case(ConfigError, "`neuronfx.compile(plan)` with no state_dict and no checkpoint",
                                         lambda c: neuronfx.compile(c.rt.plan, progress=False),
                                         ("state_dict=", "checkpoint path")),
    # --- checkpoints ----------------------------------------------------------------------------
    "checkpoint-missing-path": Case(CheckpointError, "`load_checkpoint` of a path that does not exist",
                                    lambda c: load_checkpoint(c.tmp / "nope"), ("nope", "does not exist", "check the path")),
    "checkpoint-dir-without-config": Case(CheckpointError, "`load_checkpoint` of an empty directory",
                                          lambda c: load_checkpoint(c.tmp), ("has no config.json", "save_pretrained")),
    "checkpoint-unsupported-model-type": Case(UnsupportedModelError, "directory whose config.json says `gpt2`",
                                              lambda c: load_checkpoint(unsupported_checkpoint(c)),
                                              ("model_type='gpt2'", "supported: llama")),
    "checkpoint-truncated-file": Case(CheckpointError, "`model.safetensors` cut to 1000 bytes",
                                      lambda c: load_checkpoint(truncated_checkpoint(c)),
                                      ("model.safetensors", "truncated or corrupt", "copy it again")),
    "checkpoint-non-float-dtype": Case(ConfigError, "`load_checkpoint(path, dtype=torch.int8)`",
                                       lambda c: load_checkpoint(hf_dir(c, "ok"), dtype=torch.int8),
                                       ("torch.int8", "torch.float32")),
    "weights-missing-tensor": Case(CheckpointError, "state dict without `model.norm.weight`",
                                   lambda c: compile_with(c, state_dict(c, drop=("model.norm.weight",))),
                                   ("missing tensors ['model.norm.weight']", "belong together")),
    "weights-extra-tensor": Case(CheckpointError, "state dict with an extra `model.extra.weight`",
                                 lambda c: compile_with(c, state_dict(c, add={"model.extra.weight": torch.zeros(2)})),
                                 ("unexpected tensors ['model.extra.weight']", "belong together")),
    "weights-misshaped-tensor": Case(CheckpointError, "`model.norm.weight` of shape (65,) where the config implies (64,)",
                                     lambda c: compile_with(c, state_dict(c, replace={"model.norm.weight": torch.ones(65)})),
                                     ("(65,)", "expected (64,)", "config.json")),
    "compile-workers-not-a-count": Case(ConfigError, "`NEURONFX_COMPILE_WORKERS=two` and an inductor plan",
                                        lambda c: compile_with_env(c, NEURONFX_COMPILE_WORKERS="two"),
                                        ("NEURONFX_COMPILE_WORKERS='two'", "whole number", "unset it")),
    # --- saved runtimes (neuronfx.save / neuronfx.load) ----------------------------------------
    "artifact-not-a-runtime": Case(ArtifactError, "`neuronfx.load` of a directory without a manifest",
                                   lambda c: neuronfx.load(c.tmp), ("manifest.json", "neuronfx.save")),
    "artifact-corrupt-weights": Case(ArtifactError, "one byte of `weights.safetensors` flipped",
                                     lambda c: neuronfx.load(artifact(c, lambda d: flip_byte(d / "weights.safetensors"))),
                                     ("weights.safetensors", "corrupt")),
    "artifact-missing-file": Case(ArtifactError, "`plan.json` deleted",
                                  lambda c: neuronfx.load(artifact(c, lambda d: (d / "plan.json").unlink())),
                                  ("plan.json", "missing")),
    "artifact-save-over-checkpoint": Case(ArtifactError, "`neuronfx.save` into a checkpoint's directory (files, no manifest)",
                                          lambda c: neuronfx.save(c.rt, hf_dir(c, "checkpoint")),
                                          ("holds files", "no manifest.json", "use a new dir")),
    # --- prefill_step inputs --------------------------------------------------------------------
    "prefill-wrong-batch-type": Case(InputError, "`prefill_step` given a DecodeBatch",
                                     lambda c: prefill(c, D([1], [1])), ("DecodeBatch", "neuronfx.PrefillBatch")),
    "prefill-empty-batch": Case(InputError, "`PrefillBatch` with no rows",
                                lambda c: prefill(c, P([], [])), ("batch is empty", "at least one row")),
    "prefill-too-many-rows": Case(BatchTooLargeError, "5 rows with `batch_size=4` (max_num_seqs)",
                                  lambda c: prefill(c, P([1, 3, 0, 2, 4], [[1]] * 5)),
                                  ("5 rows", "batch_size=4", "split it")),
    "prefill-row-count-mismatch": Case(InputError, "2 seq_ids, 1 prompt",
                                       lambda c: prefill(c, PrefillBatch(seq_ids=[1, 3], prompts=[[1]], sampling=[GREEDY])),
                                       ("2 seq_ids", "1 rows", "one per row")),
    "prefill-live-slot": Case(SlotError, "prefill into slot 0, which holds a live request",
                              lambda c: prefill(c, P([0], [[1, 2]])), ("slot 0", "free slots are [1, 3]", "release it first")),
    "prefill-scratch-slot": Case(SlotError, "prefill into slot 4 (the scratch slot)",
                                 lambda c: prefill(c, P([4], [[1, 2]])), ("seq_id 4", "[0, 4)", "below batch_size=4")),
    "prefill-negative-slot": Case(SlotError, "prefill into slot -1",
                                  lambda c: prefill(c, P([-1], [[1, 2]])), ("seq_id -1", "[0, 4)", "below batch_size=4")),
    "prefill-duplicate-slots": Case(SlotError, "two rows for slot 1",
                                    lambda c: prefill(c, P([1, 1], [[1], [2]])), ("[1, 1]", "duplicates", "its own slot")),
    "prefill-empty-prompt": Case(EmptyPromptError, "a prompt of 0 tokens",
                                 lambda c: prefill(c, P([1], [[]])), ("row 0 is empty", "at least one token")),
    "prefill-prompt-too-long": Case(PromptTooLongError, "a 33-token prompt with `max_context_length=32` (never cropped)",
                                    lambda c: prefill(c, P([1], [random_prompt(33, 1)])),
                                    ("33 tokens", "max_context_length=32", "shorten it")),
    "prefill-token-out-of-vocab": Case(TokenOutOfVocabError, "token id 256 with `vocab_size=256`",
                                       lambda c: prefill(c, P([1], [[5, VOCAB]])), ("256", "[0, 256)", "tokenizer")),
    "prefill-token-negative": Case(TokenOutOfVocabError, "token id -1",
                                   lambda c: prefill(c, P([1], [[-1, 5]])), ("-1", "[0, 256)", "tokenizer matches")),
    "prefill-token-float": Case(InputError, "token id 1.5 (a float)",
                                lambda c: prefill(c, P([1], [[1.5]])), ("1.5", "float", "int()")),
    "prefill-prompt-not-a-list": Case(InputError, "`PrefillBatch(prompts=[5])` (a bare int as a prompt)",
                                      lambda c: P([1], [5]), ("row 0 is int", "list of token ids")),
    "prefill-seq-ids-not-a-list": Case(InputError, "`PrefillBatch(seq_ids=1, ...)` (a bare int)",
                                       lambda c: PrefillBatch(seq_ids=1, prompts=[[1]], sampling=[GREEDY]),
                                       ("seq_ids=1", "one entry per row", "e.g. [1]")),
    # --- decode_step inputs ---------------------------------------------------------------------
    "decode-wrong-batch-type": Case(InputError, "`decode_step` given a PrefillBatch",
                                    lambda c: decode(c, P([0], [[1]])), ("PrefillBatch", "neuronfx.DecodeBatch")),
    "decode-input-ids-not-a-list": Case(InputError, "`DecodeBatch(input_ids=5, ...)` (a bare int)",
                                        lambda c: DecodeBatch(seq_ids=[0], input_ids=5, sampling=[GREEDY]),
                                        ("input_ids=5", "one entry per row", "e.g. [5]")),
    "decode-free-slot": Case(SlotError, "decode slot 1, which is free",
                             lambda c: decode(c, D([1], [1])), ("slot 1", "live request", "prefill it first")),
    "decode-duplicate-slots": Case(SlotError, "two rows for slot 0",
                                   lambda c: decode(c, D([0, 0], [1, 1])), ("[0, 0]", "duplicates", "its own slot")),
    "decode-slot-out-of-range": Case(SlotError, "decode slot 7 with 4 slots",
                                     lambda c: decode(c, D([7], [1])), ("seq_id 7", "[0, 4)", "below batch_size=4")),
    "decode-too-many-rows": Case(BatchTooLargeError, "5 decode rows with `batch_size=4`",
                                 lambda c: decode(c, D([0, 1, 2, 3, 4], [1] * 5)), ("5 rows", "batch_size=4", "split it")),
    "decode-token-out-of-vocab": Case(TokenOutOfVocabError, "input id 256 for live slot 0",
                                      lambda c: decode(c, D([0], [VOCAB])), ("256", "[0, 256)", "tokenizer matches")),
    "decode-sampling-count-mismatch": Case(InputError, "2 rows, 1 SamplingParams",
                                           lambda c: decode(c, DecodeBatch(seq_ids=[0, 2], input_ids=[1, 2], sampling=[GREEDY])),
                                           ("2 seq_ids", "1 rows")),
    "decode-full-slot": Case(SequenceLengthExceededError, "decode a slot holding 64 tokens = `sequence_length` (never overwrites)",
                             decode_full_slot, ("holds 64 tokens", "sequence_length=64", "release it")),
    "release-free-slot": Case(SlotError, "`release` of free slot 1",
                              lambda c: neuronfx.release(c.rt, c.state, [1]), ("slot 1", "live request")),
    "release-not-a-list": Case(SlotError, "`release(runtime, state, 0)` (an int, not a list)",
                               lambda c: neuronfx.release(c.rt, c.state, 0), ("seq_ids=0", "e.g. [0]")),
    # --- generate -------------------------------------------------------------------------------
    "generate-text-instead-of-ids": Case(InputError, "`generate(..., \"hello\")`",
                                         lambda c: gen(c, "hello"), ("'hello'", "tokenize it first")),
    "generate-float-ids": Case(InputError, "a float32 ids tensor",
                               lambda c: gen(c, torch.tensor([[1.0, 2.0]])), ("torch.float32", "int32/int64")),
    "generate-3d-ids": Case(InputError, "an ids tensor of shape (1, 1, 2)",
                            lambda c: gen(c, torch.ones(1, 1, 2, dtype=torch.long)), ("(1, 1, 2)", "[B, T]")),
    "generate-ids-on-meta-device": Case(InputError, "an ids tensor on the meta device (no data)",
                                        lambda c: gen(c, torch.ones(1, 3, dtype=torch.long, device="meta")),
                                        ("'meta'", "cpu")),
    "generate-no-prompts": Case(InputError, "`generate(..., [])`", lambda c: gen(c, []), ("no prompts", "at least one")),
    "generate-empty-prompt": Case(EmptyPromptError, "second prompt empty",
                                  lambda c: gen(c, [[1, 2], []]), ("row 1 is empty", "at least one token")),
    "generate-prompt-too-long": Case(PromptTooLongError, "a 40-token prompt",
                                     lambda c: gen(c, [list(range(40))]), ("40 tokens", "max_context_length=32", "shorten it")),
    "generate-total-over-sequence": Case(SequenceLengthExceededError, "30-token prompt + `max_new_tokens=35` > 64",
                                         lambda c: gen(c, [random_prompt(30, 1)], n=35),
                                         ("30 tokens + max tokens 35 = 65", "sequence_length=64", "lower max_new_tokens")),
    "generate-max-tokens-over-sequence": Case(SequenceLengthExceededError, "`SamplingParams(max_tokens=64)` on a 1-token prompt",
                                              lambda c: gen(c, [[1]], sampling=SP(max_tokens=64)),
                                              ("1 tokens + max tokens 64 = 65", "sequence_length=64")),
    "generate-min-tokens-over-budget": Case(SamplingParamsError, "`SamplingParams(min_tokens=10)` with `max_new_tokens=4`",
                                            lambda c: gen(c, [[1, 2]], n=4, sampling=SP(min_tokens=10)),
                                            ("min_tokens=10", "budget 4", "lower min_tokens")),
    "generate-bad-tokenizer": Case(InputError, "`tokenizer=object()` (cannot decode)",
                                   lambda c: gen(c, [[1, 2]], tokenizer=object()), ("cannot decode", "transformers tokenizer")),
    "generate-ids-none": Case(InputError, "`generate(..., None)`", lambda c: gen(c, None), ("ids=None", "list of token ids")),
    "generate-speculative-not-bool": Case(InputError, "`generate(..., speculative=\"no\")`",
                                          lambda c: gen(c, [[1, 2]], speculative="no"), ("speculative='no'", "True or False")),
    "generate-not-a-runtime": Case(InputError, "`generate(plan, state, ids)` (a Plan, not a Runtime)",
                                   lambda c: neuronfx.generate(c.rt.plan, c.state, [[1, 2]]), ("runtime is a Plan", "neuronfx.compile")),
    "generate-max-new-tokens-zero": Case(InputError, "`max_new_tokens=0`",
                                         lambda c: gen(c, [[1, 2]], n=0), ("max_new_tokens=0", "int >= 1")),
    "generate-sampling-count": Case(InputError, "3 SamplingParams for 2 prompts",
                                    lambda c: gen(c, [[1], [2]], sampling=[GREEDY] * 3), ("one per prompt (2)",)),
    "generate-no-free-slot": Case(BatchTooLargeError, "`generate` on a state whose 4 slots are all live",
                                  all_slots_live, ("all 4 slots are live", "release some")),
    "generate-eos-out-of-vocab": Case(TokenOutOfVocabError, "`eos_token_ids=[256]`",
                                      lambda c: gen(c, [[1, 2]], eos_token_ids=[VOCAB]), ("256", "[0, 256)", "eos id")),
    "generate-eos-not-ids": Case(InputError, "`eos_token_ids=\"2\"`",
                                 lambda c: gen(c, [[1, 2]], eos_token_ids="2"), ("'2'", "token id")),
    "generate-stop-without-tokenizer": Case(InputError, "`SamplingParams(stop=\"x\")` without a tokenizer",
                                            lambda c: gen(c, [[1]], sampling=SP(stop="x")), ("stop=('x',)", "tokenizer=")),
    "generate-stop-not-tokenizable": Case(SamplingParamsError, "stop string `\"zz\"` that the tokenizer can never produce",
                                          lambda c: gen(c, [[1]], sampling=SP(stop="zz"), tokenizer=c.extras["tokenizer"]),
                                          ("stop='zz'", "cannot be produced", "'w0'", "fix the stop string")),
    "generate-async-decode-not-bool": Case(InputError, "`generate(..., async_decode=\"yes\")`",
                                           lambda c: gen(c, [[1, 2]], async_decode="yes"), ("async_decode='yes'", "True or False")),
    "structured-without-tokenizer": Case(InputError, "`SamplingParams(structured=StructuredOutputs(regex=...))` without a tokenizer",
                                         lambda c: gen(c, [[1]], sampling=SP(structured=SO(regex="a+"))),
                                         ("SamplingParams.structured (regex)", "tokenizer=")),
    "structured-invalid-schema": Case(SamplingParamsError, "a JSON schema llguidance rejects (`{\"type\": \"foo\"}`)",
                                      lambda c: gen(c, [[1]], sampling=SP(structured=SO(json={"type": "foo"})), tokenizer=byte_tok(c)),
                                      ("StructuredOutputs.json=", "Invalid type: foo", "fix the spec")),
    "structured-bad-regex": Case(SamplingParamsError, "`StructuredOutputs(regex=\"((\")`",
                                 lambda c: gen(c, [[1]], sampling=SP(structured=SO(regex="((")), tokenizer=byte_tok(c)),
                                 ("StructuredOutputs.regex='(('", "unclosed group", "fix the spec")),
    "structured-empty-choice": Case(SamplingParamsError, "`StructuredOutputs(choice=[])`",
                                    lambda c: SO(choice=[]), ("StructuredOutputs.choice=()", "non-empty list")),
    "structured-no-first-token": Case(SamplingParamsError, "a grammar no token of the tokenizer can start (`start: \"\\x00\"`)",
                                      lambda c: gen(c, [[1]], sampling=SP(structured=SO(grammar='start: "\\x00"')), tokenizer=byte_tok(c)),
                                      ("StructuredOutputs.grammar=", "allows no token at the first step", "fix the spec")),
    "structured-step-without-matcher": Case(InputError, "a DecodeBatch row with `structured` but no `constraints` matcher",
                                            lambda c: decode(c, D([0], [1], [SP(structured=SO(regex="a+"))])),
                                            ("row 0 has SamplingParams.structured (regex)", "constraints=", "grammars.matcher")),
    "overlap-step-bad-budget": Case(InputError, "`overlap_step(..., max_num_batched_tokens=0)` (raised before the state is handed over)",
                                    lambda c: overlap_step(c.rt, c.state, Queue(), frozenset(), max_num_batched_tokens=0),
                                    ("max_num_batched_tokens=0", "int >= 1")),
    "overlap-step-consumed-state": Case(StateConsumedError, "`overlap_step` on a state a step already consumed",
                                        lambda c: overlap_step(c.rt, c.consumed, Queue(), frozenset()),
                                        ("already consumed", "use the new state")),
    "overlap-finish-twice": Case(StateConsumedError, "`finish` of a Pending that was already finished",
                                 finish_twice, ("already finished", "use the value")),
    "speculate-without-graphs": Case(ConfigError, "`speculate_step` on a runtime compiled without speculation",
                                     speculate, ("speculation_length=k >= 2",)),
    "speculate-without-draft": Case(ConfigError, "`speculate_step` on a runtime with speculate graphs but no draft",
                                    lambda c: speculate(c, rt=tiny_runtime(c.hf, speculation_length=4)),
                                    ("no draft", "draft_layers=N", "with_draft")),
    "speculate-wrong-batch-type": Case(InputError, "`speculate_step` given a DecodeBatch",
                                       lambda c: speculate_live(c, D([0], [1])),
                                       ("DecodeBatch", "neuronfx.SpeculateBatch")),
    "speculate-no-room-for-k": Case(SequenceLengthExceededError, "`speculate_step` on a slot holding 61 of 64 tokens, k = 4",
                                    speculate_full, ("slot 0 holds 61 tokens", "4 more", "sequence_length=64", "decode_step")),
    "speculate-ngram-without-history": Case(InputError, "`speculate_step` on a prompt-lookup runtime without `SpeculateBatch.history`",
                                            lambda c: speculate_ngram(c, None), ("speculative_method='ngram'", "history=")),
    "speculate-ngram-wrong-history": Case(InputError, "`speculate_step` on a prompt-lookup runtime, a history not ending with the input token",
                                          lambda c: speculate_ngram(c, [[5, 6, 7]]),
                                          ("history of row 0 ends with [7]", "up to and including its input_ids token")),
    "draft-on-ngram-runtime": Case(ConfigError, "`with_draft` on a prompt-lookup runtime",
                                   lambda c: neuronfx.with_draft(tiny_runtime(c.hf, speculation_length=4, speculative_method="ngram"), c.rt),
                                   ("speculative_method='ngram'", "speculative_method=None")),
    "draft-without-logits": Case(ConfigError, "`with_draft` of a draft runtime compiled with `output_logits=False`",
                                 draft_without_logits, ("output_logits=True",)),
    "draft-other-vocab": Case(ConfigError, "`with_draft` of a draft runtime with another vocabulary",
                              lambda c: neuronfx.with_draft(speculating_runtime(c), neuronfx.compile(
                                  make_plan(model_config(vocab_size=300), inference(output_logits=True, backend="eager")),
                                  {k: v for k, v in c.extras["vocab300"].items()}, progress=False)),
                              ("draft vocab_size=300", "target's is 256", "tokenizer")),
    "graph-missing": Case(InputError, "`call_graph` for a decode graph of bucket 20 the plan does not have",
                          lambda c: graph_call(c, "decode", 1, 20, None), ("no 'decode' graph", "bucket 20", "it has")),
    "graph-input-not-a-record": Case(InputError, "`call_graph` with a flat tuple of tensors instead of a DecodeInputs",
                                     lambda c: graph_call(c, "decode", 1, 16, ()), ("tuple", "DecodeInputs")),
    "draft-not-a-runtime": Case(ConfigError, "`with_draft(runtime, \"path\")`",
                                lambda c: neuronfx.with_draft(speculating_runtime(c), "path"), ("draft is a str", "compiled Runtime")),
    "graph-input-wrong-shape": Case(InputError, "a decode graph called with `input_ids` of shape (1, 2) instead of (1, 1)",
                                    graph_input_of_wrong_shape, ("'input_ids'", "[1, 2]", "[1, 1]", "GraphSpec")),
    "config-device-unknown": Case(ConfigError, "`InferenceConfig(device=\"tpu\")`",
                                  lambda c: inference(device="tpu"), ("device='tpu'", "'cuda:N'", "'cpu'")),
    "config-device-cuda-export": Case(ConfigError, "`InferenceConfig(device=\"cuda\", backend=\"export\")`",
                                      lambda c: inference(device="cuda", backend="export"),
                                      ("device='cuda'", "backend='export'", "'inductor'", "device='cpu'")),
    "config-device-cuda-int8": Case(ConfigError, "`InferenceConfig(device=\"cuda\", weight_format=\"int8\")`",
                                    lambda c: inference(device="cuda", weight_format="int8"),
                                    ("weight_format='int8'", "CPU kernels", "weight_format='float'")),
    "config-device-index-tp": Case(ConfigError, "`InferenceConfig(device=\"cuda:1\", tp_degree=2)`",
                                   lambda c: inference(device="cuda:1", tp_degree=2), ("device='cuda:1'", "tp_degree=2", "device='cuda'")),
    "compile-device-cuda-absent": Case(ConfigError, "`compile` of a plan with `device=\"cuda:99\"` (no such GPU; none at all on CI)",
                                       lambda c: neuronfx.compile(make_plan(model_config(), inference(device="cuda:99", backend="eager")),
                                                                  c.hf.state_dict(), progress=False),
                                       ("device='cuda:99'", "device='cpu'")),
    # --- check_accuracy (neuronfx.accuracy) -----------------------------------------------------
    "accuracy-runtime-without-logits": Case(ConfigError, "`check_accuracy` on a runtime compiled with `output_logits=False`",
                                            lambda c: check_accuracy(runtime_without_logits(c), c.hf, prompts=[[1, 2]]),
                                            ("returns none", "output_logits=True")),
    "accuracy-reference-other-vocab": Case(ConfigError, "`check_accuracy` against a reference with vocabulary 300",
                                           lambda c: check_accuracy(c.rt, tiny_hf_model("llama", vocab_size=300), prompts=[[1, 2]]),
                                           ("vocab_size=300", "has 256", "reference_model")),
    "accuracy-prompt-over-capacity": Case(SequenceLengthExceededError, "`check_accuracy` of a 30-token prompt, `max_new_tokens=40`",
                                          lambda c: check_accuracy(c.rt, c.hf, prompts=[list(range(30))], max_new_tokens=40),
                                          ("prompt 0 has 30 tokens", "max_new_tokens=40", "sequence_length=64")),
    "accuracy-text-without-tokenizer": Case(InputError, "`check_accuracy(..., text_file=...)` without a tokenizer",
                                            lambda c: check_accuracy(c.rt, c.hf, prompts=[[1, 2]], text_file="text.txt"),
                                            ("text_file='text.txt'", "tokenizer=")),
    "accuracy-reference-processes-logits": Case(ConfigError, "a reference whose generation config suppresses its greedy token",
                                                suppressing_reference, ("raw logits' argmax", "reference_model")),
    "accuracy-reference-missing-weight": Case(CheckpointError, "`reference_model` of a state dict without `lm_head.weight`",
                                              lambda c: reference_model(c.hf.config, state_dict(c, drop=("lm_head.weight",))),
                                              ("missing_keys", "lm_head.weight", "HF-named weights")),
    # --- sampling parameters --------------------------------------------------------------------
    "sampling-not-params": Case(SamplingParamsError, "a dict instead of SamplingParams in a PrefillBatch",
                                lambda c: bad_sampling(c, {"temperature": 1.0}), ("{'temperature': 1.0}", "neuronfx.SamplingParams")),
    "sampling-temperature-negative": Case(SamplingParamsError, "`temperature=-1.0`",
                                          lambda c: bad_sampling(c, SP(temperature=-1.0)), ("temperature=-1.0", ">= 0")),
    "sampling-temperature-nan": Case(SamplingParamsError, "`temperature=nan` (decode)",
                                     lambda c: bad_sampling(c, SP(temperature=float("nan")), "decode"), ("temperature=nan", "finite")),
    "sampling-top-p-zero": Case(SamplingParamsError, "`top_p=0.0`",
                                lambda c: bad_sampling(c, SP(temperature=1.0, top_p=0.0)), ("top_p=0.0", "(0, 1]", "1 disables")),
    "sampling-top-k-over-width": Case(SamplingParamsError, "`top_k=257` > `max_topk=256`",
                                      lambda c: bad_sampling(c, SP(temperature=1.0, top_k=257)),
                                      ("top_k=257", "max_topk=256", "recompile")),
    "sampling-top-k-float": Case(SamplingParamsError, "`top_k=2.0`",
                                 lambda c: bad_sampling(c, SP(temperature=1.0, top_k=2.0)), ("top_k=2.0", "int")),
    "sampling-min-p-over-one": Case(SamplingParamsError, "`min_p=1.5`",
                                    lambda c: bad_sampling(c, SP(min_p=1.5)), ("min_p=1.5", "[0, 1]")),
    "sampling-repetition-penalty-zero": Case(SamplingParamsError, "`repetition_penalty=0.0`",
                                             lambda c: bad_sampling(c, SP(repetition_penalty=0.0)),
                                             ("repetition_penalty=0.0", "> 0", "1 disables")),
    "sampling-presence-penalty-range": Case(SamplingParamsError, "`presence_penalty=3.0`",
                                            lambda c: bad_sampling(c, SP(presence_penalty=3.0)), ("presence_penalty=3.0", "[-2, 2]")),
    "sampling-frequency-penalty-inf": Case(SamplingParamsError, "`frequency_penalty=inf` (decode)",
                                           lambda c: bad_sampling(c, SP(frequency_penalty=float("inf")), "decode"),
                                           ("frequency_penalty=inf", "finite")),
    "sampling-seed-out-of-range": Case(SamplingParamsError, "`seed=2**63`",
                                       lambda c: bad_sampling(c, SP(seed=2**63)), (f"seed={2**63}", f"[0, {MAX_SEED}]")),
    "sampling-min-over-max-tokens": Case(SamplingParamsError, "`min_tokens=5, max_tokens=2`",
                                         lambda c: bad_sampling(c, SP(min_tokens=5, max_tokens=2)),
                                         ("min_tokens=5", "max_tokens=2", "lower min_tokens")),
    "sampling-stop-token-out-of-vocab": Case(SamplingParamsError, "`stop_token_ids=(256,)`",
                                             lambda c: bad_sampling(c, SP(stop_token_ids=(VOCAB,))),
                                             ("stop_token_ids=(256,)", "vocab_size=256")),
    "sampling-logit-bias-out-of-vocab": Case(SamplingParamsError, "`logit_bias={256: 5.0}`",
                                             lambda c: bad_sampling(c, SP(logit_bias={VOCAB: 5.0})),
                                             ("logit_bias", "token id 256", "vocab_size=256")),
    "sampling-logit-bias-out-of-range": Case(SamplingParamsError, "`logit_bias={5: 150.0}`",
                                             lambda c: bad_sampling(c, SP(logit_bias={5: 150.0})),
                                             ("bias 150.0 for token 5", "[-100, 100]")),
    "sampling-logprobs-over-max": Case(SamplingParamsError, "`logprobs=21` > `max_logprobs=20`",
                                       lambda c: bad_sampling(c, SP(logprobs=21)), ("logprobs=21", "max_logprobs=20", "recompile")),
    "sampling-bool-flag-not-bool": Case(SamplingParamsError, "`ignore_eos=1`",
                                        lambda c: bad_sampling(c, SP(ignore_eos=1)), ("ignore_eos=1", "bool")),
    # --- state use ------------------------------------------------------------------------------
    "state-consumed-decode": Case(StateConsumedError, "`decode_step` on a state a step already consumed",
                                  lambda c: neuronfx.decode_step(c.rt, c.consumed, D([0], [1])),
                                  ("already consumed", "use the new state")),
    "state-consumed-generate": Case(StateConsumedError, "`generate` on a consumed state",
                                    lambda c: neuronfx.generate(c.rt, c.consumed, [[1]]), ("already consumed",)),
    "state-of-another-runtime": Case(StateMismatchError, "a state of a `batch_size=2` runtime",
                                     lambda c: neuronfx.decode_step(c.rt, c.extras["foreign"], D([0], [1])),
                                     ("(3, 2, 64, 16)", "(5, 2, 64, 16)", "neuronfx.init_state(runtime)")),
    "state-not-a-state": Case(InputError, "`decode_step(runtime, None, batch)`",
                              lambda c: neuronfx.decode_step(c.rt, None, D([0], [1])), ("NoneType", "neuronfx.init_state")),
    "state-bad-seed": Case(InputError, "`init_state(runtime, seed=-1)`",
                           lambda c: neuronfx.init_state(c.rt, -1), ("seed=-1", f"[0, {MAX_SEED}]")),
    # --- the scheduler --------------------------------------------------------------------------
    "submit-invalid-request": Case(EmptyPromptError, "`submit(queue, 0, Request(prompt=()), runtime=rt)`",
                                   lambda c: submit(Queue(), 0, request([]), runtime=c.rt), ("row 0 is empty",)),
    "submit-over-capacity": Case(SequenceLengthExceededError, "request of 30 + 40 tokens submitted",
                                 lambda c: submit(Queue(), 3, request(range(30), 40), runtime=c.rt),
                                 ("prompt 3 has 30 tokens + max tokens 40 = 70", "sequence_length=64")),
    "submit-duplicate-index": Case(InputError, "second request with index 0",
                                   lambda c: submit(submit(Queue(), 0, request([1])), 0, request([2]), runtime=c.rt),
                                   ("index 0", "already queued", "its own index")),
    "submit-priority-not-int": Case(InputError, "`Request(priority=1.5)` submitted",
                                    lambda c: submit(Queue(), 0, attrs.evolve(request([1]), priority=1.5), runtime=c.rt),
                                    ("priority=1.5", "must be an int")),
    "generate-priority-per-prompt": Case(InputError, "`generate(..., priority=[0, 1])` for one prompt",
                                         lambda c: gen(c, [[1, 2]], priority=[0, 1]), ("priority=[0, 1]", "one int per prompt (1)")),
    "abort-unknown-request": Case(InputError, "`abort` of index 9, never submitted",
                                  lambda c: abort(c.rt, c.state, Queue(), 9), ("index 9", "neither waiting nor running")),
    # --- front ends -----------------------------------------------------------------------------
    "chat-without-template": Case(InputError, "`chat_loop` with a tokenizer that has no chat template",
                                  lambda c: chat_loop(c.rt, c.extras["tokenizer"], ChatOptions(sampling=GREEDY, max_new_tokens=2),
                                                      lambda prompt: None, io.StringIO(), io.StringIO()),
                                  ("tokenizer.chat_template", "generate --prompt")),
    "bench-serving-bad-url": Case(InputError, "`--server localhost:8000` (no scheme)",
                                  lambda c: parse_server("localhost:8000"), ("'localhost:8000'", "http://", "http://127.0.0.1:8000")),
    "bench-serving-bad-range": Case(InputError, "`--prompt-lens 64 32` (MIN > MAX)",
                                    lambda c: check_range("prompt-lens", [64, 32], 1), ("[64, 32]", "1 <= MIN <= MAX")),
    "bench-serving-empty-text": Case(InputError, "a workload cut from an empty text",
                                     lambda c: text_workload(c.extras["tokenizer"], "", 2, (4, 8), (2, 4)), ("no tokens", "--text-file")),
    "bench-serving-unreachable": Case(InputError, "`bench_server` of a loopback port nothing listens on",
                                      lambda c: bench_server(f"http://127.0.0.1:{closed_port()}", [ServingRequest(prompt="w1", prompt_len=1,
                                                                                                           max_tokens=2)], 1),
                                      ("cannot reach the server at http://127.0.0.1:", "start it", "--server")),
}


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=0)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)


def live_state(rt) -> tuple[neuronfx.State, neuronfx.State, dict[int, int]]:
    """(state with slots 0 and 2 live after prefill + one decode, the state that decode consumed,
    each live slot's last token)."""
    slots = list(LIVE_PROMPTS)
    out, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt, seed=3), P(slots, list(LIVE_PROMPTS.values())))
    consumed = state
    out, state = neuronfx.decode_step(rt, state, D(slots, list(out.tokens)))
    return state, consumed, dict(zip(slots, out.tokens))


def continue_live(rt, state, last: dict[int, int]) -> dict[int, list[int]]:
    """Decode every live slot CONTINUE more tokens (one batch per step)."""
    slots, tokens = list(last), {s: [] for s in last}
    ids = list(last.values())
    for _ in range(CONTINUE):
        out, state = neuronfx.decode_step(rt, state, D(slots, ids))
        ids = list(out.tokens)
        for s, t in zip(slots, ids):
            tokens[s].append(t)
    return tokens


@pytest.fixture(scope="module")
def control(rt):
    state, _, last = live_state(rt)
    return continue_live(rt, state, last)


@pytest.fixture(scope="module")
def extras(hf, rt, tmp_path_factory):
    saved = tmp_path_factory.mktemp("artifact") / "rt"
    neuronfx.save(rt, saved)
    foreign = neuronfx.init_state(tiny_runtime(hf, batch_size=2))
    vocab300 = tiny_hf_model("llama", seed=1, vocab_size=300).state_dict()
    return {"saved": saved, "foreign": foreign, "tokenizer": word_tokenizer(), "vocab300": vocab300, "byte_tokenizer": byte_tokenizer()}


def snapshot(state: neuronfx.State) -> tuple:
    return (state.cache_lens, state.generated, state.live, state.rng_key, [t.clone() for t in kv_tensors(state)],
            state.output_counts.clone(), state.prompt_mask.clone())


def assert_unchanged(state: neuronfx.State, before: tuple) -> None:
    assert not state.consumed
    assert (state.cache_lens, state.generated, state.live, state.rng_key) == before[:4]
    for a, b in zip(kv_tensors(state), before[4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(state.output_counts, before[5]) and torch.equal(state.prompt_mask, before[6])


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_misuse_case(hf, rt, control, extras, tmp_path, case):
    spec = CASES[case]
    state, consumed, last = live_state(rt)
    ctx = Ctx(rt=rt, hf=hf, state=state, consumed=consumed, tmp=tmp_path, extras=extras)
    before = snapshot(state)

    with pytest.raises(spec.error) as info:
        spec.call(ctx)

    assert type(info.value) is spec.error, f"expected exactly {spec.error.__name__}, got {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for needle in spec.names:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert_unchanged(state, before)
    assert continue_live(rt, state, last) == control


# --- the docs table agrees with the cases -----------------------------------------------------


def table() -> str:
    """The catalogue as a markdown table (docs/misuse.md between its markers)."""
    rows = ["| # | case | how it is triggered | exception | the message names |", "| --- | --- | --- | --- | --- |"]
    for i, (name, c) in enumerate(CASES.items(), 1):
        names = ", ".join(f"`{n}`" for n in c.names)
        rows.append(f"| {i} | `{name}` | {c.trigger} | `{c.error.__name__}` | {names} |")
    return "\n".join(rows)


def test_docs_table_matches_cases():
    text = DOC.read_text()
    documented = re.findall(r"^\| \d+ \| `([a-z0-9-]+)` \|.*\| `(\w+)` \|", text, flags=re.M)
    assert documented == [(name, c.error.__name__) for name, c in CASES.items()]
    assert table() in text
    assert len(CASES) >= 40


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
