"""task.* of task=tune: the space of setups, the budget, and how each setup's batch is
searched (task=max_batch's own settings, which every setup's search uses)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fsdp_exp.errors import ConfigError, at_least
from fsdp_exp.tasks.max_batch.settings import SearchSettings


def default_space() -> dict[str, Any]:
    """The options that keep the numerics: how the model is sharded, whether blocks recompute
    their activations, whether sharded state lives on the host. `hybrid` becomes each shape
    that divides the world when the ranks span more than one node."""
    return {"sharding": ["full", "grad_op", "ddp", "hybrid"], "train": {"activation_checkpointing": [False, True]},
            "offload": [False, True]}


@dataclass(frozen=True)
class Budget:
    """When the tune stops with the best so far: after this many probes, or minutes."""

    probes: int | None = None
    minutes: float | None = None

    def spent(self, probes: int, seconds: float) -> bool:
        return (self.probes is not None and probes >= self.probes) or \
            (self.minutes is not None and seconds >= 60 * self.minutes)

    def __str__(self) -> str:
        return f"{self.probes} probes" if self.probes is not None else f"{self.minutes:g} minutes" \
            if self.minutes is not None else "none"


def parse_budget(text: Any) -> Budget:
    """task.budget: null, a number of probes (40, "40 probes"), or minutes ("30m", "30 min")."""
    if text is None:
        return Budget()
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(probes?|m|min|mins|minutes?)?\s*", str(text))
    if match is None or (match.group(2) in (None, "probe", "probes") and "." in match.group(1)) \
            or float(match.group(1)) <= 0:
        raise ConfigError(f"task.budget={text}: a number of probes (40) or minutes (30m); null: no budget")
    number, unit = match.groups()
    if unit in (None, "probe", "probes") and int(number) < 2:
        raise ConfigError(f"task.budget={text}: at least 2 probes: the last is kept for running the winner's "
                          "command line")
    return Budget(probes=int(number)) if unit in (None, "probe", "probes") else Budget(minutes=float(number))


@dataclass(kw_only=True)
class TuneSettings(SearchSettings):
    """task.* of task=tune."""

    # Each key a setting (a config group such as sharding or precision, or a key such as offload), each
    # value the options to try; nested keys as in the config (train: {activation_checkpointing: [...]}).
    space: dict[str, Any] = field(default_factory=default_space)
    budget: Any = None  # null | probes (40) | minutes (30m): stop with the best so far
    global_batch: int | None = None  # keep this global batch: each setup's micro-batch and train.grad_accum that reach it
    # Each setup's speed near the largest batch its estimate puts under the limit (one probe, most
    # often); true: each searched to its boundary and its fastest batch, as task=max_batch searches
    search_boundary: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_budget(self.budget)
        if self.global_batch is not None:
            at_least("task.global_batch", self.global_batch, 1)
        if not self.space:
            raise ConfigError("task.space: empty; name at least one setting and its options, "
                              "e.g. task.space.sharding=[full,grad_op,ddp]")

    def stop_after(self) -> Budget:
        return parse_budget(self.budget)
