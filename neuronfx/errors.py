"""Named errors raised by neuronfx.

Every error is raised before any state changes, and its message names the offending value,
the limit it broke and how to fix it.
"""


class NeuronfxError(Exception):
    """Base class of every error neuronfx raises on purpose."""


class ConfigError(NeuronfxError, ValueError):
    """A config field is missing, unknown, out of range or contradicts another field."""


class UnsupportedModelError(NeuronfxError, ValueError):
    """The checkpoint's architecture (HF ``model_type``) or one of its options is not supported."""


class CheckpointError(NeuronfxError, ValueError):
    """A checkpoint file or directory is missing, unreadable or has missing/extra/mis-shaped tensors."""


class BucketOverflowError(NeuronfxError, ValueError):
    """No compiled bucket is large enough for the requested length."""


class InputError(NeuronfxError, ValueError):
    """Step or generate input is invalid (shape, dtype, length, token ids, slots)."""


class PromptTooLongError(InputError):
    """A prompt is longer than ``max_context_length`` tokens."""


class SequenceLengthExceededError(InputError):
    """prompt length + ``max_new_tokens`` is more than the KV cache holds (``sequence_length``)."""


class BatchTooLargeError(InputError):
    """More prompts or rows than the compiled ``batch_size``."""


class EmptyPromptError(InputError):
    """A prompt has zero tokens."""


class TokenOutOfVocabError(InputError):
    """A token id is negative or not below ``vocab_size``."""


class SlotError(InputError):
    """A slot id is out of range, duplicated, free when it must be live, or live when it must be free."""


class SamplingParamsError(InputError):
    """A sampling parameter (top_k, top_p, temperature) is out of range or non-finite."""


class StateConsumedError(NeuronfxError, RuntimeError):
    """A state that a step already consumed was used again; use the state that step returned."""


class StateMismatchError(NeuronfxError, ValueError):
    """A state was made for a different runtime (other plan: KV shape or dtype differ)."""


class BackendUnavailableError(NeuronfxError, ImportError):
    """A backend's optional dependencies (e.g. torch-neuronx for ``neuron``) are not installed."""


class ArtifactError(NeuronfxError, ValueError):
    """A saved runtime or compile-cache entry is missing a file, corrupt, or was built for
    another neuronfx/torch version or machine."""


class TensorParallelError(NeuronfxError, RuntimeError):
    """A tensor-parallel rank failed, died or disagrees with the others (plan or weights)."""


class KVCacheFullError(InputError):
    """A step needs more free KV blocks than the blocks layout has left (``kv_layout="blocks"``)."""
