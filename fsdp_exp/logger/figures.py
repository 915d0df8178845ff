"""What the trackers take of a record: its numbers, and a nested config flattened."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's numeric figures (bools and None left out), its step too."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and text values (MLflow's params, TensorBoard's text)."""
    found: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            found |= flat(value, f"{name}.")
        else:
            found[name] = str(value)
    return found
