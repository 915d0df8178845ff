"""The one error type a user's input can cause, and the helpers every component's checks use."""

from enum import Enum


class ConfigError(Exception):
    """A bad value a user can set: one line naming the key and what is allowed."""


def at_least(key: str, value: int | float, low: int) -> None:
    """Refuse `key=value` below `low`."""
    if value < low:
        raise ConfigError(f"{key}={value}: must be at least {low}")


class Choice(str, Enum):
    """A setting with a fixed set of values: OmegaConf refuses any other, and the value
    compares and prints as its plain string."""

    def __str__(self) -> str:
        return self.value
