"""The command lines of a tune: each setup's search as task=max_batch, and the words the
printed winner's line starts with."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from fsdp_exp.tasks.max_batch.settings import SearchSettings


def search_command(command: list[str], setup: list[str], settings: SearchSettings) -> list[str]:
    """The command line of one setup's search: the tune's, the setup's own options, and the
    tune's search settings as task=max_batch's. wandb as the tune's: its probes log as the run
    would (fsdp_exp.tasks.max_batch.probe), its search to no run of its own. The tune confirms
    its winner itself (fsdp_exp.tasks.tune.confirm), at the batch it hands over."""
    search = [f"task.{f.name}={value_text(getattr(settings, f.name))}" for f in fields(SearchSettings)
              if f.name != "verify_steps"]
    return [*command, *setup, "task=max_batch", *search, "task.verify_steps=0", *search_path_overrides()]


def base_overrides(command_line: list[str]) -> list[str]:
    """The command line without the tune's own keys (task=tune, task.*)."""
    return [o for o in command_line if o.split("=", 1)[0].lstrip("+~") != "task"
            and not o.lstrip("+~").startswith("task.")]


def value_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def search_path_overrides() -> list[str]:
    """The command's hydra.searchpath, so that a setup finds the user's config folder too."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.hydra if o.split("=", 1)[0].lstrip("+") == "hydra.searchpath"]
