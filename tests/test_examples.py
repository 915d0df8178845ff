"""The examples of models as their users write them (examples/*), each from its own folder and
config folder as its README runs it: trained on 2 ranks, each run's peak memory against the
run's own estimate (memory.estimate, as by default). task=max_batch and task=tune on them run
in tests/test_documented_commands.py, their answers pasted and run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, estimated_first, read_json, read_jsonl, run_cli

EXAMPLES = {
    "denoiser": ["model=dit"],
    "instructions": ["model=hf", "data=instructions"],
    "two_inputs": ["model=image_caption"],
}
SHORT = ["hydra.searchpath=[file://conf]", "train.steps=8", "train.log_every=2", "metrics.warmup_steps=2",
         "wandb.mode=offline"]  # as a user without an API key runs it


def example(name: str, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of examples/`name`, and the environment of a user who installed its package."""
    folder = tmp_path / name
    shutil.copytree(REPO / "examples" / name, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder, {"PYTHONPATH": str(folder)}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_trains_and_peaks_within_a_tenth_of_its_own_estimate(name: str, tmp_path: Path) -> None:
    folder, env = example(name, tmp_path)
    run = tmp_path / "run"
    estimated_first(*EXAMPLES[name], *SHORT, cwd=folder, where=tmp_path / "estimate", extra_env=env)
    result = run_cli(*EXAMPLES[name], *SHORT, f"hydra.run.dir={run}", cwd=folder, extra_env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]
    assert losses[-1] < losses[0], losses
    summary = read_json(run / "summary.json")
    assert "estimate_failed" not in summary, summary.get("estimate_failed")
    assert abs(summary["estimate_ratio"] - 1) <= 0.1, {k: v for k, v in summary.items() if "estimat" in k or "peak" in k}
