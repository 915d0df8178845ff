"""A sweep on a cluster launcher submits its runs side by side (fsdp_exp.driver.sweep):
real jobs through submitit's local executor, and Ray Train runs on a local Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fsdp_exp.driver.check import run_key
from tests.conftest import SMALL_VIT, precheck, rank_pid, read_json, read_jsonl, run_cli

ONE_RANK = ["sharding=none", *SMALL_VIT, "train.steps=6", "data.num_samples=64",
            "memory.estimate=false"]  # given, not added by run_cli: the checks below see every override


def span(run_dir: Path) -> tuple[float, float]:
    """From the start of the run's rank to its last step."""
    started = read_json(run_dir / "summary.json")["startup"]["rank_started"]
    return started, read_jsonl(run_dir / "metrics.jsonl")[-1]["time"]


def overlap(a: Path, b: Path) -> bool:
    (start_a, end_a), (start_b, end_b) = span(a), span(b)
    return max(start_a, start_b) < min(end_a, end_b)


@pytest.mark.slow
def test_a_slurm_sweep_submits_every_run_first_and_lists_the_failed_one(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # batch 2048 passes every check and runs out of memory on its rank
    args = ["-m", "launcher=slurm", "launcher.cluster=local", "launcher.nproc_per_node=1", *ONE_RANK,
            "data.num_samples=2048", "memory.limit_gb=0.5", "train.batch_size=4,8,2048", f"hydra.sweep.dir={sweep}"]
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    runs = [sweep / str(n) for n in range(3)]
    assert [read_json(r / "summary.json")["status"] for r in runs] == ["ok", "ok", "oom"]
    assert overlap(runs[0], runs[1]), "the two runs that trained did so at the same time"
    # The failed run is listed at the end, with its reason.
    listed = result.stderr.split("fsdp_exp: 1 of 3 runs failed:\n")[1].splitlines()
    assert listed[0].startswith(f"  {runs[2]}: rank 0 failed: OutOfMemory: ") and "memory.limit_gb=0.5" in listed[0]
    # The console names each run by what it sweeps and shows its job's state, not rank 0's lines.
    assert "run 0 (train.batch_size=4): job " in result.stdout and " RUNNING" in result.stdout
    assert "[rank0][INFO] step" not in result.stdout
    # Each run keeps its own driver lines in its own log file.
    own = (runs[1] / "fsdp_exp.log").read_text()
    assert "run 1 (train.batch_size=8): job " in own and "run 0 (" not in own
    # Each run ran the plan the command checked before it made any directory.
    plans = precheck(args)
    for run in runs:
        overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
        assert run_key(overrides) in plans


@pytest.mark.slow
def test_max_parallel_1_runs_a_slurm_sweep_one_after_another(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "launcher=slurm", "launcher.cluster=local", "launcher.nproc_per_node=1",
                     "launcher.max_parallel=1", *ONE_RANK, "train.batch_size=4,8", f"hydra.sweep.dir={sweep}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not overlap(sweep / "0", sweep / "1")
    assert "[rank0][INFO] step 6/6" in result.stdout  # rank 0's lines, as for a run on its own


@pytest.mark.slow
def test_a_ray_sweep_runs_side_by_side_on_one_local_ray(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "launcher=ray", "launcher.num_workers=1", *ONE_RANK, "train.steps=20",
                     "train.batch_size=4,8", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [sweep / "0", sweep / "1"]
    assert [read_json(r / "summary.json")["status"] for r in runs] == ["ok", "ok"]
    assert overlap(*runs), "each run had its own worker, at the same time"
    assert "run 1 (train.batch_size=8): running" in result.stdout


@pytest.mark.slow
def test_ctrl_c_stops_every_run_in_flight(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    driver = subprocess.Popen(
        [sys.executable, "-m", "fsdp_exp", "-m", "launcher=slurm", "launcher.cluster=local",
         "launcher.nproc_per_node=1", *ONE_RANK, "train.steps=100000", "train.batch_size=4,8",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = [sweep / "0" / "rank0.log", sweep / "1" / "rank0.log"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(rank_pid(log) for log in logs):
        time.sleep(0.2)
    pids = [rank_pid(log) for log in logs]
    assert all(pids), "both runs started"
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 130
    assert "fsdp_exp: interrupted; each run's summary.json says where it stopped" in err.splitlines()
    assert [read_json(sweep / n / "summary.json")["status"] for n in ("0", "1")] == ["interrupted", "interrupted"]
    time.sleep(2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no rank outlives the command


def test_side_by_side_runs_at_most_max_parallel_at_once_and_close_stops_them(tmp_path: Path) -> None:
    """SideBySide's own mechanism, without a cluster: each run a thread, a new one waiting for
    a free slot; close() tells the runs in flight to stop and waits for them."""
    import threading

    from fsdp_exp.driver.sweep import SideBySide

    side, lock, running, most = SideBySide(), threading.Lock(), [0], [0]

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return i

    futures = [side.start(f"run {i}", tmp_path / str(i), 2, lambda i=i: work(i)) for i in range(5)]
    side.wait_all()
    assert [f.result() for f in futures] == list(range(5)) and most[0] == 2

    waiting = side.start("held", tmp_path / "held", 2, lambda: side.stop.wait(30) and "stopped")
    start = time.perf_counter()
    side.close()
    assert waiting.result(timeout=0) == "stopped" and time.perf_counter() - start < 5
