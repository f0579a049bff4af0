"""Explicit state and dispatch: the runtime, init_state, step functions, the reference scheduler
and generate. Compiling (which reads checkpoints and the compile cache) is ``neuronfx.api``."""

from neuronfx.runtime.chunked import ChunkBatch, chunk_step
from neuronfx.runtime.embed import embed
from neuronfx.runtime.generate import GenerateResult, generate, stream_generate
from neuronfx.runtime.pipeline import Logprobs, StepOutput
from neuronfx.runtime.prefix import prefill_cached, prefix_stats
from neuronfx.runtime.prefix_store import PrefixStats
from neuronfx.runtime.requests import Finished, Request, TokenEvent
from neuronfx.runtime.runtime import Runtime, init_state, with_draft
from neuronfx.runtime.scheduler import schedule
from neuronfx.runtime.speculate import SpeculateBatch, SpeculationStats, speculate_step
from neuronfx.runtime.state import State
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, decode_step, prefill_step, release

__all__ = [
    "ChunkBatch",
    "DecodeBatch",
    "Finished",
    "GenerateResult",
    "Logprobs",
    "PrefillBatch",
    "PrefixStats",
    "Request",
    "Runtime",
    "SpeculateBatch",
    "SpeculationStats",
    "State",
    "StepOutput",
    "TokenEvent",
    "chunk_step",
    "decode_step",
    "embed",
    "generate",
    "init_state",
    "prefill_cached",
    "prefill_step",
    "prefix_stats",
    "release",
    "schedule",
    "speculate_step",
    "stream_generate",
    "with_draft",
]
