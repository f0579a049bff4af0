"""The CLI: checks that must fail at once, before the model is loaded, and generate with every
sampling option, plain and speculative, on a tiny model directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import byte_tokenizer, tiny_hf_model

from neuronfx.cli import main


@pytest.mark.parametrize(
    "args, error",
    [
        (["--seed", "99999999999999999999999"], "InputError"),
        (["--seed", "-1"], "InputError"),
        (["--max-new-tokens", "0"], "InputError"),
        (["--max-new-tokens", "600"], "SequenceLengthExceededError"),
        (["--stream", "--json"], "InputError"),
        (["--min-p", "2"], "SamplingParamsError"),
        (["--logprobs", "21", "--json"], "SamplingParamsError"),
        (["--logprobs", "2"], "InputError"),  # printed in --json's object only
        (["--presence-penalty", "3"], "SamplingParamsError"),
        (["--repetition-penalty", "0"], "SamplingParamsError"),
        (["--min-tokens", "-1"], "SamplingParamsError"),
        (["--min-tokens", "65"], "SamplingParamsError"),  # > --max-new-tokens 64
        (["--backend", "neuron"], "BackendUnavailableError"),
        (["--max-context-length", "1024"], "ConfigError"),
        (["--batch-size", "0"], "ConfigError"),
        (["--top-p", "0"], "SamplingParamsError"),
        (["--top-k", "100000"], "SamplingParamsError"),
        (["--model", "/nonexistent/model.gguf"], "CheckpointError"),
        (["--device", "cuda:99"], "ConfigError"),  # no such GPU, here or on a lent one
        (["--device", "tpu"], "ConfigError"),
        (["--speculation-length", "4"], "InputError"),
        (["--draft-layers", "2"], "InputError"),
        (["--fused-speculation"], "InputError"),
        (["--json-schema", "/nonexistent/schema.json"], "InputError"),
        (["--grammar", "/nonexistent/grammar.lark"], "InputError"),
        (["--json-schema", __file__], "SamplingParamsError"),  # not JSON
        (["--logit-bias", "x=1"], "InputError"),
        (["--logit-bias", "5=150"], "SamplingParamsError"),  # outside [-100, 100]
    ],
)
def test_generate_rejects_bad_options_before_loading(args, error, capsys):
    t0 = time.perf_counter()
    assert main(["generate", *args]) == 2
    assert time.perf_counter() - t0 < 5  # the model load takes ~25 s: it did not happen
    err = capsys.readouterr().err
    assert f"error: {error}:" in err


@pytest.mark.parametrize("args, named", [
    (["--prompt", "caf\udce9"], "--prompt 'caf\\udce9' has byte 0xE9 at character 3"),
    (["--chat", "\udcff"], "--chat '\\udcff' has byte 0xFF at character 0"),
    (["--stop=x\udc80"], "--stop 'x\\udc80' has byte 0x80 at character 1"),
])
def test_text_that_is_not_utf8_is_refused_before_loading(args, named, capsys):
    """A byte that is not UTF-8 in a text option (Python decodes argv with surrogateescape: 0xE9
    arrives as U+DCE9, which the tokenizer raises a TypeError on) is an InputError naming the
    option, the byte and where it is, before the model loads."""
    assert main(["generate", "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert f"error: InputError: {named}, which is not UTF-8; pass UTF-8 text" in err


@pytest.mark.parametrize("args, message", [
    (["--pooling", "mean"], "--pooling applies only with --task embed; add it, or drop --pooling."),
    (["--no-normalize"], "--no-normalize applies only with --task embed; add it, or drop --no-normalize."),
    (["--weight-group-size", "64", "--weight-format", "int8"],
     "--weight-group-size applies only with --weight-format int4; add it, or drop --weight-group-size."),
    (["--prompt-lookup-min", "2", "--prompt-lookup-max", "3"], "--prompt-lookup-min and --prompt-lookup-max apply only with "
     "--speculative-method ngram --num-speculative-tokens K; add it, or drop --prompt-lookup-min and --prompt-lookup-max."),
    (["--prefix-block-size", "8"], "--prefix-block-size applies only with --enable-prefix-caching; add it, or drop --prefix-block-size."),
    (["--max-prefix-blocks", "8"], "--max-prefix-blocks applies only with --enable-prefix-caching; add it, or drop --max-prefix-blocks."),
])
def test_an_option_its_plan_would_ignore_is_refused(args, message, capsys):
    """A plan option read only under another (InferenceConfig ignores it otherwise) is an
    InputError naming it and what it needs, before loading, in every command that plans."""
    for command in ("generate", "plan", "compile"):
        assert main([command, *args, *(["--out", "/nonexistent/out"] if command == "compile" else [])]) == 2
        assert f"error: InputError: {message}" in capsys.readouterr().err, command


def test_options_with_what_they_need_are_accepted():
    """The same options with what they need pass the check (InferenceConfig takes them)."""
    from neuronfx import InferenceConfig
    from neuronfx.cli.options import check_options_apply

    for options in ({"task": "embed", "pooling": "mean", "normalize": False}, {"weight_format": "int4", "weight_group_size": 64},
                    {"speculative_method": "ngram", "speculation_length": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
                    {"enable_prefix_caching": True, "prefix_block_size": 8, "max_prefix_blocks": 8}, {}):
        check_options_apply(options)
        InferenceConfig(**options)


def test_a_path_that_is_not_utf8_is_a_path(capsys):
    """A file name that is not UTF-8 is not text for the tokenizer: it opens through the same
    surrogateescape, so a missing one is the checkpoint's error, not the text check's."""
    assert main(["generate", "--max-new-tokens", "2", "--model", "/nonexistent/caf\udce9.gguf"]) == 2
    assert "error: CheckpointError" in capsys.readouterr().err


def test_an_unknown_option_shows_its_commands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--frobnicate", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: neuronfx generate ")
    assert err.endswith("neuronfx generate: error: unrecognized arguments: --frobnicate 3\n")


def test_commands_and_benchmarks_are_one_module_each():
    """Each module of neuronfx/cli/ exporting COMMAND is listed once in COMMANDS (and each of
    neuronfx/bench/ exporting BENCHMARK in BENCHMARKS): adding one is a module and an entry."""
    import importlib
    import pkgutil

    import neuronfx.bench
    import neuronfx.cli
    from neuronfx.bench import BENCHMARKS
    from neuronfx.cli import COMMANDS

    for package, listed, name in ((neuronfx.cli, COMMANDS, "COMMAND"), (neuronfx.bench, BENCHMARKS, "BENCHMARK")):
        exported = [getattr(m, name) for info in pkgutil.iter_modules(package.__path__)
                    if hasattr(m := importlib.import_module(f"{package.__name__}.{info.name}"), name)]
        assert sorted(e.name for e in exported) == sorted(e.name for e in listed) and len({e.name for e in listed}) == len(listed)


@pytest.mark.parametrize("argv", [[], ["generate"], ["chat"], ["serve"], ["compile"], ["plan"], ["cache", "list"], ["check-accuracy"],
                                  ["env"], ["bench"], ["bench-serving"], *[["bench", name] for name in (
                                      "latency", "serving", "throughput", "speculative", "tensor-parallel", "weight-formats",
                                      "prefix-caching", "chunked-prefill", "async", "moe", "kernels", "artifacts", "structured", "choices", "prompt-lookup",
                                      "step-bound", "engines")]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith(f"usage: neuronfx {' '.join(argv)}".rstrip())


def test_env_reports_this_machine(capsys, monkeypatch):
    import platform

    import torch
    import transformers

    from neuronfx.io import checkpoints

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["env", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["torch"], found["transformers"], found["python"]) == (torch.__version__, transformers.__version__,
                                                                         platform.python_version())
    assert found["OMP_NUM_THREADS"] == "2" and found["torch_threads"] == torch.get_num_threads()
    assert found["cuda_devices"] == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert found["default_model"] == checkpoints.default_model_path()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny llama directory with a word-level tokenizer: token i is the word "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tiny_hf_model("llama", seed=3).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


OPTIONS = ["--repetition-penalty", "1.4", "--presence-penalty", "0.5", "--frequency-penalty", "0.3", "--min-p", "0.05",
           "--logprobs", "2", "--min-tokens", "2", "--ignore-eos", "--max-new-tokens", "12", "--backend", "eager",
           "--batch-size", "2", "--max-context-length", "32", "--sequence-length", "64"]


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_generate_structured_options(tmp_path, capsys):
    """--choice / --regex / --json-schema / --grammar through a tiny llama with a byte-level tokenizer."""
    tiny_hf_model("llama", seed=3).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "schema.json").write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                      "required": ["ok"], "additionalProperties": False}))
    (tmp_path / "g.lark").write_text('start: "a" | "bb"')
    base = ["--model", str(tmp_path), "--prompt", "hi", "--backend", "eager", "--max-new-tokens", "20", "--batch-size", "1",
            "--max-context-length", "32", "--sequence-length", "64"]
    for flags, check in [(["--choice", "red", "green"], lambda t: t in ("red", "green")),
                         (["--regex", "[0-9]{4}"], lambda t: len(t) == 4 and t.isdigit()),
                         (["--json-schema", str(tmp_path / "schema.json")], lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
                         (["--grammar", str(tmp_path / "g.lark")], lambda t: t in ("a", "bb"))]:
        out = run_json(capsys, *base, *flags)
        assert check(out["text"]) and out["finish_reason"] == "stop", (flags, out["text"])
    with pytest.raises(SystemExit) as info:  # mutually exclusive: argparse refuses
        main(["generate", *base, "--choice", "a", "--regex", "b"])
    assert info.value.code == 2 and "not allowed with argument --choice" in capsys.readouterr().err


@pytest.mark.parametrize("draft", [["--draft-layers", "1"], ["--draft-model", "MODEL"]], ids=["self", "draft-model"])
def test_speculative_cli_accepts_every_option_and_equals_plain(tiny_model_dir, capsys, draft):
    prompts = ["--prompt", "w5 w9 w11 w3 w200", "--prompt", "w7 w7 w1"]
    draft = [str(tiny_model_dir) if a == "MODEL" else a for a in draft]
    plain = run_json(capsys, "--model", str(tiny_model_dir), *prompts, *OPTIONS)
    spec = run_json(capsys, "--model", str(tiny_model_dir), *prompts, *OPTIONS, "--speculation-length", "3", *draft)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    overlapped = run_json(capsys, "--model", str(tiny_model_dir), *prompts, *OPTIONS, "--speculation-length", "3", *draft,
                          "--async-decode")  # overlapped scheduling, speculating: the same tokens
    assert overlapped["token_ids"] == plain["token_ids"] and overlapped["text"] == plain["text"]
    fused = run_json(capsys, "--model", str(tiny_model_dir), *prompts, *OPTIONS, "--speculation-length", "3", *draft,
                     "--fused-speculation")  # draft passes, verify and acceptance in one call: the same tokens
    assert fused["token_ids"] == plain["token_ids"] and fused["speculation"] == spec["speculation"]
    assert [len(t) for t in spec["token_ids"]] == [12, 12]
    assert plain["speculation"] is None and all(s["emitted"] == 11 for s in spec["speculation"])
    for a, b in zip(spec["logprobs"], plain["logprobs"], strict=True):
        assert [x["top_ids"] for x in a] == [x["top_ids"] for x in b]
    # a stop string, streamed: the printed text is the JSON run's text, cut before the stop
    words = plain["text"][0].split()
    stop = f"{words[4]} {words[5]}"
    at = OPTIONS.index("--logprobs")
    streamed = OPTIONS[:at] + OPTIONS[at + 2:]  # --logprobs N prints with --json only
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "w5 w9 w11 w3 w200", *streamed, "--stop", stop,
                 "--speculation-length", "3", *draft, "--stream"]) == 0
    assert capsys.readouterr().out == plain["text"][0][: plain["text"][0].index(stop)] + "\n"


def test_logit_bias_forces_and_bans_tokens(tiny_model_dir, capsys):
    prompt = ["--model", str(tiny_model_dir), "--prompt", "w5 w9 w11", "--max-new-tokens", "4", "--backend", "eager",
              "--batch-size", "1", "--max-context-length", "32", "--sequence-length", "64", "--ignore-eos"]
    forced = run_json(capsys, *prompt, "--logit-bias", "200=100")
    assert forced["token_ids"] == [200] * 4 and forced["text"].split() == ["w200"] * 4
    plain = run_json(capsys, *prompt)["token_ids"]
    banned = run_json(capsys, *prompt, "--logit-bias", f"{plain[0]}=-100", "--logit-bias", f"{plain[1]}=-100")["token_ids"]
    assert not {plain[0], plain[1]} & set(banned)


def test_saved_runtime_options_and_no_speculation(tiny_model_dir, tmp_path, capsys):
    """A saved runtime fixes its plan: an option given with another value is an error, even
    when that value is the option's default; --no-speculation decodes plainly, same tokens."""
    out = tmp_path / "saved"
    plan = ["--backend", "eager", "--batch-size", "2", "--max-context-length", "32", "--sequence-length", "64",
            "--speculation-length", "3", "--draft-layers", "1"]
    assert main(["compile", str(tiny_model_dir), "--out", str(out), *plan, "--json"]) == 0
    capsys.readouterr()
    gen = ["--model", str(out), "--prompt", "w5 w9 w11", "--max-new-tokens", "8", "--ignore-eos"]
    spec = run_json(capsys, *gen)
    plain = run_json(capsys, *gen, "--no-speculation")
    assert spec["token_ids"] == plain["token_ids"] and spec["speculation"]["drafted"] > 0 and plain["speculation"] is None
    for option in (["--batch-size", "1"], ["--sequence-length", "512"], ["--backend", "inductor"], ["--speculation-length", "0"]):
        assert main(["generate", *gen, *option, "--json"]) == 2, option  # 1, 512, inductor, 0: the defaults
        assert "the saved runtime" in capsys.readouterr().err
    # a flag takes no value: the hint to compile again must be a command that parses
    assert main(["generate", *gen, "--fused-speculation", "--json"]) == 2
    assert "compile again: neuronfx compile MODEL --out DIR --fused-speculation." in capsys.readouterr().err
    # a runtime saved fused takes --fused-speculation alone (its plan has the draft), same tokens
    fused = tmp_path / "fused"
    assert main(["compile", str(tiny_model_dir), "--out", str(fused), *plan, "--fused-speculation", "--json"]) == 0
    capsys.readouterr()
    gen[1] = str(fused)
    assert run_json(capsys, *gen, "--fused-speculation")["token_ids"] == spec["token_ids"]


def test_compile_defaults_to_the_embedded_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """`neuronfx compile --out DIR` compiles the default model (SmolLM2's GGUF; here a tiny one
    in its place), as generate, serve and chat do."""
    monkeypatch.setattr("neuronfx.io.checkpoints.default_model_path", lambda: str(tiny_model_dir))
    out = tmp_path / "saved"
    assert main(["compile", "--out", str(out), "--backend", "eager", "--batch-size", "1", "--max-context-length", "32",
                 "--sequence-length", "64"]) == 0
    assert json.loads((out / "plan.json").read_text())["checkpoint"] == str(tiny_model_dir)
    assert f"saved 3 eager graphs to {out}" in capsys.readouterr().out


def test_plan_lists_the_graphs_compile_builds(tiny_model_dir, tmp_path, capsys):
    """`neuronfx plan`: one graph per (phase, batch bucket, length bucket) and the KV cache of 3
    slots (2 and the scratch slot) x 2 layers x K and V x 2 KV heads x 64 positions x 16 dims
    in fp32; a saved runtime of those options shows the same plan, and compile builds those graphs."""
    plan = ["--backend", "eager", "--batch-size", "2", "--max-context-length", "32", "--sequence-length", "64"]
    assert main(["plan", str(tiny_model_dir), *plan, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["graphs"] == [["prefill", 1, 32], ["prefill", 2, 32], ["decode", 1, 64], ["decode", 2, 64], ["greedy", 1, 64],
                              ["greedy", 2, 64]]
    assert data["kv_bytes"] == 3 * 2 * 2 * 2 * 64 * 16 * 4 and (data["batch_buckets"], data["layers"]) == ([1, 2], 2)
    assert main(["compile", str(tiny_model_dir), "--out", str(tmp_path / "saved"), *plan, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs"] == 6
    assert main(["plan", str(tmp_path / "saved"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == data
    assert main(["plan", str(tiny_model_dir), *plan]) == 0
    assert "KV cache 0.1 MiB; 6 graphs: 2 prefill, 2 decode, 2 greedy\n  prefill  batch 1   bucket 32\n" in capsys.readouterr().out


def test_compile_into_a_checkpoint_directory_is_refused_before_loading(tiny_model_dir, capsys):
    """`neuronfx compile MODEL --out MODEL` would overwrite the checkpoint's generation_config.json
    and add a runtime's files beside it: exit 2 with one line, before the load, nothing written."""
    before = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()}
    plan = ["--backend", "eager", "--batch-size", "1", "--max-context-length", "32", "--sequence-length", "64"]
    assert main(["compile", str(tiny_model_dir), "--out", str(tiny_model_dir), *plan]) == 2
    err = capsys.readouterr().err
    assert err == (f"neuronfx: error: ArtifactError: {str(tiny_model_dir)!r} holds files but no saved runtime (no manifest.json); "
                   "saving would overwrite them: use a new dir.\n")
    assert {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()} == before


def test_chat_without_a_template_and_missing_draft_model(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--backend", "eager", "--chat", "hi", "--max-new-tokens", "2"]) == 2
    assert "InputError: --chat needs a chat template" in capsys.readouterr().err
    t0 = time.perf_counter()
    assert main(["generate", "--speculation-length", "3", "--draft-model", "/nonexistent/draft"]) == 2
    assert time.perf_counter() - t0 < 5 and "CheckpointError: --draft-model '/nonexistent/draft' does not exist" in capsys.readouterr().err
