"""llama.cpp as a compared engine of ``neuronfx bench latency --compare llama.cpp``, through
llama-cpp-python's low-level API (ctypes bindings of ``llama.h``).

Only the benchmark needs it: llama-cpp-python is in the ``[bench]`` extra, never a runtime
dependency, and it is imported when the comparison starts (:func:`import_llama_cpp` names the
extra when it is missing). The high-level ``llama_cpp.Llama`` runs one sequence; to decode a
batch of B sequences per call the way llama.cpp's own ``batched`` example does, this module
fills one ``llama_batch`` with B sequence ids (``seq_id`` b for row b): the prefill is one
``llama_decode`` of all B prompts (B x prompt_len tokens, logits of each prompt's last token),
each decode step one ``llama_decode`` of B tokens. Greedy: the argmax of each row's logits
(``llama_get_logits_ith``), eos ignored, as neuronfx's bench. KV cache: a fresh context per run
(made before the clock starts) with ``n_seq_max = B`` and ``kv_unified = False`` (each sequence
its own cache: the sequences share no prefix). The token ids are written into the batch before
the prefill's clock starts (a python loop over B x prompt_len tokens is not llama.cpp's cost);
a decode step's clock includes writing its B tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from neuronfx.bench.timing import Engine
from neuronfx.errors import BackendUnavailableError

INSTALL_HINT = ("pip install 'neuronfx[bench]' (the benchmark extra; it builds llama.cpp from source with cmake and a C++ "
                "compiler, which takes minutes), or pip install llama-cpp-python")


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module; BackendUnavailableError naming the extra when it is missing."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise BackendUnavailableError(f"the llama.cpp engine (bench latency --compare llama.cpp, bench engines --engines llama.cpp) "
                                      f"needs llama-cpp-python: {INSTALL_HINT}.") from exc
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load log goes to stderr otherwise
    return llama_cpp


@contextmanager
def load_model(lib: Any, path: str) -> Iterator[Any]:
    """A ``llama_model`` of the GGUF at ``path`` (CPU, memory-mapped as llama.cpp's default)."""
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    try:
        yield model
    finally:
        lib.llama_model_free(model)


@contextmanager
def new_context(lib: Any, model: Any, batch_size: int, ctx_per_seq: int, max_batch_tokens: int, threads: int) -> Iterator[Any]:
    """A ``llama_context`` for ``batch_size`` sequences of up to ``ctx_per_seq`` positions each,
    taking up to ``max_batch_tokens`` tokens per ``llama_decode``, on ``threads`` threads
    (prefill and decode alike); other parameters are llama.cpp's defaults (ubatch 512, flash
    attention auto, f16 KV cache)."""
    params = lib.llama_context_default_params()
    params.n_seq_max = batch_size
    params.kv_unified = False
    params.n_ctx = batch_size * ctx_per_seq
    params.n_batch = max_batch_tokens
    params.n_threads = threads
    params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context for {batch_size} sequences of {ctx_per_seq} tokens")
    try:
        yield ctx
    finally:
        lib.llama_free(ctx)


def fill_batch(batch: Any, rows: list[list[int]], start: list[int]) -> list[int]:
    """Put ``rows[b]`` (token ids) at positions ``start[b]``... into ``batch`` under seq id b,
    logits for each row's last token only. Returns the batch index of each row's last token."""
    i, last = 0, []
    for b, tokens in enumerate(rows):
        for j, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = start[b] + j
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = b
            batch.logits[i] = j == len(tokens) - 1
            i += 1
        last.append(i - 1)
    batch.n_tokens = i
    return last


def decode_greedy(lib: Any, ctx: Any, batch: Any, last: list[int], n_vocab: int) -> list[int]:
    """One ``llama_decode`` of the filled ``batch``, then the argmax of the logits at each
    row's last batch index ``last[b]``."""
    rc = lib.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return [int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax()) for i in last]


def time_llama_cpp(lib: Any, model: Any, prompts: list[list[int]], gen_len: int, threads: int) -> tuple[float, list[float]]:
    """Greedy run of ``prompts`` (B rows of token ids, equal lengths) for ``gen_len`` tokens per
    row in a fresh context: (TTFT, [ITL per decode step]) in seconds, as ``time_neuronfx``."""
    ttft, itl, _ = run_llama_cpp(lib, model, prompts, gen_len, threads)
    return ttft, itl


def greedy_llama_cpp(lib: Any, model: Any, prompts: list[list[int]], gen_len: int, threads: int) -> list[list[int]]:
    """llama.cpp's greedy tokens of ``prompts``: B rows of ``gen_len`` ids."""
    return run_llama_cpp(lib, model, prompts, gen_len, threads)[2]


def run_llama_cpp(lib: Any, model: Any, prompts: list[list[int]], gen_len: int, threads: int) -> tuple[float, list[float], list[list[int]]]:
    """Greedy run of ``prompts`` in a fresh context: (TTFT, [ITL per decode step], B rows of
    ``gen_len`` generated ids)."""
    b, p = len(prompts), len(prompts[0])
    ctx_per_seq = -(-(p + gen_len) // 256) * 256
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    with new_context(lib, model, b, ctx_per_seq, max(b * p, b), threads) as ctx:
        batch = lib.llama_batch_init(max(b * p, b), 0, 1)
        try:
            last = fill_batch(batch, prompts, [0] * b)  # filled before the clock: python's loop over b * p tokens is not llama.cpp's
            t0 = time.perf_counter()
            tokens = decode_greedy(lib, ctx, batch, last, n_vocab)
            ttft = time.perf_counter() - t0
            itl, rows = [], [[t] for t in tokens]
            for step in range(gen_len - 1):
                t0 = time.perf_counter()
                last = fill_batch(batch, [[t] for t in tokens], [p + step] * b)
                tokens = decode_greedy(lib, ctx, batch, last, n_vocab)
                itl.append(time.perf_counter() - t0)
                for row, t in zip(rows, tokens):
                    row.append(t)
        finally:
            lib.llama_batch_free(batch)
    return ttft, itl, rows


def gguf_decode_bytes(path: str, batch_size: int) -> int:
    """Bytes of the GGUF's tensors a llama.cpp decode step reads: every tensor in full except
    the token embedding, of which only ``batch_size`` rows, unless the file has no
    ``output.weight`` (a tied LM head: llama.cpp multiplies by the whole embedding)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for name, t in tensors.items() if name != "token_embd.weight")
    embed = tensors.get("token_embd.weight")
    if embed is not None:
        rows = int(embed.shape[-1])  # ggml shapes list the contiguous dim first: (hidden, vocab)
        total += int(embed.n_bytes) if "output.weight" not in tensors else int(embed.n_bytes) * batch_size // rows
    return total


def gguf_weight_type(path: str) -> str:
    """The ggml type most of the GGUF's matrices are stored in ("Q4_1" for SmolLM2's file)."""
    from collections import Counter

    from gguf import GGUFReader

    types = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return types.most_common(1)[0][0] if types else "unknown"


@contextmanager
def llama_cpp_engine(path: str, threads: int) -> Iterator[Engine]:
    """llama.cpp on the GGUF at ``path`` with ``threads`` threads, its model held while the block
    runs. Raises BackendUnavailableError (naming the extra) when llama-cpp-python is missing."""
    lib = import_llama_cpp()
    with load_model(lib, path) as model:
        yield Engine(name="llama.cpp", backend="ggml-cpu", dtype=gguf_weight_type(path),
                     time=lambda prompts, gen_len: time_llama_cpp(lib, model, prompts, gen_len, threads),
                     decode_bytes=lambda batch_size: gguf_decode_bytes(path, batch_size),
                     tokens=lambda prompts, gen_len: greedy_llama_cpp(lib, model, prompts, gen_len, threads))
