"""The FSDP2 setups users compare, run end to end from the command line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import SMALL_VIT, read_json, read_jsonl, run_cli

@pytest.mark.slow
def test_every_sharding_option_reaches_the_same_final_loss(tmp_path: Path) -> None:
    result = run_cli(
        "-m", "sharding=full,grad_op,hybrid,ddp,none", *SMALL_VIT, "train.steps=4",
        "train.batch_size=16", "train.log_every=2", cwd=tmp_path, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    summaries = [read_json(run / "summary.json") for run in sorted(sweep.iterdir()) if run.is_dir()]
    assert [s["choices"]["sharding"] for s in summaries] == ["full", "grad_op", "hybrid", "ddp", "none"]
    assert all(s["global_batch_size"] == 32 for s in summaries)
    reference = summaries[-1]["final_loss"]
    for s in summaries:
        assert abs(s["final_loss"] - reference) / reference < 1e-5, (s["choices"], s["final_loss"], reference)


@pytest.mark.slow
def test_runs_list_their_fsdp_units(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT, "train.steps=1", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    units = read_json(out / "summary.json")["fsdp_units"]
    assert [u["module"] for u in units] == [
        "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1", "(root)"]
    assert all(u["params"] > 0 for u in units)
    assert "FSDP units: encoder.layers.encoder_layer_0 (" in (out / "rank0.log").read_text()


@pytest.mark.slow
def test_fp16_with_loss_scaling_recovers_from_overflow(tmp_path: Path) -> None:
    """A scale of 2^24 overflows fp16 gradients at first: the ranks skip those steps
    together, halve the scale, and then train."""
    out = tmp_path / "run"
    result = run_cli(
        "precision=fp16", "precision.initial_scale=16777216", *SMALL_VIT, "train.steps=16",
        "train.log_every=1", "train.lr=3e-3", f"hydra.run.dir={out}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out / "metrics.jsonl")
    scales = [r["loss_scale"] for r in records]
    assert scales[0] < 2**24 and scales[-1] < scales[0], "overflowing steps must lower the scale"
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < 0.9 * records[0]["loss"], "fp16 training must make progress"


@pytest.mark.parametrize("data", ["synthetic_tokens", pytest.param("text", marks=pytest.mark.slow)])
def test_gpt_trains_on_tokens_and_counts_them(data: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(
        "model=gpt", "model.vocab_size=256", f"data={data}", "data.seq_len=64",
        "train.batch_size=8", "train.steps=12", "train.log_every=4", "train.lr=3e-3",
        "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = read_json(out / "summary.json")
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 64)
    records = read_jsonl(out / "metrics.jsonl")
    assert all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert [u["module"] for u in summary["fsdp_units"]] == ["blocks.0", "blocks.1", "(root)"]


@pytest.mark.slow
def test_compiled_blocks_train(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT, "train.compile=true", "train.steps=3", f"hydra.run.dir={out}",
                     cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr
    assert read_json(out / "summary.json")["status"] == "ok"


@pytest.mark.slow
def test_meta_init_keeps_gpt_tied_embeddings(tmp_path: Path) -> None:
    """Meta init must give the tied wte/lm_head model a plain build gives: same losses."""
    losses = {}
    for init in ("cpu", "meta"):
        out = tmp_path / init
        result = run_cli("model=gpt", "model.vocab_size=256", "data=text", "data.seq_len=32",
                         "train.batch_size=4", "train.steps=4", "train.log_every=1",
                         f"model.init_device={init}", "wandb.mode=disabled", f"hydra.run.dir={out}",
                         cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        losses[init] = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert losses["meta"] == pytest.approx(losses["cpu"], rel=1e-6)
