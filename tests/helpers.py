"""Shared builders for runtime tests: tiny random HF models, their runtimes, step drivers, a tiny
GGUF writer, and a ``neuronfx serve`` subprocess with plain-HTTP helpers.

Import as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

import neuronfx
from neuronfx import (
    ChunkBatch,
    DecodeBatch,
    InferenceConfig,
    ModelConfig,
    PrefillBatch,
    Runtime,
    SamplingParams,
    State,
    chunk_step,
    make_plan,
)
from neuronfx.runtime.pipeline import NO_TOKEN

# One intra-op thread: these graphs are tiny, and with 2 threads on a busy 2-core machine every op
# waits on an OpenMP barrier (measured ~40x slower per decode step under contention).
torch.set_num_threads(1)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "llama4_text", "phi3", "mixtral", "qwen3_moe", "gemma3_text")


def gemma3_random_norms(config: Gemma3TextConfig) -> Gemma3ForCausalLM:
    """Gemma3ForCausalLM with random RMSNorm weights: transformers initialises them to 0 (a scale
    of 1 + 0), which would hide a swapped or missing norm."""
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    return model


# Gemma 3 text: 2 layers (sliding over 5 tokens, then global), vocabulary 257 (not a multiple of
# 64), head_dim 32 != hidden / heads, query_pre_attn_scalar 24 != head_dim, local RoPE base 100
# != rope_theta, logits soft-capped at 0.5 (the tiny model's logits reach ~1: tanh bends them).
GEMMA3 = {"vocab_size": 257, "head_dim": 32, "sliding_window": 5, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
          "rope_theta": 10000.0, "rope_local_base_freq": 100.0, "final_logit_softcapping": 0.5}
_HF_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # head_dim != hidden / heads
    # Granite's four scalars away from 1 (granite-3's are 12, 0.22, 1/128 and 8)
    "granite": (GraniteConfig, GraniteForCausalLM, {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                                    "attention_multiplier": 0.1, "logits_scaling": 2.0, "vocab_size": 257}),
    # Layer 1 of 2 is NoPE (no_rope_layers [1, 0]); its config's token ids lie outside the tiny vocabulary
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {"no_rope_layer_interval": 2, "pad_token_id": None,
                                                    "bos_token_id": None, "eos_token_id": None, "vocab_size": 257}),
    "gemma3_text": (Gemma3TextConfig, gemma3_random_norms, GEMMA3),
    # Layer 0 RoPE with chunks of 6 tokens, layer 1 NoPE with temperature tuning (floor 4 tokens),
    # 4 experts top-2 and a shared expert; weights 5x transformers' default scale so the experts
    # and the temperature move the logits (tests check they do)
    "llama4_text": (Llama4TextConfig, Llama4ForCausalLM, {
        "vocab_size": 257, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "attention_chunk_size": 6, "no_rope_layer_interval": 2, "floor_scale": 4, "attn_scale": 0.5,
        "initializer_range": 0.1, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    # Phi-3 as Phi-4-mini configures it: RoPE on 12 of 16 head dims (partial_rotary_factor 0.75)
    # with longrope, whose switch (original_max_position_embeddings=20) lies inside the tiny
    # ladders; vocabulary 250 (not a multiple of 64) and its special ids inside it.
    "phi3": (Phi3Config, Phi3ForCausalLM, {
        "vocab_size": 250, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "original_max_position_embeddings": 20,
        "rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0], "long_factor": [1.0, 3.0, 6.0, 12.0, 24.0, 48.0]}}),
    # Mixture of experts, top-2, vocabulary 257 (not a multiple of 64; random_prompt ids stay < 256)
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 257}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                                        "head_dim": 32, "vocab_size": 257}),
}
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
VOCAB = TINY["vocab_size"]

# Small explicit bucket ladders so every boundary is cheap to reach.
TINY_INFERENCE = dict(
    batch_size=4, max_context_length=32, sequence_length=64,
    prefill_buckets=(8, 16, 32), decode_buckets=(16, 32, 64), output_logits=True,
)
GREEDY = SamplingParams()


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
"""Marks a test (or a param) that runs on a CUDA device only: skipped, for that reason alone,
where torch sees none (CI has no GPU; tests/device/run_on_gpu.sh runs them on a lent one)."""


def devices() -> list:
    """The devices a device-parametrized test runs on, as pytest params: "cpu" always, "cuda"
    marked :data:`NEEDS_CUDA`."""
    return ["cpu", pytest.param("cuda", marks=NEEDS_CUDA, id="cuda")]


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A random 2-layer transformers model (hidden 64, 4 heads, 2 kv heads, vocab 256), fp32, eval,
    its biases (if any) random too; ``overrides`` are config fields."""
    config_cls, model_cls, extra = _HF_CLASSES[model_type]
    torch.manual_seed(seed)
    fields = copy.deepcopy(TINY | extra | overrides)  # transformers edits rope_parameters in place
    model = model_cls(config_cls(**fields)).to(torch.float32).eval()
    model.generation_config.eos_token_id = None  # tests choose eos explicitly
    with torch.no_grad():  # transformers initialises biases to zero: random ones are seen by the tests
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def tiny_plan(hf_model: PreTrainedModel, backend: str = "eager", **overrides: object) -> neuronfx.Plan:
    if backend != "eager":
        # Compiled backends build one graph per (phase, batch bucket, length bucket): compile only
        # the full batch unless a test asks (batch buckets are exercised on eager).
        overrides = {"batch_buckets": (overrides.get("batch_size", TINY_INFERENCE["batch_size"]),)} | overrides
    inference = InferenceConfig(**(TINY_INFERENCE | {"backend": backend} | overrides))
    return make_plan(ModelConfig.from_hf(hf_model.config, hf_model.generation_config), inference)


def tiny_runtime(hf_model: PreTrainedModel, backend: str = "eager", **overrides: object) -> Runtime:
    """Compile ``hf_model``'s weights with the tiny bucket plan; ``overrides`` are InferenceConfig fields."""
    return neuronfx.compile(tiny_plan(hf_model, backend, **overrides), hf_model.state_dict(), progress=False)


def smollm2_vocab_model(path: str, seed: int = 7) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer): a tiny random llama with SmolLM2-135M-Instruct's 49152-token
    vocabulary, bos and eos, saved to ``path`` with SmolLM2's real tokenizer and chat template
    (read from the default model's GGUF by neuronfx's loader): a model directory the CLI and the
    server load like any checkpoint, whose text is real text."""
    from neuronfx.io.checkpoints import default_model_path, load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    hf = tiny_hf_model("llama", seed=seed, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, max_position_embeddings=256)
    hf.generation_config.eos_token_id = tokenizer.eos_token_id
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf, tokenizer


def kv_tensors(state: State) -> list[torch.Tensor]:
    """Every K and V tensor of ``state``'s KV cache (layer 0 K, layer 0 V, layer 1 K, ...)."""
    return [t for layer in state.kv for t in layer]


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


@torch.no_grad()
def hf_last_logits(hf_model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """transformers' logits [vocab] for the token after ``ids``."""
    return hf_model(torch.tensor([list(ids)])).logits[0, -1].float()


@torch.no_grad()
def hf_greedy(hf_model: PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    """``n`` greedy tokens from ``hf_model.generate`` (no eos stop)."""
    ids = torch.tensor([list(prompt)])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
        eos_token_id=None, pad_token_id=0,
    )
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == n, f"transformers stopped early: {tokens}"
    return tokens


def run_steps(
    runtime: Runtime, state: State, slots: Sequence[int], prompts: Sequence[Sequence[int]], n: int,
    sampling: SamplingParams = GREEDY,
) -> tuple[list[list[int]], list[list[torch.Tensor]], list[int], State]:
    """Prefill ``prompts`` into ``slots``, then decode until each row has ``n`` tokens.

    Returns (tokens [row][n], logits [row][n] each [vocab], buckets per step, state); the slots
    stay live.
    """
    rows = range(len(prompts))
    out, state = neuronfx.prefill_step(
        runtime, state, PrefillBatch(seq_ids=slots, prompts=prompts, sampling=[sampling] * len(prompts))
    )
    tokens = [[t] for t in out.tokens]
    logits = [[out.logits[r].clone()] for r in rows]
    buckets = [out.bucket]
    for _ in range(n - 1):
        batch = DecodeBatch(seq_ids=slots, input_ids=[tokens[r][-1] for r in rows], sampling=[sampling] * len(prompts))
        out, state = neuronfx.decode_step(runtime, state, batch)
        for r in rows:
            tokens[r].append(out.tokens[r])
            logits[r].append(out.logits[r].clone())
        buckets.append(out.bucket)
    return tokens, logits, buckets, state


def bf16_logit_errors(hf_model: PreTrainedModel, steps: int = 8) -> list[float]:
    """Max |logit error| per decode step of an eager bf16 run (batch 1, prompt of 11) against
    transformers in fp32 on the same weights rounded to bf16 (``hf_model`` is rounded in place)."""
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rt = tiny_runtime(hf_model, "eager", batch_size=1, dtype="bfloat16", prefill_buckets=(32,), decode_buckets=(64,))
    prompt = random_prompt(11, seed=5)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], steps)
    return [(logits[0][i] - hf_last_logits(hf_model, prompt + tokens[0][:i])).abs().max().item() for i in range(steps)]


# --- a tiny GGUF file --------------------------------------------------------------------------------

# GGUF (llama.cpp) name of each HF linear, and its ggml type per layer: every kept block type and
# F32 / F16 appear, on Q/K (whose rows llama.cpp permutes) and on plain rows alike.
GGUF_LINEARS = {
    "attn_q": ("self_attn.q_proj", ("F32", "Q4_1")), "attn_k": ("self_attn.k_proj", ("F16", "Q4_0")),
    "attn_v": ("self_attn.v_proj", ("Q8_0", "Q4_1")), "attn_output": ("self_attn.o_proj", ("Q4_0", "Q8_0")),
    "ffn_gate": ("mlp.gate_proj", ("Q4_1", "F16")), "ffn_up": ("mlp.up_proj", ("Q8_0", "Q4_1")),
    "ffn_down": ("mlp.down_proj", ("Q4_0", "Q4_1")),
}
GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GGUF_CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
                      "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` of Q/K rows (what loaders undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of ``size`` tokens: the 3 control tokens of GGUF_SPECIALS, byte
    characters, and 3 merged tokens (tokens, token types, merges)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["a b", "Ġ t", "h e"]
    merged = [m.replace(" ", "") for m in merges]
    chars = [c for c in bytes_to_unicode().values() if c not in merged]
    tokens = [*GGUF_SPECIALS, *chars[-(size - 6):], *merged]
    return tokens, [3, 3, 3] + [1] * (size - 3), merges


def write_tiny_gguf(path: str, hf_model: PreTrainedModel, types: Mapping[str, str] | None = None) -> str:
    """Write a tiny llama, qwen3 or qwen3_moe ``hf_model`` (vocab >= 200) as llama.cpp would:
    GGUF v3, the architecture's metadata, a byte-level BPE tokenizer with a chat template,
    tensors named by gguf-py's ``TensorNameMap``, llama's Q/K rows permuted, the linears
    quantized to the types of GGUF_LINEARS (gguf.quants; ``types``: GGUF tensor kind, e.g.
    "attn_q", -> one type for every layer instead), norms and MoE experts F32, embeddings Q8_0,
    an untied LM head Q4_1. Returns ``path``."""
    import gguf

    cfg = hf_model.config
    arch = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    writer = gguf.GGUFWriter(path, arch=arch)
    _gguf_metadata(writer, cfg)
    T = gguf.GGMLQuantizationType
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    for name, w in hf_model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused (E, 2I, H): llama.cpp stores the halves
            layer, half = name.split(".")[2], w.shape[1] // 2
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half].float().numpy().copy())
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", w[:, half:].float().numpy().copy())
            continue
        base, _, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "weight")
        gguf_name = names.get_name(base)
        kind = gguf_name.split(".")[-1]
        ggml_type = ({"token_embd": "Q8_0", "output": "Q4_1"} | dict(types or {})).get(kind) or (
            GGUF_LINEARS[kind][1][int(gguf_name.split(".")[1]) % 2] if kind in GGUF_LINEARS else "F32")
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
        writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(w.float().numpy(), T[ggml_type]), raw_dtype=T[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_metadata(writer: object, cfg: object) -> None:
    """llama.cpp's metadata for ``cfg``: shape, RoPE, experts, and the tokenizer (_gguf_vocab)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_experts", None):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    tokens, types, merges = _gguf_vocab(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(GGUF_CHAT_TEMPLATE)


# --- a `neuronfx serve` subprocess ---------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]


@attrs.frozen(eq=False)
class ServerProcess:
    """A ``python -m neuronfx serve`` subprocess on a loopback port, its output in ``log``."""

    proc: subprocess.Popen
    host: str
    port: int
    log: Path
    loading: list = attrs.field(factory=list)  # (path, status, body) of /health and /v1/models while the model loaded

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: Sequence[str], log: Path, timeout: float = 120.0) -> ServerProcess:
    """Start ``neuronfx serve ARGS`` (this interpreter, repo root as cwd, one intra-op thread) on a
    free loopback port and wait until GET /health answers 200; the first answers of /health and
    /v1/models while it was loading are kept in ``loading``. Fails with the server's log when it
    exits or is not ready within ``timeout`` seconds."""
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "neuronfx", "serve", *args, "--port", str(port)], cwd=REPO_ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(proc=proc, host="127.0.0.1", port=port, log=log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"neuronfx serve exited with {proc.returncode}:\n{server.output()}")
        try:
            status, _, body = http_request(server, "GET", "/health")
            if status == 200:
                return server
            if not server.loading:
                server.loading.extend([("/health", status, body), ("/v1/models", *http_request(server, "GET", "/v1/models")[::2])])
        except OSError:  # not listening yet
            pass
        time.sleep(0.1)
    stop_server(server)
    raise AssertionError(f"neuronfx serve was not ready after {timeout} s:\n{server.output()}")


def stop_server(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def http_request(server: ServerProcess, method: str, path: str, body: bytes | dict | None = None,
                 timeout: float = 60.0) -> tuple[int, dict[str, str], object]:
    """(status, headers, JSON body or text) of one plain HTTP request; a dict body is sent as JSON."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data is not None else {})
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = raw
        return resp.status, dict(resp.getheaders()), payload
    finally:
        conn.close()


def server_metrics(server: ServerProcess) -> dict[str, float]:
    """The server's /metrics samples by name, labels appended as ``name{key="value"}``
    (prometheus-client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = http_request(server, "GET", "/metrics")
    assert status == 200, text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def chunked_prefill(rt, state, slots, prompts, size, sampling=GREEDY):
    """Prefill ``prompts`` into ``slots`` chunk by chunk, ragged rows in one batch until each
    ends; returns (first tokens, logits at each prompt's last token, state)."""
    done, tokens, logits = [0] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows = [r for r, p in enumerate(prompts) if done[r] < len(p)]
        chunks = [prompts[r][done[r]:done[r] + size] for r in rows]
        final = [done[r] + len(c) == len(prompts[r]) for r, c in zip(rows, chunks)]
        batch = ChunkBatch(seq_ids=[slots[r] for r in rows], chunks=chunks, sampling=[sampling] * len(rows), final=final)
        out, state = chunk_step(rt, state, batch)
        for i, r in enumerate(rows):
            done[r] += len(chunks[i])
            assert out.new_tokens[i] == ((out.tokens[i],) if final[i] else ()) and (final[i] or out.tokens[i] == NO_TOKEN)
            if final[i]:
                tokens[r], logits[r] = out.tokens[i], out.logits[i].clone()
            else:
                assert state.generated[slots[r]] == 0 and state.live[slots[r]]
    return tokens, logits, state


def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet of the tokenizers library)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer() -> object:
    """A byte-level fast tokenizer (built in-process, no merges) for the tiny models' vocabulary
    of 256: token b is byte b for b in 1..255, token 0 is ``<eos>`` (byte 0 cannot be written).
    Any ASCII text encodes and decodes exactly, so regex and JSON constraints can be satisfied."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _byte_unicode()
    tok = Tokenizer(models.BPE(vocab={"<eos>": 0, **{b2u[b]: b for b in range(1, 256)}}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@contextlib.contextmanager
def serving(rt: Runtime) -> Iterator[object]:
    """The app (a FastAPI TestClient) over an engine serving ``rt`` with the byte tokenizer, started and ready."""
    from fastapi.testclient import TestClient

    from neuronfx.server.app import make_app
    from neuronfx.server.engine import Engine
    from neuronfx.server.metrics import make_metrics
    from neuronfx.server.served import Served

    engine = Engine(lambda: Served(runtime=rt, tokenizer=byte_tokenizer()), max_waiting=4, metrics=make_metrics())
    with TestClient(make_app(engine, "tiny"), raise_server_exceptions=False) as client:
        while client.get("/health").status_code != 200:
            pass
        yield client
