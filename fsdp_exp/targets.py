"""A `_target_` of the user's (a model's or a data set's builder): imported, or refused in
one line that names the key, the whole cause and, for a package Python cannot find, where
it looked."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
from typing import Any

from fsdp_exp.errors import ConfigError, one_line


def imported(key: str, target: str) -> Any:
    """The function or class at import path `target` (`package.module.Name`, or a name inside
    a class), which `key` sets."""
    parts = target.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"{key}={target}: an import path with its module, such as mypkg.model.Net")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and (module_name + ".").startswith(err.name + "."):
                continue  # this module, or a package above it, is not there: a shorter path may be
            raise ConfigError(f"{key}={target}: importing {module_name} failed: No module named {err.name!r} "
                              "(a package it imports is not installed)") from None
        except Exception as err:  # noqa: BLE001 - the user's module raised as it was imported: one line of it
            raise ConfigError(f"{key}={target}: importing {module_name} failed: "
                              f"{one_line(err, named=True)}") from None
        return attribute(key, target, found, module_name, parts[cut:])
    raise ConfigError(f"{key}={target}: no module named {parts[0]!r} where Python looks from here ({where_python_looks()}); "
                      f"run from the folder that holds {parts[0]}, add that folder to PYTHONPATH, or pip install it")


def attribute(key: str, target: str, found: Any, module_name: str, names: list[str]) -> Any:
    """`names` looked up in turn from the imported module, the first missing one named with
    the module's names closest to it."""
    where = module_name
    for name in names:
        if not hasattr(found, name):
            close = difflib.get_close_matches(name, [n for n in dir(found) if not n.startswith("_")], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{key}={target}: {where} has no {name!r}{hint}")
        found, where = getattr(found, name), f"{where}.{name}"
    return found


def check_keywords(group: str, target: str, builder: Any, given: Any, own: tuple[str, ...],
                   also: str = "", passed: tuple[str, ...] = ()) -> None:
    """Every key the option (`group`: model, data) passes its builder is one the builder
    takes; else one line naming the key and the keys it could be (the option's own, `own`,
    and the builder's, but those fsdp_exp passes itself, `passed`). `also`: what the line adds."""
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):  # a builder without a signature to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in passed]
    for key in given:
        if key not in takes:
            allowed = ", ".join(sorted({*takes, *own}))
            raise ConfigError(f"{group}.{key}: unknown key; {group} has: {allowed} "
                              f"({target} takes {', '.join(takes) or 'no arguments'}{also})",
                              key=f"{group}.{key}", refusal=ConfigError.UNKNOWN_KEY)


def where_python_looks() -> str:
    path = os.environ.get("PYTHONPATH")
    return (f"the working directory {os.getcwd()}, " + (f"PYTHONPATH={path}" if path else "no PYTHONPATH")
            + " and the installed packages")
