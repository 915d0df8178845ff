"""A task's record in a wandb run of its own: its rows as a table, its plot as an image, its
answer in the run's summary (task=max_batch's probes, task=tune's setups)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.config import as_dict

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.run_context import RunContext


def log_record(exp: Experiment, context: RunContext, run_dir: Path, table: str, columns: Sequence[str],
               rows: Sequence[dict], images: dict[str, Path | None], summary: dict) -> None:
    """Log `rows` (their `columns`) as the table `table`, each image drawn, and `summary`,
    in the run's wandb mode; nothing where wandb is disabled."""
    sink = exp.wandb.sink({**as_dict(exp), "environment": context.environment}, run_dir)
    if sink.run is None:
        return
    import wandb

    logged: dict = {table: wandb.Table(columns=list(columns), data=[[row[c] for c in columns] for row in rows])}
    logged |= {name: wandb.Image(str(png)) for name, png in images.items() if png is not None}
    sink.run.log(logged)
    sink.finish(summary)
