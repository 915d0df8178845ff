"""`python -m fsdp_exp.gpu_session` (`make gpu-session`): its refusal without a GPU, its
matmul, its runs as fsdp_exp composes them, and its rows and JSON on runs as summary.json
reports them (no GPU runs here: what only a GPU shows is the session's to prove)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_exp import memory
from fsdp_exp.commands.gpu_checks import checks, runs, setup_for
from fsdp_exp.commands.gpu_judges import RunResult
from fsdp_exp.commands.experiment import compose_config
from fsdp_exp.driver.plan import prepare
from fsdp_exp.commands.gpu_session import against_matmul, matmul_tflops, session, session_checks, session_runs, tuned
from fsdp_exp.metrics.summary import Summary
from tests.conftest import REPO, run_cli
from tests.test_check_gpu import fsdp_exp_args, passing_runs, result

GPU = setup_for("cuda", gpus=1, memory_gb=80.0)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fsdp_exp.gpu_session", "--out", str(tmp_path / "s.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "fsdp_exp.gpu_session: needs a GPU (torch.cuda.is_available() is False here); on a CPU, make test runs "
        "what can be checked"]
    assert not (tmp_path / "s.json").exists()


def test_the_matmul_is_timed_through_the_one_door_to_the_gpus_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the matmuls are queued: the time is read after waiting for them
    (`distributed.synchronize`), twice, around the timed ones."""
    from fsdp_exp import distributed

    waits: list[str] = []
    monkeypatch.setattr(distributed, "synchronize", lambda device: waits.append(device.type))
    assert matmul_tflops(torch.device("cpu"), size=64, repeats=2) > 0
    assert waits == ["cpu", "cpu"]


@pytest.mark.parametrize("setup", [GPU, setup_for("cpu", gpus=0)], ids=["cuda", "cpu"])
def test_every_session_run_composes_and_passes_the_plan(setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_exp.commands.check_gpu import command

    monkeypatch.setattr(memory, "device_memory_gb", lambda device: 80.0)
    for name, overrides in session_runs(setup, tmp_path).items():
        plan = prepare(compose_config(fsdp_exp_args(command(overrides, tmp_path / name))), 1 if setup.device == "cuda" else 0)
        assert plan.exp.device.value == setup.device and plan.exp.wandb.mode.value == "disabled", name
    assert "checkpoint=dcp_async_pinned" in session_runs(setup, tmp_path)["pinned_resumed"]


def test_the_session_runs_check_gpus_rows_and_its_own_and_writes_every_row(tmp_path: Path) -> None:
    ran: list[str] = []
    fake_run = passing_runs(tmp_path, ran)
    out = tmp_path / "gpu_session.json"
    assert session(GPU, tmp_path, out, {"gpu": "NVIDIA H200", "gpus": 1}, run=fake_run, matmul=(700.0, ""))
    record = json.loads(out.read_text())
    names = [c.name for c in [*checks(GPU), *session_checks(GPU, (700.0, ""))]]
    assert [r["check"] for r in record["rows"]] == names and all(r["result"] == "pass" for r in record["rows"])
    assert record["passed"] and record["gpu"] == "NVIDIA H200" and record["matmul_tflops"] == 700.0
    assert set(ran) == {*runs(GPU, tmp_path), *session_runs(GPU, tmp_path)}  # check_gpu's runs and the session's
    assert ran.count("full") == 1  # a run several rows read runs once
    row = next(r for r in record["rows"] if r["check"] == "MFU against a bf16 matmul measured here")
    assert row["detail"].startswith("300.0 TFLOP/s a device, 43% of a bf16 matmul's 700.0 here")


def test_the_tune_row_needs_a_winner_whose_command_line_ran_and_the_mfu_row_a_matmul() -> None:
    assert tuned(result(winner="sharding=full", winner_confirmed=True, setups=2, probes=6))[0]
    assert not tuned(result(winner="sharding=full", winner_confirmed=False))[0]
    assert not tuned(result("failed", error="rank 0 failed: boom"))[0]
    run = RunResult(Path("run"), Summary.of({"status": "ok", "tflops_per_device": 300.0, "mfu": 0.3,
                                             "peak_tflops": 989.5}), {}, [])
    assert against_matmul(run, 700.0, "")[0]
    assert not against_matmul(run, 200.0, "")[0]  # more than a matmul: the FLOPs are miscounted
    assert against_matmul(run, None, "CUDA error") == (False, "the matmul was not measured: CUDA error")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_whole_session_runs_on_two_cpu_ranks_and_writes_every_row(tmp_path: Path) -> None:
    """`python -m fsdp_exp.gpu_session --device cpu`, end to end on gloo: check_gpu's rows and
    the session's own against real runs (about 9 minutes on 2 cores)."""
    out = tmp_path / "gpu_session.json"
    done = run_cli("--device", "cpu", "--out", str(out), cwd=tmp_path, module=("-m", "fsdp_exp.gpu_session"),
                   timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| check", "| ---"))]
    record = json.loads(out.read_text())
    cpu = setup_for("cpu", 0)
    assert len(rows) == len(record["rows"]) == len([*checks(cpu), *session_checks(cpu, (1.0, ""))])
    assert record["passed"] and all(r["result"] == "pass" for r in record["rows"]), rows
