"""attrs validators that raise ConfigError naming the class, field, value and the rule broken."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from neuronfx.errors import ConfigError

Validator = Callable[[Any, attrs.Attribute, Any], None]


def positive_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A count or capacity: an int (not bool) > 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{type(inst).__name__}.{attribute.name}={value!r} must be a positive int (>= 1); pass an int such as 1.")


def non_negative_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A count that may be zero: an int (not bool) >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{type(inst).__name__}.{attribute.name}={value!r} must be an int >= 0; pass 0 to disable it.")


def positive_number(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{type(inst).__name__}.{attribute.name}={value!r} must be a finite number > 0; pass e.g. 1.0.")


def boolean(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{type(inst).__name__}.{attribute.name}={value!r} must be True or False (a bool, not {type(value).__name__}).")


def one_of(options: Sequence[str]) -> Validator:
    """A string from ``options``."""

    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in options:
            raise ConfigError(
                f"{type(inst).__name__}.{attribute.name}={value!r} is not one of {', '.join(map(repr, options))}; pick one of them."
            )

    return check
