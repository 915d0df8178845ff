"""conf/task/*: what a run does (train, max_batch, estimate, eval, export)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment


def setup_line(cfg: Experiment) -> str:
    """What a task's record calls the setup it ran: the command line's overrides, but the
    task's own and Hydra's."""
    overrides = [o for o in cfg.environment.get("overrides", []) if not o.startswith(("task=", "hydra."))]
    return " ".join(overrides) or "defaults"
