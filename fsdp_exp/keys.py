"""A dotted key (`train.batch_size`), as the command line writes it, in a config held as plain
values (a run's saved config, `fsdp_exp.config.as_dict`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MISSING = object()


def lookup(config: Mapping[str, Any], dotted_key: str) -> Any:
    """The value at `dotted_key`, or MISSING."""
    value: Any = config
    for part in dotted_key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value
