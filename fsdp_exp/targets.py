"""A `_target_` of the user's (a model's or a data set's builder): imported, or refused in
one line that names the key."""

from __future__ import annotations

from typing import Any

from hydra.utils import get_method

from fsdp_exp.errors import ConfigError, one_line


def imported(key: str, target: str) -> Any:
    """The function or class at import path `target`, which `key` sets."""
    try:
        return get_method(target)
    except Exception as err:  # Hydra: ImportError or ValueError, with a long text
        raise ConfigError(f"{key}={target}: cannot import it ({one_line(err)})") from None
