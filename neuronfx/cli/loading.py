"""Getting a runtime for a command: a saved runtime (its plan fixed, explicit options must
agree) or a checkpoint compiled for the plan options (through the compile cache), with a
``--draft-model`` attached; timed, so each command can say where its graphs came from."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import attrs
from tqdm.auto import tqdm

import neuronfx
from neuronfx.api import check_weight_source
from neuronfx.cli.options import check_fused_flag, given_plan_options, inference_from_args
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.plan import make_plan
from neuronfx.config.serialization import plan_from_json
from neuronfx.errors import ArtifactError, InputError
from neuronfx.graphs.backends import check_backend, prepare_backend
from neuronfx.graphs.phases.device import check_device
from neuronfx.io import checkpoints
from neuronfx.io.artifacts import MANIFEST, PLAN, first_dir, looks_like_repo_id, resolve
from neuronfx.io.artifacts import load_tokenizer as load_saved_tokenizer
from neuronfx.io.sentence_transformers import pooling_config


def saved_runtime(model: str | None) -> Path | None:
    """The directory of a saved runtime when ``--model`` names one (a directory with a
    manifest, or a hub repo id that is no local path), else None (a checkpoint)."""
    if model is None:
        return None
    path = Path(model)
    if path.is_dir() and (first_dir(path) / MANIFEST).is_file():
        return path
    if not path.exists() and looks_like_repo_id(model):
        return resolve(model)
    return None


def saved_inference(args: argparse.Namespace, saved: Path) -> InferenceConfig:
    """The saved plan's inference config. Raises ArtifactError when the plan cannot be read,
    InputError when an explicit plan option differs (the graphs are compiled for the saved plan)."""
    try:
        inference = plan_from_json((first_dir(saved) / PLAN).read_text()).inference
    except OSError as exc:
        raise ArtifactError(f"cannot read {saved / PLAN}: {exc}; re-save the runtime.") from exc
    for name, given in given_plan_options(args).items():
        saved_value = getattr(inference, name)
        if given != saved_value:
            raise InputError(
                f"--{name.replace('_', '-')}={given} but the saved runtime {saved} was compiled with {saved_value}; drop the "
                f"option, or compile again: neuronfx compile MODEL --out DIR {option_text(name, given)}."
            )
    return inference


def option_text(name: str, value: object) -> str:
    """Plan option ``name`` = ``value`` as typed on the command line: a bool is a bare flag
    (``--fused-speculation``; False: ``--no-normalize``), which takes no value."""
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}"


def plan_inference(args: argparse.Namespace, defaults: dict | None = None) -> tuple[Path | None, InferenceConfig]:
    """(saved runtime directory or None, inference config) of a command with the plan options:
    a saved runtime's own plan (explicit options must agree), else the options over
    ``defaults`` over InferenceConfig's. Also checks the device, the backend and the weight
    source, so a bad option fails before anything loads (ConfigError, BackendUnavailableError)."""
    saved = saved_runtime(args.model)
    if saved is None and getattr(args, "task", None) == "embed":  # pooling the model's sentence-transformers config names, unless given
        defaults = (defaults or {}) | (pooling_config(args.model or checkpoints.default_model_path()) or {})
    if saved is None:
        check_fused_flag(args)
    inference = saved_inference(args, saved) if saved is not None else inference_from_args(args, defaults)
    check_device(inference)
    check_backend(inference.backend)
    if saved is None:
        check_weight_source(inference, args.model or checkpoints.default_model_path())
    return saved, inference


@attrs.frozen(kw_only=True, eq=False)
class LoadedRuntime:
    """What :func:`load_runtime` built: the runtime, its tokenizer, the model it came from and
    how long loading and compiling took (seconds; ``compile_s`` is the time to get the graphs:
    compiled, or loaded from the compile cache when ``runtime.from_cache``; 0 for a saved runtime)."""

    runtime: neuronfx.Runtime
    tokenizer: object  # transformers tokenizer
    model: str  # the checkpoint path or saved runtime given (the default model's path when none)
    load_s: float
    compile_s: float
    saved: bool = False  # loaded from a saved runtime (graphs and weights together)

    @property
    def graphs_from(self) -> str:
        """Where the graphs came from: "saved runtime", "compile cache" or "compiled"."""
        return "saved runtime" if self.saved else "compile cache" if self.runtime.from_cache else "compiled"

    def summary(self) -> str:
        """How the runtime was made, timed, e.g. "checkpoint loaded in 2.1 s; 10 graphs loaded from
        the compile cache (entry 3f2a...) in 1.4 s" or "...; 10 graphs compiled in 180.2 s"."""
        n = len(self.runtime.graphs)
        if self.saved:
            return f"loaded the saved runtime {self.model} ({n} graphs) in {self.load_s:.1f} s"
        if self.runtime.from_cache:
            graphs = f"{n} graphs loaded from the compile cache (entry {self.runtime.cache_key[:16]}) in {self.compile_s:.1f} s"
        else:
            graphs = f"{n} graphs compiled in {self.compile_s:.1f} s"
        return f"checkpoint loaded in {self.load_s:.1f} s; {graphs}"


def load_runtime(args: argparse.Namespace, saved: Path | None, inference: InferenceConfig, progress: bool) -> LoadedRuntime:
    """Load a saved runtime, or load ``args.model`` (default: the embedded SmolLM2) and compile
    it (through the compile cache) for ``inference``; ``progress`` shows tqdm bars. Raises what
    ``neuronfx.load``, ``load_checkpoint`` and ``neuronfx.compile`` raise."""
    model_path = args.model or checkpoints.default_model_path()
    t0 = time.perf_counter()
    if saved is not None:
        runtime, tokenizer = neuronfx.load(saved), load_saved_tokenizer(saved)
        return LoadedRuntime(runtime=runtime, tokenizer=tokenizer, model=str(model_path), load_s=time.perf_counter() - t0,
                             compile_s=0.0, saved=True)
    prepare_backend(inference.backend)  # the compile (or compile-cache load) follows the load this overlaps
    with tqdm(total=2, desc="load", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("weights")
        ckpt = checkpoints.load_checkpoint(model_path, dtype=torch_dtype(inference.dtype), lazy=inference.tp_degree > 1,
                               gguf_blocks=inference.weight_format == "gguf")
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = checkpoints.load_tokenizer(model_path)
        bar.update()
    load_s = time.perf_counter() - t0
    plan = make_plan(ckpt.config, inference, checkpoint=str(model_path))
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, ckpt.state_dict, progress=progress)
    # ckpt goes out of scope here: under tensor parallelism only this rank's shard stays resident
    return LoadedRuntime(runtime=runtime, tokenizer=tokenizer, model=str(model_path), load_s=load_s,
                         compile_s=time.perf_counter() - t0)


def with_draft_model(args: argparse.Namespace, runtime: neuronfx.Runtime, inference: InferenceConfig,
                     progress: bool) -> neuronfx.Runtime:
    """``runtime`` with the ``--draft-model`` compiled and attached, or as it is without one.
    The draft gets the target's capacities, no speculation of its own and logits on
    (``with_draft`` needs them for sampled rows)."""
    if not args.draft_model:
        return runtime
    ckpt = checkpoints.load_checkpoint(args.draft_model, dtype=torch_dtype(inference.dtype))
    draft_inf = attrs.evolve(inference, speculation_length=0, draft_layers=0, fused_speculation=False, output_logits=True)
    draft = neuronfx.compile(make_plan(ckpt.config, draft_inf), ckpt.state_dict, progress=progress)
    return neuronfx.with_draft(runtime, draft)


def graphs_time(out: dict) -> str:
    """The graphs' part of a command's timing line: "compile 180.2 s", "graphs from the compile
    cache 1.4 s" or "graphs from the saved runtime"."""
    if out["graphs_from"] == "compiled":
        return f"compile {out['compile_s']:.1f} s"
    if out["graphs_from"] == "compile cache":
        return f"graphs from the compile cache {out['compile_s']:.1f} s"
    return "graphs from the saved runtime"
