"""The one error type a user's input can cause, and the helpers every component's checks use."""

from collections.abc import Iterable
from enum import Enum


class ConfigError(Exception):
    """A bad value a user can set: one line naming the key and what is allowed.

    Where the command line adds a hint of its own, the error says what it refuses as fields,
    not only in its words: `key` (`model.n_head`; for an option, the group: `model`), `value`
    (the option's name), and `refusal`, one of the names below."""

    UNKNOWN_KEY = "unknown key"  # the settings' schema has no such key
    NEW_KEY = "new key"  # a free-form node (a model's builder arguments) lacks it: `+key=` adds it
    NO_SUCH_OPTION = "no such option"  # a group has no option of that name

    def __init__(self, message: str, *, key: str | None = None, value: str | None = None,
                 refusal: str | None = None):
        super().__init__(message)
        self.key, self.value, self.refusal = key, value, refusal


def at_least(key: str, value: int | float, low: int) -> None:
    """Refuse `key=value` below `low`."""
    if value < low:
        raise ConfigError(f"{key}={value}: must be at least {low}")


class Choice(str, Enum):
    """A setting with a fixed set of values: OmegaConf refuses any other, and the value
    compares and prints as its plain string."""

    def __str__(self) -> str:
        return self.value


def choice(name: str, values: Iterable[str], module: str) -> type[Choice]:
    """A Choice whose values need not be Python names ("async", "blocks+size"); `module`
    is the defining module's `__name__`, so that a run's settings still pickle."""
    return Choice(name, [(value, value) for value in values], module=module, qualname=name)  # type: ignore[return-value]


def one_line(err: BaseException, *, named: bool = False, whole: bool = False, last: bool = False,
             limit: int | None = None) -> str:
    """An exception as one line: the first line of its text (`last`: the last, where a
    library puts the reason after a header; `whole`: every line, joined), at most `limit`
    characters, after its type's name when `named`. Its type's name alone when it has no text."""
    lines = [" ".join(line.split()) for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = " ".join(lines) if whole else lines[-1] if last else lines[0]
    text = text[:limit] if limit else text
    return f"{type(err).__name__}: {text}" if named else text
