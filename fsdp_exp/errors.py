"""The one error type a user's input can cause."""


class ConfigError(Exception):
    """A bad value a user can set: one line naming the key and what is allowed."""


def at_least(key: str, value: int | float, low: int) -> None:
    """Refuse `key=value` below `low`."""
    if value < low:
        raise ConfigError(f"{key}={value}: must be at least {low}")
