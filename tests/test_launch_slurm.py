"""launcher=slurm through submitit's local executor: the real job path (pickles, one task per
rank, submitit's signal handling and requeue), without a SLURM cluster.

Preemption is simulated as SLURM does it: USR2 to every task of the job (`--signal=USR2@90`
reaches all tasks of the step). submitit's `LocalJob._interrupt()` cannot be used: it signals
the local controller, which has no handler for USR2 and dies, orphaning the tasks.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.slurm import SlurmLauncher
from tests.conftest import REPO, SMALL_VIT, names, read_json, read_jsonl, refused_here, run_cli, signal_at_step

SLURM_LOCAL = ["launcher=slurm", "launcher.cluster=local"]


def test_a_run_trains_on_two_ranks_as_the_tasks_of_one_job(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SLURM_LOCAL, *SMALL_VIT, "train.steps=4", "train.log_every=2", f"hydra.run.dir={out}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps"] == 4
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [2, 4]
    assert (out / ".hydra" / "config.yaml").is_file()
    assert (out / "rank0.log").is_file() and (out / "rank1.log").is_file()
    # One job of two tasks, in submitit's folder: one result per task.
    (submitted,) = (out / "slurm").glob("*_submitted.pkl")
    job = submitted.name.split("_")[0]
    assert sorted(p.name for p in (out / "slurm").glob("*_result.pkl")) == [f"{job}_{r}_result.pkl" for r in (0, 1)]
    # Rank 0's console lines reach the driver's console, as with launcher=local.
    assert "[rank0][INFO] step 4/4" in result.stdout
    assert "submitit INFO" not in result.stdout


# Probes of 500 steps, whatever their size: each runs past a 1 s task.probe_timeout (a probe of the
# default 3 steps, forked from the rank server, can end inside it)
LONG_PROBES = ("task.steps_per_probe=500", "task.settle_steps=500")


@pytest.mark.slow
def test_a_failing_rank_exits_1_with_one_line_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SLURM_LOCAL, *SMALL_VIT, "data=custom", "data._target_=tests.test_launch_local.damaged",
                     f"hydra.run.dir={out}", cwd=tmp_path, extra_env={"PYTHONPATH": str(REPO)})
    # the data's first item loads (the driver checks it); only a rank, reading its batches, finds out
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    line = next(line for line in output.splitlines() if re.search(r"failed: ValueError: .*is damaged", line))
    assert f"(log: {out / 'rank0.log'})" in line or f"(log: {out / 'rank1.log'})" in line
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and summary["world_size"] == 2
    assert re.match(r"rank [01] failed: ValueError: .*sample \d+ is damaged", summary["error"])
    failed = re.match(r"rank (\d)", summary["error"]).group(1)
    assert "Traceback" in (out / f"rank{failed}.log").read_text(), "the rank's log keeps the traceback"


@pytest.mark.slow
def test_a_rank_out_of_memory_makes_the_run_an_oom(tmp_path: Path) -> None:
    """RunFailed(out_of_memory=True) from a rank's OutOfMemory, whatever the other ranks did."""
    out = tmp_path / "run"
    result = run_cli(*SLURM_LOCAL, *SMALL_VIT, "memory.limit_gb=0.3", "train.steps=2", f"hydra.run.dir={out}",
                     cwd=tmp_path)
    assert result.returncode == 1
    summary = read_json(out / "summary.json")
    assert summary["status"] == "oom", summary
    assert summary["error"].startswith(("rank 0 failed: OutOfMemory: ", "rank 1 failed: OutOfMemory: "))
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_max_batch_probes_run_as_jobs_and_the_answer_is_printed(tmp_path: Path) -> None:
    run_dir = tmp_path / "search"
    result = run_cli(*SLURM_LOCAL, "task=max_batch", "memory.limit_gb=0.6", *SMALL_VIT, "task.resolution=8",
                     "task.search_up_to=8", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("max batch: 8 per rank on 2 rank(s) (fits at task.search_up_to=8 under memory.limit_gb=0.6)"
            in result.stdout)
    summary = read_json(run_dir / "summary.json")
    assert summary["status"] == "ok" and summary["max_batch_size"] == 8 and summary["world_size"] == 2
    (probe,) = (run_dir / "probes").iterdir()  # one probe, one job of two tasks
    assert len(list((probe / "slurm").glob("*_result.pkl"))) == 2
    assert read_json(probe / "summary.json")["status"] == "ok"


@pytest.mark.slow
def test_max_batch_oom_probes_are_ooms(tmp_path: Path) -> None:
    """Under a limit below what batch 1 needs, the probe is an oom, and a second job measures
    what batch 1 needs without the limit: none fits, which is a result (exit code 3)."""
    run_dir = tmp_path / "search"
    result = run_cli(*SLURM_LOCAL, "task=max_batch", "memory.limit_gb=0.3", *SMALL_VIT, f"hydra.run.dir={run_dir}",
                     cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "probe 1: batch 1: oom (rank " in result.stdout and "failed: OutOfMemory: " in result.stdout
    assert "max batch: none fits under memory.limit_gb=0.3: batch 1 needs" in result.stdout
    record = read_json(run_dir / "max_batch.json")
    assert record["probes"][0]["status"] == "oom" and record["smallest_batch_need_probe"]["status"] == "ok"
    assert record["max_batch_size"] == 0 and record["smallest_batch_needs_gb"] > 0.3
    for probe in ("01_b1", "02_b1"):  # each probe is one job of its own, in its own directory
        assert len(list((run_dir / "probes" / probe / "slurm").glob("*_submitted.pkl"))) == 1
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_probe_past_its_timeout_is_recorded_as_failed(tmp_path: Path) -> None:
    """The ranks' own SIGALRM ends them; the launcher reports it as timed_out."""
    run_dir = tmp_path / "search"
    result = run_cli(*SLURM_LOCAL, "task=max_batch", "memory.limit_gb=0.6", *SMALL_VIT, "task.probe_timeout=1", *LONG_PROBES,
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 1
    assert "batch 1 does not train: ran past task.probe_timeout=1 s" in result.stdout
    # the estimate's first size, then the smallest: both ran past it
    probes = read_json(run_dir / "max_batch.json")["probes"]
    assert [p["batch_size"] for p in probes][-1] == 1 and len(probes) <= 2
    assert all(p["status"] == "failed" and p["timed_out"] and "task.probe_timeout=1" in p["reason"] for p in probes)


# ---- preemption, requeue and restarts --------------------------------------------------------
PREEMPTIBLE = [*SLURM_LOCAL, *SMALL_VIT, "train.steps=30", "train.log_every=1", "checkpoint=dcp", "checkpoint.every=2"]


def interrupt_mid_run(out: Path, overrides: list[str], at_step: int, signals: dict[int, int]) -> tuple[int, str, int]:
    """Start a run, send each rank its signal once it has logged `at_step`; the run's exit
    code, its output and the step it was signalled at."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    run = subprocess.Popen([sys.executable, "-m", "fsdp_exp", *PREEMPTIBLE, *overrides, f"hydra.run.dir={out}"],
                           cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        signalled_at = signal_at_step([run], [out], at_step, signals)  # rank 1 first: rank 0 leaves at once
        output = run.communicate(timeout=300)[0]
    finally:
        run.kill()
    assert signalled_at is not None and signalled_at < 30, f"the run was not signalled mid-run: {signalled_at}"
    return run.returncode, output, signalled_at


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_preempted_job_is_requeued_and_resumes_from_the_latest_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "preempted"
    code, output, at = interrupt_mid_run(out, ["launcher.max_restarts=1"], at_step=5,
                                         signals={1: signal.SIGUSR2, 0: signal.SIGUSR2})
    assert code == 0, output[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["steps"] == 30
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "resumed"]
    assert len(events) == 1 and events[0]["step"] in range(2, at + 1, 2), events
    assert summary["resumed_from_step"] == events[0]["step"]
    assert "restart 1 of the ranks" in (out / "rank0.log").read_text()
    # Requeued by submitit, not resubmitted: one job, whose rank 0 caught the signal and requeued it.
    (submitted,) = (out / "slurm").glob("*_submitted.pkl")
    job = submitted.name.split("_")[0]
    rank0_job_log = (out / "slurm" / f"{job}_0_log.out").read_text()
    assert "this job is preempted" in rank0_job_log and f"Requeued job {job}" in rank0_job_log
    # Against the same run uninterrupted: the same final loss.
    whole = tmp_path / "whole"
    result = run_cli(*PREEMPTIBLE, f"hydra.run.dir={whole}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert abs(summary["final_loss"] - read_json(whole / "summary.json")["final_loss"]) <= 1e-6


@pytest.mark.slow
def test_a_preempted_job_with_no_requeue_left_fails_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "preempted"
    code, output, _ = interrupt_mid_run(out, [], at_step=3, signals={1: signal.SIGUSR2, 0: signal.SIGUSR2})
    assert code == 1
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed"
    assert summary["error"].startswith("rank 0 failed: RequeueRefused: ")
    assert "launcher.max_restarts=0" in summary["error"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_makes_the_driver_resubmit_from_the_latest_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    code, output, at = interrupt_mid_run(out, ["launcher.max_restarts=1"], at_step=5, signals={1: signal.SIGKILL})
    assert code == 0, output[-3000:]
    assert read_json(out / "summary.json")["status"] == "ok"
    assert len(list((out / "slurm").glob("*_submitted.pkl"))) == 2, "a second job, submitted by the driver"
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "resumed"]
    assert len(events) == 1 and events[0]["step"] in range(2, at + 1, 2), events
    assert "restarting the ranks (1 of launcher.max_restarts=1)" in output


# ---- what cannot be submitted: one line, exit 2, no output directory ---------------------------
def fake_missing_submitit(tmp_path: Path) -> dict:
    """A `submitit` that fails to import, first on PYTHONPATH: what `import submitit` sees
    when the package is not installed."""
    fake = tmp_path / "no_submitit" / "submitit"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'submitit'\")\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))}


def test_without_submitit_launcher_slurm_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    """`import submitit` fails as when the package is not installed. The refusal comes during
    the checks: exit 2, no output."""
    result = refused_here(*SLURM_LOCAL, *SMALL_VIT, cwd=tmp_path, missing=("submitit",))
    assert result.returncode == 2, result.stderr[-3000:]
    names(result.stderr, "launcher=slurm", "submitit", "pip install -e .[slurm]")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("settings, message", [
    pytest.param({"cluster": "slurm"},
                 "launcher.cluster=slurm: no SLURM here (sbatch not found); use launcher.cluster=local to try it "
                 "on this machine",
                 marks=pytest.mark.skipif(shutil.which("sbatch") is not None, reason="this machine has sbatch")),
    ({"cluster": "local", "nodes": 2},
     "launcher.nodes=2: launcher.cluster=local runs on this machine only; use launcher.nodes=1"),
    ({"cluster": "local", "timeout_min": 0}, "launcher.timeout_min=0: must be at least 1"),
], ids=["no-sbatch", "local-nodes", "timeout"])
def test_what_cannot_be_submitted_is_refused_by_the_checks(settings: dict, message: str) -> None:
    """The values are checked as the launcher is built, what this machine must have when
    the driver asks for the world size (the test above runs both through the CLI)."""
    with pytest.raises(ConfigError) as refused:
        SlurmLauncher(**settings).world_size(0)
    assert str(refused.value) == message


def test_the_world_size_is_nodes_times_ranks_per_node() -> None:
    assert SlurmLauncher(cluster="local").world_size(0) == 2
    assert SlurmLauncher(cluster="local", nproc_per_node=3).world_size(0) == 3
    assert SlurmLauncher(cluster="local", gpus_per_node=0, nproc_per_node="auto").per_node() == 2
    assert SlurmLauncher(cluster="slurm", gpus_per_node=4, nodes=2).per_node() == 4


def test_the_settings_become_the_job_script_submitit_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sbatch script for a 2-node job, as submitit's SLURM executor writes it (an `srun`
    on PATH only gets past its check that this is a cluster; nothing is submitted)."""
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}{os.pathsep}{os.environ['PATH']}")
    launcher = SlurmLauncher(cluster="slurm", nodes=2, gpus_per_node=8, cpus_per_task=12, mem_gb=480,
                             timeout_min=240, partition="gpu", account="acct", qos="high", constraint="h100",
                             setup=["module load cuda"], max_restarts=2)
    executor = launcher.executor(tmp_path / "jobs", nodes=2, tasks_per_node=launcher.per_node())._executor
    script = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --mem=480GB", "#SBATCH --time=240", "#SBATCH --partition=gpu",
                 "#SBATCH --account=acct", "#SBATCH --qos=high", "#SBATCH --constraint=h100",
                 "#SBATCH --signal=USR2@90", "module load cuda"]:
        assert line in script.splitlines(), (line, script)
    assert "srun --unbuffered" in script and "--kill-on-bad-exit=1" in script
    assert executor.max_num_timeout == 2  # submitit's own bound on requeues after a time limit
