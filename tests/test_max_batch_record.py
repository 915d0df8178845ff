"""max_batch.json as a `MaxBatchRecord`: written and read back as the same record, keys of
older files kept, a missing or damaged file read as none; and the search's reuse of it."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.metrics.summary import Summary
from fsdp_exp.tasks.max_batch.probe import OWN_FIGURES, Probe
from fsdp_exp.tasks.max_batch.record import RECORD, MaxBatchRecord
from fsdp_exp.tasks.max_batch.search import MaxBatchSearch

def a_record(**changes) -> MaxBatchRecord:
    probe = Probe(64, "ok", peak_mem_gb=0.5, peak_under_limit_gb=0.48, samples_per_s=410.0).to_json()
    return MaxBatchRecord(**{
        "setup": "sharding=full", "device": "cpu", "world_size": 2, "limit_gb": 0.6, "resolution": 4,
        "max_batch_size": 64, "bounded_by": "oom", "noise_band_gb": 0.0006,
        "verification": {"steps": 0, "status": "not run", "runs": []},
        "too_small_to_train": [{"batch_size": 1, "reason": "BatchNorm"}], "probes": [probe], "probe_count": 1,
        "memory_model": {"intercept_gb": 0.3, "slope_gb_per_sample": 0.003, "points": 2, "measure": "peak_mem_gb"},
        "fingerprint": "abc123"} | changes)


def test_a_record_is_read_back_as_it_was_written_with_every_key_in_order(tmp_path: Path) -> None:
    record = a_record()
    record.write(tmp_path)
    assert MaxBatchRecord.read(tmp_path) == record
    written = json.loads((tmp_path / RECORD).read_text())
    assert list(written) == [f.name for f in fields(MaxBatchRecord) if f.name != "more"]  # unset ones as null
    assert written["searched_max_batch_size"] is None and written["probes"][0]["batch_size"] == 64


def test_a_key_the_record_has_no_field_for_is_kept_in_more_and_written_back(tmp_path: Path) -> None:
    (tmp_path / RECORD).write_text(json.dumps({"max_batch_size": 12, "an_older_key": 3.5}))
    record = MaxBatchRecord.read(tmp_path)
    assert record is not None
    assert (record.max_batch_size, record.more, record.probes) == (12, {"an_older_key": 3.5}, [])
    assert record.as_dict()["an_older_key"] == 3.5
    assert MaxBatchRecord.of(record.as_dict()) == record


@pytest.mark.parametrize("text", [None, "{\"max_batch_size\": 1", "[1, 2]"])
def test_no_file_or_a_damaged_one_is_no_record(tmp_path: Path, text: str | None) -> None:
    if text is not None:
        (tmp_path / RECORD).write_text(text)
    assert MaxBatchRecord.read(tmp_path) is None


def test_a_record_has_no_key_but_its_fields() -> None:
    record = a_record()
    with pytest.raises(AttributeError):
        record.max_batch = 12  # a misspelt max_batch_size
    with pytest.raises(TypeError):
        MaxBatchRecord(max_batch=12)


def search_in(run_dir: Path) -> MaxBatchSearch:
    plan = prepare(compose_checked(["task=max_batch", "memory.limit_gb=0.6", "task.estimate=false",
                                    "wandb.mode=disabled"]), 0)
    return MaxBatchSearch(plan.exp, run_dir, plan.launcher, 2)


def test_a_search_reuses_its_setups_probes_and_keeps_another_setups_or_a_damaged_record_aside(
        tmp_path: Path) -> None:
    search = search_in(tmp_path)
    a_record(fingerprint=search.fingerprint).write(tmp_path)
    assert [p.batch_size for p in search.recorded_probes()] == [64]

    a_record(fingerprint="another").write(tmp_path)
    assert search.recorded_probes() == []
    assert not (tmp_path / RECORD).exists()
    assert json.loads((tmp_path / "max_batch.another.json").read_text())["fingerprint"] == "another"

    for n, kept in enumerate(["max_batch.unreadable.json", "max_batch.unreadable.2.json"]):
        (tmp_path / RECORD).write_text(f"{{\"probes\": [{n}")  # cut short
        assert search.recorded_probes() == []
        assert not (tmp_path / RECORD).exists()
        assert (tmp_path / kept).read_text() == f"{{\"probes\": [{n}"


def test_a_probe_that_trained_reads_each_figure_its_run_summary_has_by_the_same_name() -> None:
    shared = [f.name for f in fields(Probe) if f.name in Summary.names() and f.name not in OWN_FIGURES]
    summary = Summary(**{name: float(i + 1) for i, name in enumerate(shared)}, peak_settled_at_step=13,
                      estimate_ratio=9.0, wall_s=99.0)
    probe = Probe.trained(32, summary, startup_s=1.5)
    assert {name: getattr(probe, name) for name in shared} == {name: float(i + 1) for i, name in enumerate(shared)}
    assert "peak_under_limit_gb_per_rank" in shared and "samples_per_s" in shared
    assert (probe.batch_size, probe.status, probe.settled_at_step, probe.startup_s) == (32, "ok", 13, 1.5)
    # the search's own figures are not the run's: its estimate and the probe's time from its launch
    assert (probe.estimate_ratio, probe.wall_s) == (None, 0.0)


def test_the_answer_goes_to_wandb_as_its_figures(tmp_path: Path) -> None:
    """The search's wandb run (offline) gets the probes as a table, the plot and the answer's
    figures as its summary: the record a task answers with, read by its fields."""
    from fsdp_exp.run_context import RunContext
    from fsdp_exp.tasks.max_batch.plot import plot_max_batch
    from fsdp_exp.tasks.max_batch.report import log_to_wandb

    exp = prepare(compose_checked(["task=max_batch", "memory.limit_gb=0.6", "wandb.mode=offline"]), 0).exp
    record = a_record(samples_per_s=410.0, recommended_batch_size=48)
    png = tmp_path / "max_batch.png"
    plot_max_batch(record, png)
    log_to_wandb(exp, RunContext(), tmp_path, record, png)
    import wandb

    # the run's record log is written out by wandb's service when the run's stream closes, which
    # run.finish() only asks for; a command's exit waits for it (wandb's atexit teardown), as here
    wandb.teardown()
    (log_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = log_file.read_bytes()  # wandb's record log: protobuf strings are stored as-is
    for key in (b"max_batch_size", b"recommended_batch_size", b"bounded_by", b"probes", b"max_batch"):
        assert key in data, key
