"""Which modules become their own FSDP unit (`sharding.wrap`), and what each unit holds."""

from __future__ import annotations

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
