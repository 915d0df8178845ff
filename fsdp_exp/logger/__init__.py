"""conf/logger: the trackers a run's figures go to beside metrics.jsonl and the console.

`logger=[wandb]` by default; any of wandb, tensorboard, mlflow and csv, together
(`logger=[wandb,tensorboard]`), or none (`logger=[]`). Each gets what wandb gets: on rank 0,
each logged step's figures as they are written to metrics.jsonl, and at the end the run's
summary (summary.json's figures) and its config. wandb's own settings stay in the wandb group
(conf/wandb); the others' are under `logger.<name>.*`. TensorBoard and MLflow are optional
extras (`pip install -e .[tensorboard]`, `.[mlflow]`): a run that names one that is not
installed is refused in one line before anything starts.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.logger.csv_sink import Csv
from fsdp_exp.logger.mlflow_sink import Mlflow
from fsdp_exp.logger.settings import SETTINGS, CsvSettings, MlflowSettings, TensorBoardSettings
from fsdp_exp.logger.tensorboard_sink import TensorBoard

NAMES = ("wandb", "tensorboard", "mlflow", "csv")
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow")}  # name: (module, extra)


@dataclass(frozen=True)
class Loggers:
    """The trackers a run logs to (`logger`), with their settings."""

    wandb: bool = True
    tensorboard: TensorBoardSettings | None = None
    mlflow: MlflowSettings | None = None
    csv: CsvSettings | None = None

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> Loggers:
        """`logger` as composed: a key a tracker, its value its settings. An unknown tracker or
        setting, or a tracker whose package is not installed, is one line."""
        chosen: dict[str, Any] = {"wandb": "wandb" in node}
        for name, given in node.items():
            if name not in NAMES:
                raise ConfigError(f"logger={name}: no such tracker; logger takes any of {', '.join(NAMES)} "
                                  f"(together: logger=[wandb,tensorboard]; none: logger=[])")
            settings = dict(given or {})
            if name == "wandb":
                if settings:
                    raise ConfigError(f"logger.wandb.{next(iter(settings))}: wandb's settings are the wandb "
                                      f"group's (wandb.mode, wandb.project, ...)")
                continue
            allowed = [f.name for f in fields(SETTINGS[name])]
            unknown = [k for k in settings if k not in allowed]
            if unknown:
                raise ConfigError(f"logger.{name}.{unknown[0]}: not a setting of logger={name}; it takes "
                                  f"{', '.join(allowed) or 'none'}")
            if name in PACKAGES and not installed(PACKAGES[name][0]):
                module, extra = PACKAGES[name]
                raise ConfigError(f"logger={name}: needs the {module} package, which is not installed; install "
                                  f"the extra: pip install -e .[{extra}] (or pip install 'fsdp_exp[{extra}]')")
            chosen[name] = SETTINGS[name](**settings)
        return cls(**chosen)

    @property
    def names(self) -> list[str]:
        return [name for name in NAMES if getattr(self, name)]

    def start(self, config: dict, run_dir: Path, project: str, job_type: str, tags: list[str]) -> list[Guarded]:
        """Rank 0's trackers other than wandb (fsdp_exp.metrics.wandb_sink starts wandb's), each
        with log(record), finish(summary) and where(); one that fails to start is one warning."""
        started = []
        for name in self.names:
            if name == "wandb":
                continue
            try:  # each imports its library (torch's SummaryWriter, mlflow) as it starts
                if name == "tensorboard":
                    tracker: Any = TensorBoard(self.tensorboard, config, run_dir)
                elif name == "mlflow":
                    tracker = Mlflow(self.mlflow, config, run_dir, project, job_type, tags)
                else:
                    tracker = Csv(run_dir)
            except Exception as err:  # noqa: BLE001 - a tracker's failure must not stop training
                warnings.warn(f"logger={name} failed to start, training goes on without it: "
                              f"{one_line(err, named=True)}")
                tracker = None
            started.append(Guarded(tracker, name))
        return started


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # None in sys.modules: its import fails
        return False


class Guarded:
    """A tracker whose failure is one warning, after which it logs nothing more: training
    goes on (as with wandb)."""

    def __init__(self, tracker: Any, name: str):
        self.tracker, self.name = tracker, name

    def where(self) -> str:
        return self.tracker.where() if self.tracker is not None else "not logging (the warning above says why)"

    def log(self, record: dict) -> None:
        self._call("log", record)

    def finish(self, summary: dict) -> None:
        self._call("finish", summary)

    def _call(self, method: str, figures: dict) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(figures)
        except Exception as err:  # noqa: BLE001 - a tracker's failure must not stop training
            warnings.warn(f"logger={self.name} failed, training goes on without it: {one_line(err, named=True)}")
            self.tracker = None
