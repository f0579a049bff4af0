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
