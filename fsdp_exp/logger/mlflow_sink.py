"""logger=mlflow: one MLflow run, through the mlflow client (mlflow-skinny is enough).

Without `logger.mlflow.tracking_uri` the run goes to a local file store, ./mlruns where the
command runs (`mlflow ui --backend-store-uri ./mlruns` shows it; MLflow 3 keeps that store
behind MLFLOW_ALLOW_FILE_STORE, which fsdp_exp sets on rank 0 for a file store). With one (http://..., or
sqlite:///mlflow.db with the full mlflow package), there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.logger.figures import flat, numbers

if TYPE_CHECKING:
    from fsdp_exp.logger.settings import MlflowSettings

PARAMS_A_CALL = 100  # MLflow's log_batch takes at most this many params
PARAM_CHARS = 6000  # and values this long
END_STATUS = {"ok": "FINISHED", "none_fits": "FINISHED", "interrupted": "KILLED"}


def tracking_uri(settings: MlflowSettings) -> str:
    """logger.mlflow.tracking_uri, or ./mlruns; a file store allowed (MLFLOW_ALLOW_FILE_STORE),
    a server given fewer retries and a shorter timeout than MLflow's (unless set)."""
    uri = settings.tracking_uri or (Path.cwd() / "mlruns").as_uri()
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if uri.startswith(("http://", "https://")):  # a server that does not answer: a warning in seconds, not minutes
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    return uri


class Mlflow:
    """The config as params, each logged step's numeric figures as metrics at its step, the
    summary's figures as `summary/<figure>` metrics and its words as `summary.<key>` tags;
    the run ends FINISHED, KILLED (interrupted) or FAILED, as the summary's status says."""

    def __init__(self, settings: MlflowSettings, config: dict, run_dir: Path, project: str, job_type: str,
                 tags: list[str]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(settings)
        self.client = MlflowClient(tracking_uri=self.uri)
        name = settings.experiment or project
        found = self.client.get_experiment_by_name(name)
        self.experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(
            self.experiment, run_name=Path(run_dir).name,
            tags={"job_type": job_type, "run_dir": str(run_dir), "overrides": " ".join(tags)[:PARAM_CHARS]},
        ).info.run_id
        params = [Param(k[:250], v[:PARAM_CHARS]) for k, v in flat(config).items()]
        for start in range(0, len(params), PARAMS_A_CALL):
            self.client.log_batch(self.run_id, params=params[start:start + PARAMS_A_CALL])
        self.step = 0

    def where(self) -> str:
        shown = f" (mlflow ui --backend-store-uri {self.uri} shows it)" if self.uri.startswith("file:") else ""
        return f"run {self.run_id} in {self.uri}{shown}"

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        self.step = int(record["step"])
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, self.step)
                                                    for k, v in numbers(record).items() if k != "step"])

    def finish(self, summary: dict) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(f"summary/{k}", v, now, self.step) for k, v in numbers(summary).items()],
            tags=[RunTag(f"summary.{k}", str(v)[:PARAM_CHARS]) for k, v in summary.items() if isinstance(v, str)])
        self.client.set_terminated(self.run_id, END_STATUS.get(str(summary.get("status", "ok")), "FAILED"))
