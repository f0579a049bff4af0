"""JSON (de)serialization of configs and plans through a private cattrs converter.

Unknown keys are errors (``forbid_extra_keys=True``); every failure becomes a ConfigError that
names the class, the key path and the offending value. A ModelConfig's ``extras`` is
structured as its family's record (``config.families.Family.extras``), chosen by its
``model_type``.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import BaseValidationError, ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn, override

from neuronfx.config.families import FAMILIES
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.model import ModelConfig
from neuronfx.config.plan import Plan, make_plan
from neuronfx.errors import ConfigError, NeuronfxError

T = TypeVar("T")

_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict(kind: type) -> Any:
    # cattrs' default hooks call bool()/int()/float()/str() on anything: "false" -> True, 2.7 -> 2,
    # null -> "None". JSON already gives the right Python types, so accept only those (ints for
    # float fields).
    accepted = (int, float) if kind is float else (kind,)

    def hook(value: Any, _cls: Any) -> Any:
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, accepted):
            raise TypeError(f"expected {kind.__name__}, got {value!r}")
        return kind(value)

    return hook


for _kind in (bool, int, float, str):
    _converter.register_structure_hook(_kind, _strict(_kind))

_model_fields = make_dict_structure_fn(ModelConfig, _converter, _cattrs_forbid_extra_keys=True, extras=override(omit=True))


def _structure_model(data: Any, cls: type) -> ModelConfig:
    """ModelConfig from plain data: every field but ``extras``, then ``extras`` (when given) as
    the record of the family its ``model_type`` names (None for a family without one)."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    model = _model_fields({k: v for k, v in data.items() if k != "extras"}, cls)
    if "extras" not in data:
        return model
    kind = FAMILIES[model.model_type].extras
    if kind is None and data["extras"] is not None:
        raise TypeError(f"extras={data['extras']!r}: model_type={model.model_type!r} has no extras (pass null)")
    return attrs.evolve(model, extras=None if kind is None else _converter.structure(data["extras"], kind))


_converter.register_structure_hook(ModelConfig, _structure_model)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown key(s) {sorted(exc.extra_fields)} (remove them; check spelling)"
    if isinstance(exc, BaseValidationError):  # ClassValidationError, or IterableValidationError (tuple items)
        inner = "; ".join(_describe(e) for e in exc.exceptions)
        where = [n for n in getattr(exc, "__notes__", []) if n]
        return inner + (f" ({'; '.join(where)})" if where else "")
    notes = getattr(exc, "__notes__", [])
    return f"{exc}" + (f" ({'; '.join(notes)})" if notes else "")


def structure(data: dict[str, Any], cls: type[T]) -> T:
    """Build ``cls`` from plain data; raises ConfigError on unknown keys or bad values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}.")
    try:
        return _converter.structure(data, cls)
    except NeuronfxError:
        raise
    except (ClassValidationError, ForbiddenExtraKeysError, TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"invalid {cls.__name__}: {_describe(exc)}") from exc


def unstructure(value: Any) -> dict[str, Any]:
    """Plain-data form of an attrs config (tuples become lists)."""
    return _converter.unstructure(value)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan's sources (model, inference, checkpoint, tensor-parallel rank); everything else
    is re-derived on load."""
    return {
        "model": unstructure(plan.model),
        "inference": unstructure(plan.inference),
        "checkpoint": plan.checkpoint,
        "rank": plan.rank,
    }


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """Inverse of :func:`plan_to_dict`; raises ConfigError on unknown or missing keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"plan must be a JSON object, got {type(data).__name__}.")
    extra = set(data) - {"model", "inference", "checkpoint", "rank"}
    if extra:
        raise ConfigError(f"invalid Plan: unknown key(s) {sorted(extra)} (allowed: model, inference, checkpoint, rank).")
    for key in ("model", "inference"):
        if key not in data:
            raise ConfigError(f"invalid Plan: missing key {key!r}.")
    model = structure(data["model"], ModelConfig)
    inference = structure(data["inference"], InferenceConfig)
    rank = data.get("rank", 0)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ConfigError(f"invalid Plan: rank={rank!r} must be an int.")
    return make_plan(model, inference, checkpoint=data.get("checkpoint"), rank=rank)


def plan_to_json(plan: Plan) -> str:
    """The plan's sources (:func:`plan_to_dict`) as stable JSON text (sorted keys, indented)."""
    return json.dumps(plan_to_dict(plan), indent=2, sort_keys=True)


def plan_from_json(text: str) -> Plan:
    """Inverse of :func:`plan_to_json`; raises ConfigError for text that is not JSON or does not
    structure (unknown or missing keys, wrong types)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"plan JSON does not parse: {exc}; pass the text plan_to_json (or neuronfx.save) wrote.") from exc
    return plan_from_dict(data)
