"""memory.limit_gb is a real per-rank ceiling: past it an allocation fails for real."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SMALL_VIT, read_json, run_cli


def test_a_batch_past_the_limit_runs_out_of_memory_and_a_small_one_trains(tmp_path: Path) -> None:
    common = [*SMALL_VIT, "memory.limit_gb=1.5", "train.steps=2"]
    small, large = tmp_path / "small", tmp_path / "large"
    ok = run_cli(*common, "train.batch_size=8", f"hydra.run.dir={small}", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert read_json(small / "summary.json")["peak_mem_gb"] < 1.5

    oom = run_cli(*common, "train.batch_size=2048", f"hydra.run.dir={large}", cwd=tmp_path)
    assert oom.returncode == 1
    summary = read_json(large / "summary.json")
    assert summary["status"] == "oom"
    assert "OutOfMemory: ran out of memory under memory.limit_gb=1.5: DefaultCPUAllocator" in summary["error"]
    assert "Traceback" not in oom.stdout + oom.stderr

