"""Explicit state and dispatch: compile, init_state, step functions and generate."""

from neuronfx.runtime.generate import GenerateResult, generate
from neuronfx.runtime.scheduler import Finished, Request, TokenEvent, schedule
from neuronfx.runtime.speculate import Draft, SpeculationStats, generate_speculative
from neuronfx.runtime.runtime import Runtime, compile, init_state
from neuronfx.runtime.state import State
from neuronfx.runtime.steps import DecodeBatch, Logprobs, PrefillBatch, StepOutput, decode_step, prefill_step, release

__all__ = [
    "DecodeBatch", "Draft", "Finished", "SpeculationStats", "generate_speculative", "GenerateResult", "Logprobs", "PrefillBatch", "Request", "Runtime", "State",
    "StepOutput", "TokenEvent", "compile", "decode_step", "generate", "init_state", "prefill_step", "release",
    "schedule",
]
