"""neuronfx: decoder-only LLMs as a fixed set of static-shape graphs with explicit state passing.

Typical use::

    plan = neuronfx.make_plan(ModelConfig.from_hf(hf_config), InferenceConfig(batch_size=4))
    runtime = neuronfx.compile(plan, state_dict)
    state = neuronfx.init_state(runtime, seed=0)
    result, state = neuronfx.generate(runtime, state, [[1, 2, 3]], max_new_tokens=16)
"""

from neuronfx import errors
from neuronfx.api import compile, launch, load, push_to_hub, save
from neuronfx.config import InferenceConfig, ModelConfig, Plan, SamplingParams, StructuredOutputs, make_plan
from neuronfx.memory import frozen_heap
from neuronfx.runtime import (
    ChunkBatch,
    DecodeBatch,
    Finished,
    GenerateResult,
    Logprobs,
    PrefillBatch,
    PrefixStats,
    Request,
    Runtime,
    SpeculateBatch,
    SpeculationStats,
    State,
    StepOutput,
    TokenEvent,
    chunk_step,
    decode_step,
    embed,
    generate,
    init_state,
    prefill_cached,
    prefill_step,
    prefix_stats,
    release,
    schedule,
    speculate_step,
    stream_generate,
    with_draft,
)
from neuronfx.version import __version__

__all__ = [
    "ChunkBatch", "DecodeBatch", "Finished", "GenerateResult", "InferenceConfig", "Logprobs", "ModelConfig", "Plan", "PrefillBatch",
    "PrefixStats", "Request", "Runtime", "SamplingParams", "SpeculateBatch", "SpeculationStats", "State", "StepOutput", "StructuredOutputs",
    "TokenEvent",
    "__version__", "chunk_step", "compile", "decode_step", "embed", "errors", "frozen_heap", "generate", "init_state", "launch", "load",
    "make_plan", "prefill_cached", "prefill_step", "prefix_stats", "push_to_hub", "release", "save", "schedule", "speculate_step",
    "stream_generate", "with_draft",
]
