"""Stand-ins for what ``neuronfx.bench.openvino`` and ``openvino_export`` call of openvino,
openvino_genai and optimum-intel, over transformers and numpy: the ``--compare openvino`` code
paths run in the suite without the packages.

The "export" (``OVModelForCausalLM.from_pretrained(dir, export=True)``) records its call and
its "IR" is the HF directory it was given (config.json and safetensors, plus an empty
``openvino_model.xml``); the continuous-batching pipeline loads that with transformers and
picks each token as the argmax of a full forward pass over the row so far (no cache), so its
greedy tokens are transformers'. Its scheduler keeps the real one's budget: a step prefills
whole prompts while they fit in ``max_num_batched_tokens`` (the rest wait for the next step),
then every prefilled row decodes one token per step."""

from __future__ import annotations

import importlib.machinery
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import torch


def module(name: str, **attrs: object) -> types.ModuleType:
    """A module with a spec (``importlib.util.find_spec`` of a module without one raises)."""
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__dict__.update(attrs)
    return m


class Tensor:
    """``openvino.Tensor`` of a numpy array."""

    def __init__(self, array: np.ndarray) -> None:
        self.data = array


class Core:
    """``openvino.Core``: the CPU properties the engine's label reads."""

    def __init__(self) -> None:
        self.properties = {"KV_CACHE_PRECISION": SimpleNamespace(get_type_name=lambda: "u8"), "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32}

    def get_property(self, device: str, name: str) -> object:
        assert device == "CPU"
        return self.properties[name]


class SchedulerConfig:
    """Defaults of openvino_genai 2026.4's SchedulerConfig."""

    def __init__(self) -> None:
        self.max_num_batched_tokens, self.max_num_seqs, self.cache_size, self.enable_prefix_caching = 256, 256, 0, True


class GenerationConfig:
    def __init__(self) -> None:
        self.max_new_tokens, self.min_new_tokens, self.ignore_eos, self.do_sample = 2**64 - 1, 0, False, False


class Handle:
    """A request: its prompt, config and the tokens generated so far."""

    def __init__(self, request_id: int, ids: list[int], config: GenerationConfig) -> None:
        self.request_id, self.ids, self.config, self.generated = request_id, ids, config, []

    def finished(self) -> bool:
        return len(self.generated) >= self.config.max_new_tokens

    def read_all(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(generated_ids=list(self.generated))]


class ContinuousBatchingPipeline:
    """Records every pipeline in ``FakeGenai.pipelines`` and every request in ``requests``."""

    def __init__(self, models_path: str, scheduler_config: SchedulerConfig, device: str, properties: dict) -> None:
        from transformers import AutoModelForCausalLM

        self.path, self.scheduler_config, self.device, self.properties = models_path, scheduler_config, device, properties
        self.model = AutoModelForCausalLM.from_pretrained(models_path, dtype=torch.float32).eval()
        self.requests: list[Handle] = []
        self.steps = 0
        FakeGenai.pipelines.append(self)

    def add_request(self, request_id: int, input_ids: Tensor, config: GenerationConfig) -> Handle:
        assert input_ids.data.dtype == np.int64 and input_ids.data.shape[0] == 1
        assert config.min_new_tokens == config.max_new_tokens and config.ignore_eos and not config.do_sample
        handle = Handle(request_id, input_ids.data[0].tolist(), config)
        self.requests.append(handle)
        return handle

    def has_non_finished_requests(self) -> bool:
        return any(not h.finished() for h in self.requests)

    def step(self) -> None:
        budget = self.scheduler_config.max_num_batched_tokens
        for h in [h for h in self.requests if not h.finished()]:
            cost = 1 if h.generated else len(h.ids)
            if cost > budget:
                continue
            budget -= cost
            with torch.no_grad():
                logits = self.model(torch.tensor([h.ids + h.generated])).logits
            h.generated.append(int(logits[0, -1].argmax()))
        self.steps += 1


class FakeGenai:
    """Holds the pipelines made since ``install``."""

    pipelines: ClassVar[list[ContinuousBatchingPipeline]] = []  # reset by install


class OVWeightQuantizationConfig:
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


class OVModelForCausalLM:
    """``from_pretrained(dir, export=True, ...)`` records its keyword arguments in ``exports``."""

    exports: ClassVar[list[dict]] = []  # reset by install

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir

    @classmethod
    def from_pretrained(cls, hf_dir: str, **kwargs: object) -> OVModelForCausalLM:
        cls.exports.append(kwargs)
        return cls(hf_dir)

    def save_pretrained(self, out: Path) -> None:
        shutil.copytree(self.hf_dir, out)
        (Path(out) / "openvino_model.xml").write_text("<net/>")


def install(monkeypatch: object) -> SimpleNamespace:
    """Put the stand-ins of openvino, openvino_genai, optimum.intel and nncf in sys.modules
    (``monkeypatch``); returns where their records are."""
    FakeGenai.pipelines, OVModelForCausalLM.exports = [], []
    genai = module("openvino_genai", SchedulerConfig=SchedulerConfig, GenerationConfig=GenerationConfig,
                   ContinuousBatchingPipeline=ContinuousBatchingPipeline)
    optimum = module("optimum", __path__=[])
    intel = module("optimum.intel", OVModelForCausalLM=OVModelForCausalLM, OVWeightQuantizationConfig=OVWeightQuantizationConfig)
    for name, m in (("openvino", module("openvino", Tensor=Tensor, Core=Core)), ("openvino_genai", genai), ("optimum", optimum),
                    ("optimum.intel", intel), ("nncf", module("nncf"))):
        monkeypatch.setitem(sys.modules, name, m)
    return SimpleNamespace(pipelines=FakeGenai.pipelines, exports=OVModelForCausalLM.exports)
