"""logger: wandb by default; TensorBoard, MLflow and CSV beside it or instead, each logging
the same steps and summary as metrics.jsonl and summary.json, read back with each library's
own reader; a tracker that is not installed, or a setting it lacks, refused in one line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from tests.conftest import SMALL_VIT, names, read_json, read_jsonl, refused_here, run_cli

def test_wandb_is_the_default_tracker_and_logger_names_the_others() -> None:
    def trackers(*overrides: str) -> tuple[list[str], str]:
        exp = prepare(compose_checked(list(overrides)), 0).exp
        return exp.logger.names, str(exp.wandb.mode)

    assert trackers() == (["wandb"], "offline")
    assert trackers("logger=[wandb,tensorboard]") == (["wandb", "tensorboard"], "offline")
    assert trackers("logger=tensorboard") == (["tensorboard"], "disabled")  # wandb not chosen: no wandb run
    assert trackers("logger=[mlflow,csv]") == (["mlflow", "csv"], "disabled")
    assert trackers("logger=[]") == ([], "disabled")


def test_every_tracker_logs_the_steps_and_the_summary_that_the_run_files_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One run to TensorBoard, MLflow (its file store) and CSV at once: each holds every
    logged step's loss and speed at its step, as metrics.jsonl does, and the summary's
    figures as summary.json does; TensorBoard's event reader, MLflow's client and the csv
    module read them back."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, store = tmp_path / "run", (tmp_path / "store").as_uri()
    result = run_cli(*SMALL_VIT, "logger=[tensorboard,mlflow,csv]", f"logger.mlflow.tracking_uri={store}",
                     "logger.mlflow.experiment=loggers", "train.steps=4", "train.log_every=2",
                     f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}
    summary = read_json(out / "summary.json")
    assert sorted(steps) == [2, 4]
    console = result.stdout + result.stderr
    assert f"tensorboard: in {out / 'tensorboard'}" in console and "mlflow: run " in console, console[-2000:]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for figure in ("loss", "samples_per_s"):
        assert {e.step: e.value for e in events.Scalars(figure)} == pytest.approx(
            {s: r[figure] for s, r in steps.items()}, rel=1e-6)
    assert events.Scalars("summary/final_loss")[-1].value == pytest.approx(summary["final_loss"], rel=1e-6)
    assert events.Scalars("summary/samples_per_s")[-1].value == pytest.approx(summary["samples_per_s"], rel=1e-6)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only so
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("loggers").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == out.name
    assert run.data.params["train.steps"] == "4" and run.data.params["logger.mlflow.experiment"] == "loggers"
    for figure in ("loss", "samples_per_s"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, figure)}
        assert history == pytest.approx({s: r[figure] for s, r in steps.items()}, rel=1e-9)
    assert run.data.metrics["summary/final_loss"] == pytest.approx(summary["final_loss"], rel=1e-9)

    with open(out / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [(s, r["loss"]) for s, r in steps.items()]
    with open(out / "summary.csv") as file:
        (row,) = list(csv.DictReader(file))
    assert float(row["final_loss"]) == summary["final_loss"] and float(row["samples_per_s"]) == summary["samples_per_s"]


@pytest.mark.parametrize("tracker, package", [("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_a_tracker_that_is_not_installed_is_refused_in_one_line_naming_its_extra(tracker: str, package: str,
                                                                                 tmp_path: Path) -> None:
    result = refused_here(*SMALL_VIT, f"logger=[wandb,{tracker}]", cwd=tmp_path, missing=(package,))
    assert result.returncode == 2
    names(result.stderr.strip().splitlines()[-1], f"logger={tracker}", f"pip install -e .[{tracker}]")


@pytest.mark.parametrize("override, key, allowed", [
    ("logger.mlflow.uri=x", "logger.mlflow.uri", ("tracking_uri", "experiment")),
    ("logger.tensorboard.logdir=x", "logger.tensorboard.logdir", ("dir",)),
    ("logger.wandb.mode=offline", "logger.wandb.mode", ("wandb.mode",)),
])
def test_a_setting_a_tracker_lacks_is_refused_naming_the_ones_it_has(override: str, key: str, allowed: tuple,
                                                                     tmp_path: Path) -> None:
    result = refused_here(*SMALL_VIT, "logger=[wandb,tensorboard,mlflow]", override, cwd=tmp_path)
    assert result.returncode == 2
    names(result.stderr.strip().splitlines()[-1], key, *allowed)


def test_an_unknown_tracker_is_refused_naming_the_ones_there_are(tmp_path: Path) -> None:
    result = refused_here(*SMALL_VIT, "logger=[wandb,neptune]", cwd=tmp_path)
    assert result.returncode == 2
    names(result.stderr.strip().splitlines()[-1], "logger=neptune", "csv", "mlflow", "tensorboard", "wandb")


@pytest.mark.slow
def test_a_tracker_that_cannot_reach_its_server_is_one_warning_and_the_run_trains(tmp_path: Path) -> None:
    """MLflow at a port nothing listens on: one warning naming logger=mlflow, within seconds
    (fewer retries than MLflow's own), and the run trains and writes its summary."""
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT, "logger=[mlflow,csv]", "logger.mlflow.tracking_uri=http://127.0.0.1:9",
                     "train.steps=2", f"hydra.run.dir={out}", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(out / "summary.json")["status"] == "ok" and (out / "summary.csv").is_file()
    warned = [line for line in (result.stdout + result.stderr).splitlines() if "logger=mlflow failed" in line]
    assert len(warned) == 1, (result.stdout + result.stderr)[-3000:]
