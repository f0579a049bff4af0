"""CLI checks that must fail at once, before the model is loaded (no model load here)."""

from __future__ import annotations

import time

import pytest

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
        (["--logprobs", "21"], "SamplingParamsError"),
        (["--presence-penalty", "3"], "SamplingParamsError"),
        (["--repetition-penalty", "0"], "SamplingParamsError"),
        (["--min-tokens", "-1"], "SamplingParamsError"),
        (["--backend", "neuron"], "BackendUnavailableError"),
        (["--max-context-length", "1024"], "ConfigError"),
        (["--batch-size", "0"], "ConfigError"),
        (["--top-p", "0"], "SamplingParamsError"),
        (["--top-k", "100000"], "SamplingParamsError"),
        (["--model", "/nonexistent/model.gguf"], "CheckpointError"),
    ],
)
def test_generate_rejects_bad_options_before_loading(args, error, capsys):
    t0 = time.perf_counter()
    assert main(["generate", *args]) == 2
    assert time.perf_counter() - t0 < 5  # the model load takes ~25 s: it did not happen
    err = capsys.readouterr().err
    assert f"error: {error}:" in err


def test_bench_rejects_bad_sizes(capsys):
    assert main(["bench", "--gen-lens", "1", "--model", "/nonexistent"]) == 2
    assert "gen-lens" in capsys.readouterr().err
