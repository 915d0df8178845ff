"""Which modules become their own FSDP unit (`sharding.wrap`), and what each unit holds."""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

WRAP_POLICIES = ("blocks", "size", "blocks+size", "root")


def select_units(
    model: nn.Module, blocks: tuple[type[nn.Module], ...], wrap: str, min_params: int
) -> list[str]:
    """Names of the modules to `fully_shard` before the root, innermost first.

    blocks: every instance of the model's block classes.
    size: every module holding at least `min_params` parameters that are not already in
      a unit, found from the leaves up. A module sharing a parameter with a module
      outside it (tied embeddings) is never a unit of its own: FSDP would shard it twice.
    blocks+size: the blocks, then size over what is left. root: none (the root only).
    """
    assert wrap in WRAP_POLICIES, wrap  # checked with the config
    named = dict(model.named_modules())
    chosen: list[str] = []
    if wrap in ("blocks", "blocks+size"):
        chosen = [name for name, m in named.items() if name and isinstance(m, blocks)]
    if wrap in ("size", "blocks+size"):
        owners = _param_owners(model)
        for name in reversed(list(named)):  # pre-order reversed: children before parents
            if not name or _inside(name, chosen):
                continue
            free = _free_params(named[name], name, chosen, named)
            shared = any(not _inside(o, [name]) for p in named[name].parameters() for o in owners[p])
            if not shared and sum(p.numel() for p in free) >= min_params:
                chosen.append(name)
    return sorted(chosen, key=lambda n: -n.count("."))


def unit_sizes(model: nn.Module, units: list[str]) -> list[dict]:
    """Each unit (the root last) with the parameters it manages itself."""
    named = dict(model.named_modules())
    rows = [{"module": n, "params": sum(p.numel() for p in _free_params(named[n], n, units, named))} for n in units]
    root = sum(p.numel() for p in _free_params(model, "", units, named))
    return rows + [{"module": "(root)", "params": root}]


def _inside(name: str, parents: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in parents)


def _free_params(module: nn.Module, name: str, units: list[str], named: dict) -> set:
    """Parameters of `module` that no unit strictly inside it already holds."""
    nested = [u for u in units if u != name and (name == "" or u.startswith(name + "."))]
    taken = {id(p) for u in nested for p in named[u].parameters()}
    return {p for p in module.parameters() if id(p) not in taken}


def _param_owners(model: nn.Module) -> dict:
    owners: dict = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(p, []).append(name)
    return owners


LONG_LINE = 160  # a units line longer than this is summarised on the console


def units_line(units: list[dict], full_list_in: Path | None = None) -> str:
    """`FSDP units: ...` for the console. A long list (a GPT-2 has a unit per block) is
    summarised, runs of numbered units of one size as one range, with where the full list
    is: "FSDP units: 13 (blocks.0-11 of 7.1M params each, (root) 39.4M); full list in ..."."""
    full = "FSDP units: " + ", ".join(f"{u['module']} ({u['params']:,})" for u in units)
    if len(full) <= LONG_LINE:
        return full
    runs: list[list[tuple[str, int, dict]]] = []  # (prefix, index, unit) of consecutive numbered units
    for unit in units:
        numbered = re.fullmatch(r"(.*?)(\d+)", unit["module"])
        prefix, index = (numbered[1], int(numbered[2])) if numbered else (unit["module"], -1)
        last = runs[-1][-1] if runs else None
        if (numbered and last and last[0] == prefix and last[1] == index - 1
                and last[2]["params"] == unit["params"]):
            runs[-1].append((prefix, index, unit))
        else:
            runs.append([(prefix, index, unit)])
    parts = [f"{run[0][0]}{run[0][1]}-{run[-1][1]} of {_count(run[0][2]['params'])} params each" if len(run) > 1
             else f"{run[0][2]['module']} {_count(run[0][2]['params'])}" for run in runs]
    if len(parts) > 6:
        parts = [*parts[:5], f"{len(parts) - 6} more", parts[-1]]  # the root is last
    where = f"; full list in {full_list_in}" if full_list_in is not None else ""
    return f"FSDP units: {len(units)} ({', '.join(parts)}){where}"


def _count(params: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if params >= size:
            return f"{params / size:.1f}{unit}"
    return str(params)
