"""The setups task=tune compares: every combination of task.space's options, each a list of
command-line overrides, so that a setup is composed, checked and run as that command line
would be, and the winner is printed as a command line that runs it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_exp.errors import ConfigError
from fsdp_exp.keys import MISSING, lookup

log = logging.getLogger("fsdp_exp")


@dataclass(frozen=True)
class Setup:
    """One combination: the overrides of the keys with more than one option (what sets it
    apart), and those of the keys with one."""

    varied: tuple[str, ...]
    fixed: tuple[str, ...] = ()

    @property
    def overrides(self) -> tuple[str, ...]:
        return (*self.varied, *self.fixed)

    @property
    def name(self) -> str:
        return " ".join(self.varied or self.fixed) or "defaults"

    @property
    def dir_name(self) -> str:
        """A folder name that says the setup: `sharding=grad_op,offload=true`."""
        return ",".join(o.replace("/", "_") for o in self.varied or self.fixed) or "defaults"


def flatten(space: Mapping[str, Any], prefix: str = "") -> dict[str, list]:
    """{"train": {"activation_checkpointing": [...]}} -> {"train.activation_checkpointing": [...]}."""
    flat: dict[str, list] = {}
    for key, value in space.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{dotted}."))
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ConfigError(f"task.space.{dotted}=[]: give at least one option (or leave the key out)")
            flat[dotted] = list(value)
        else:
            flat[dotted] = [value]
    return flat


def override_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def setups(space: Mapping[str, Any], command_line: list[str], world_size: int, nodes: int,
           config: Mapping[str, Any] | None = None) -> list[Setup]:
    """Every combination of the space's options, less the keys the command line already sets
    (those stay as typed, with a note). `sharding=hybrid` becomes one setup per shape
    (`sharding.replicate`) that divides the world across more than one node; on one node it
    is left out, as full sharding there is the same. A key that `config` (the run's settings,
    as plain values) does not have is added, as the command line adds one: `+model.width=512`."""
    flat = flatten(space)
    typed = {o.split("=", 1)[0].lstrip("+~") for o in command_line if "=" in o}
    fixed = [key for key in flat if key in typed]
    if fixed:
        log.info("task=tune: %s set on the command line, so not tuned (task.space.%s to tune it)",
                 ", ".join(fixed), fixed[0])
    options = {key: values for key, values in flat.items() if key not in typed}
    if "sharding" in options:
        options["sharding"] = hybrid_shapes(options["sharding"], world_size, nodes)
        if not options["sharding"]:
            raise ConfigError(f"task.space.sharding: no option left to try on {world_size} rank(s) on {nodes} node(s) "
                              "(hybrid needs more than one node)")
    combos = itertools.product(*[[(key, v) for v in values] for key, values in options.items()])
    made = []
    for combo in combos:
        varied: list[str] = []
        fixed: list[str] = []
        for key, value in combo:
            new = config is not None and lookup(config, key) is MISSING
            given = list(value) if isinstance(value, tuple) else [f"{'+' if new else ''}{key}={override_value(value)}"]
            (varied if len(options[key]) > 1 else fixed).extend(given)
        made.append(Setup(tuple(varied), tuple(fixed)))
    return made


def hybrid_shapes(options: list, world_size: int, nodes: int) -> list:
    """The sharding options with `hybrid` replaced by each (sharding=hybrid,
    sharding.replicate=k) for k dividing the world with 1 < k < world: shard groups of
    world / k ranks, replicated k times. Without more than one node: no hybrid."""
    out = []
    for option in options:
        if str(option) != "hybrid":
            out.append(option)
        elif nodes > 1:
            out += [("sharding=hybrid", f"sharding.replicate={k}") for k in range(2, world_size)
                    if world_size % k == 0]
    return out


# Options that change nothing on a CPU but the memory: the key, the option kept, and why
SAME_ON_CPU = {"offload": (False, "on a CPU offload moves nothing (the shards are in host memory already) and "
                                  "holds a second copy of them, so offload=false is as fast with less memory")}


def fold_on_cpu(space: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The space with each setting that cannot change a CPU's speed (SAME_ON_CPU) folded into
    its one option worth running, and a line for each fold (task=tune's `folded`)."""
    folded, notes = dict(space), []
    for key, (kept, why) in SAME_ON_CPU.items():
        options = folded.get(key)
        if isinstance(options, (list, tuple)) and len(options) > 1 and kept in options:
            folded[key] = [kept]
            others = ", ".join(f"{key}={override_value(v)}" for v in options if v != kept)
            notes.append(f"{others} folded into {key}={override_value(kept)}: {why}")
    return folded, notes
