"""logger.<tracker>.*: each tracker's settings (wandb's are the wandb group's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorBoardSettings:
    dir: str | None = None  # None: <run dir>/tensorboard


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str | None = None  # None: a local file store, ./mlruns where the command runs
    experiment: str | None = None  # None: the wandb project's name (fsdp_exp)


@dataclass(frozen=True)
class CsvSettings:
    pass


SETTINGS: dict[str, type] = {"tensorboard": TensorBoardSettings, "mlflow": MlflowSettings, "csv": CsvSettings}
