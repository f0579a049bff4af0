"""A stand-in for llama-cpp-python's low-level API (the calls ``neuronfx.bench.llama_cpp`` makes),
over plain Python and numpy: the benchmarks' llama.cpp code paths run in the suite without the
package. Its "model" predicts token ``(t + 1) % vocab`` after token ``t``, so greedy tokens are
known; every ``llama_decode`` is recorded as (token, position, sequence id, logits wanted) rows."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np


class FakeLlamaCpp:
    """Install with ``monkeypatch.setitem(sys.modules, "llama_cpp", FakeLlamaCpp(vocab))``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.decodes: list[list[tuple[int, int, int, bool]]] = []
        self.contexts: list[SimpleNamespace] = []
        self.loaded: list[bytes] = []
        self.freed: list[str] = []
        self.logits: dict[int, np.ndarray] = {}
        self.llamas: list[FakeLlama] = []

    def llama_backend_init(self) -> None:
        pass

    def llama_model_default_params(self) -> SimpleNamespace:
        return SimpleNamespace()

    def llama_model_load_from_file(self, path: bytes, params: SimpleNamespace) -> str:
        self.loaded.append(path)
        return "model"

    def llama_model_free(self, model: str) -> None:
        self.freed.append("model")

    def llama_context_default_params(self) -> SimpleNamespace:
        return SimpleNamespace()

    def llama_init_from_model(self, model: str, params: SimpleNamespace) -> SimpleNamespace:
        self.contexts.append(params)
        return params

    def llama_free(self, ctx: SimpleNamespace) -> None:
        self.freed.append("context")

    def llama_batch_init(self, n_tokens: int, embd: int, n_seq_max: int) -> SimpleNamespace:
        return SimpleNamespace(token=[0] * n_tokens, pos=[0] * n_tokens, n_seq_id=[0] * n_tokens,
                               seq_id=[[0] for _ in range(n_tokens)], logits=[False] * n_tokens, n_tokens=0)

    def llama_batch_free(self, batch: SimpleNamespace) -> None:
        self.freed.append("batch")

    def llama_decode(self, ctx: SimpleNamespace, batch: SimpleNamespace) -> int:
        rows = [(batch.token[i], batch.pos[i], batch.seq_id[i][0], bool(batch.logits[i])) for i in range(batch.n_tokens)]
        self.decodes.append(rows)
        self.logits = {}
        for i, (token, _, _, wanted) in enumerate(rows):
            if wanted:
                self.logits[i] = np.zeros(self.vocab, dtype=np.float32)
                self.logits[i][(token + 1) % self.vocab] = 1.0
        return 0

    def llama_get_logits_ith(self, ctx: SimpleNamespace, i: int) -> object:
        return self.logits[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def llama_model_get_vocab(self, model: str) -> str:
        return "vocab"

    def llama_vocab_n_tokens(self, vocab: str) -> int:
        return self.vocab

    # --- the high-level API of ``neuronfx bench prompt-lookup`` ---------------------------------

    def Llama(self, model_path: str, draft_model: object = None, **params: object) -> FakeLlama:
        llm = FakeLlama(self.vocab, model_path, draft_model, params)
        self.llamas.append(llm)
        return llm


class FakeLlama:
    """``llama_cpp.Llama``: ``generate`` yields the fake model's greedy tokens ((t + 1) % vocab)
    forever; a ``draft_model`` is called on the sequence before each token and its drafts are
    recorded (the tokens are the same either way, as greedy prompt lookup's)."""

    def __init__(self, vocab: int, model_path: str, draft_model: object, params: dict) -> None:
        self.vocab, self.model_path, self.draft_model, self.params = vocab, model_path, draft_model, params
        self.drafts: list[list[int]] = []

    def token_eos(self) -> int:
        return 0

    def generate(self, tokens: list[int], temp: float = 0.8, reset: bool = True):
        seq = list(tokens)
        while True:
            if self.draft_model is not None:
                self.drafts.append([int(t) for t in self.draft_model(np.array(seq, dtype=np.intc))])
            seq.append((seq[-1] + 1) % self.vocab)
            yield seq[-1]


class FakePromptLookup:
    """``llama_cpp.llama_speculative.LlamaPromptLookupDecoding``: drafts the tokens after the
    last token's earliest earlier occurrence."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10) -> None:
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        ids = input_ids.tolist()
        hits = [i for i in range(len(ids) - 1) if ids[i] == ids[-1]]
        return np.array(ids[hits[0] + 1 : hits[0] + 1 + self.num_pred_tokens] if hits else [], dtype=np.intc)


def install_high_level(monkeypatch: object, fake: FakeLlamaCpp) -> None:
    """Put ``fake`` and its ``llama_speculative`` module in sys.modules (``monkeypatch``)."""
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", SimpleNamespace(LlamaPromptLookupDecoding=FakePromptLookup))
