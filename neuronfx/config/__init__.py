"""Frozen configs and the pure functions derived from them (no nn.Module, no device state)."""

from neuronfx.config.buckets import chunk_buckets, generate_buckets, select_bucket
from neuronfx.config.families import FAMILIES, SUPPORTED_MODEL_TYPES
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.inputs import PHASE_INPUTS, ChunkInputs, DecodeInputs, PrefillInputs, SamplerInputs, SpeculateInputs
from neuronfx.config.kv import KVAccess, KVLayout, chunk_access, decode_access, prefill_access
from neuronfx.config.masks import chunk_mask, decode_mask, prefill_mask
from neuronfx.config.model import ModelConfig, RopeScaling
from neuronfx.config.plan import GraphSpec, Plan, TensorSpec, make_plan
from neuronfx.config.sampling import SamplingParams, check_sampling, pack_sampling
from neuronfx.config.serialization import plan_from_json, plan_to_json, structure, unstructure
from neuronfx.config.structured import StructuredOutputs

__all__ = [
    "FAMILIES",
    "PHASE_INPUTS",
    "SUPPORTED_MODEL_TYPES",
    "ChunkInputs",
    "DecodeInputs",
    "GraphSpec",
    "InferenceConfig",
    "KVAccess",
    "KVLayout",
    "ModelConfig",
    "Plan",
    "PrefillInputs",
    "RopeScaling",
    "SamplerInputs",
    "SamplingParams",
    "SpeculateInputs",
    "StructuredOutputs",
    "TensorSpec",
    "check_sampling",
    "chunk_access",
    "chunk_buckets",
    "chunk_mask",
    "decode_access",
    "decode_mask",
    "generate_buckets",
    "make_plan",
    "pack_sampling",
    "plan_from_json",
    "plan_to_json",
    "prefill_access",
    "prefill_mask",
    "select_bucket",
    "structure",
    "unstructure",
]
