"""Ranks are started by torch's elastic launcher, or by an external torchrun."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fsdp_exp.launch.core import RunFailed, rank_threads
from fsdp_exp.launch.local import LocalLauncher
from tests import rank_tasks
from tests.conftest import SMALL_VIT, read_json, read_jsonl, run_cli


def test_local_launcher_returns_rank0_result(tmp_path: Path) -> None:
    result = LocalLauncher().launch(rank_tasks.report_rank, {"x": 1}, tmp_path, nproc=2)
    assert result == {"rank": 0, "world_size": 2, "x": 1}


def test_a_failing_rank_stops_the_run_within_seconds(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(RunFailed) as err:
        LocalLauncher().launch(rank_tasks.rank1_raises_while_rank0_waits, {}, tmp_path, nproc=2)
    assert time.perf_counter() - start < 30, "rank 0 stayed blocked in its collective"
    message = str(err.value)
    assert message.startswith("rank 1 failed: ValueError: boom on rank 1")
    assert "rank1.log" in message and "\n" not in message


@pytest.mark.slow
def test_under_external_torchrun_each_process_is_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(
        "--nproc_per_node=2", "-m", "fsdp_exp", *SMALL_VIT, "train.steps=3", "train.log_every=1",
        f"hydra.run.dir={out}",
        cwd=tmp_path, module=("-m", "torch.distributed.run"),
    )
    assert result.returncode == 0, result.stderr
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps"] == 3
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / ".hydra" / "config.yaml").exists()
    assert (out / "rank0.log").exists() and (out / "rank1.log").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"], "both ranks must write one run directory"
    # The same driver code as a run the launcher starts: the same records in summary.json.
    ours = tmp_path / "ours"
    result = run_cli(*SMALL_VIT, "train.steps=3", "train.log_every=1", f"hydra.run.dir={ours}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    launched = read_json(ours / "summary.json")
    assert set(summary) == set(launched) and set(summary["environment"]) == set(launched["environment"])
    assert summary["environment"]["device_seen_by"] == "rank 0" and summary["wall_s"] > 0
    assert summary["final_loss"] == pytest.approx(launched["final_loss"], abs=1e-6)


def test_a_failing_run_exits_nonzero_with_one_error_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(
        *SMALL_VIT, "data.num_samples=10", "train.batch_size=8", f"hydra.run.dir={out}", cwd=tmp_path,
    )  # each of the 2 ranks gets 5 samples: only a rank finds out
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert "rank 0 failed: ConfigError: train.batch_size=8: larger than this rank's share" in result.stderr + result.stdout
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and "lower it or use more data" in summary["error"]
    assert "Traceback" in (out / "rank0.log").read_text(), "the rank's log keeps the traceback"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_start_from_the_rank_server_or_fresh_and_never_inherit_a_launch(tmp_path: Path, method: str) -> None:
    """Forked ranks come from the rank server, which imported torch once and never trains:
    a launch after one whose ranks filled memory starts as small as the first. Each rank
    gets its share of the cores either way."""
    import multiprocessing.forkserver
    import os

    launcher = LocalLauncher(start_method=method)
    first = launcher.launch(rank_tasks.report_process, {"hold_mb": 300}, tmp_path / "a", nproc=2)
    second = launcher.launch(rank_tasks.report_process, {}, tmp_path / "b", nproc=2)
    assert first["anon_mb_holding"] > first["anon_mb"] + 250  # the first launch really held it
    assert abs(second["anon_mb"] - first["anon_mb"]) < 50, (first, second)
    parent = multiprocessing.forkserver._forkserver._forkserver_pid if method == "forkserver" else os.getpid()
    assert first["parent"] == second["parent"] == parent
    assert first["threads"] == second["threads"] == rank_threads(2)
