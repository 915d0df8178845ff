"""The speed model (fsdp_exp.estimate.speed): what a step does, counted by its trace, and
this machine's rates fitted to measured runs."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.estimate.gpu import gpu_named
from fsdp_exp.errors import ConfigError
from fsdp_exp.estimate.how_fast import add_speeds, read_calibration, roofline
from fsdp_exp.estimate.record import EstimateRecord
from fsdp_exp.estimate.trace import trace
from fsdp_exp.estimate.speed import (PARTS, Measured, Rates, StepWork, calibrate, held_out, model_error,
                                     nonnegative_least_squares)
from tests.conftest import SMALL_VIT, read_json, run_cli
from tests.test_estimate import DEPTH, FP32, WIDTH, traced

# seconds per FLOP, per byte sent, per byte offloaded, per parameter stepped, per step
TRUE = (1 / 50e9, 1 / 1e9, 0.0, 1 / 2e9, 3e-3)


def run_of(setup: str, work: StepWork, batch: int, rates: tuple = TRUE, noise: float = 0.0,
           rng: random.Random | None = None) -> Measured:
    """A run of `work` at `batch` as a machine of `rates` would time it, off by up to `noise`."""
    step = sum(r * x for r, x in zip(rates, work.parts(batch)))
    jitter = 1 + (rng.uniform(-noise, noise) if rng else 0.0)
    return Measured(setup, work, batch, batch * work.world_size / step * jitter)


FULL = StepWork(8, 8e9, 6e7, 0, 5e6, 2)
GRAD_OP = StepWork(8, 8e9, 4e7, 0, 5e6, 2)
DDP = StepWork(8, 8e9, 4e7, 0, 1e7, 2)
RECOMPUTED = StepWork(8, 10.7e9, 6e7, 0, 5e6, 2)


def test_the_rates_fitted_to_runs_of_known_cost_predict_a_setup_none_of_them_was():
    runs = [run_of("full", FULL, 16), run_of("full", FULL, 128), run_of("ddp", DDP, 64),
            run_of("recomputed", RECOMPUTED, 32), run_of("grad_op", GRAD_OP, 200)]
    rates = calibrate(runs)
    assert rates is not None and (rates.runs, rates.setups) == (5, 4)
    for m in runs:
        assert rates.samples_per_s(m.work, m.batch_size) == pytest.approx(m.samples_per_s, rel=1e-6)
    unseen = StepWork(8, 8e9, 1.2e8, 0, 2.5e6, 2)  # a wider world's traffic, a smaller shard
    truth = run_of("unseen", unseen, 96).samples_per_s
    assert rates.samples_per_s(unseen, 96) == pytest.approx(truth, rel=1e-6)
    shown = rates.to_json()
    assert shown["tflops"] == pytest.approx(0.05, rel=1e-6) and shown["wire_gb_per_s"] == pytest.approx(1, rel=1e-6)
    assert Rates.from_json(shown) == rates


def test_a_cost_no_run_varied_is_priced_at_nothing_so_a_prediction_leans_fast():
    runs = [run_of("full", FULL, 16), run_of("full", FULL, 128), run_of("ddp", DDP, 64)]
    rates = calibrate(runs)
    assert rates is not None
    offloaded = StepWork(8, 8e9, 6e7, 4e7, 5e6, 2)
    slow = (*TRUE[:2], 1 / 10e9, *TRUE[3:])  # a machine where moving those bytes costs
    assert rates.seconds[PARTS.index("offload_bytes")] == 0
    assert rates.samples_per_s(offloaded, 64) > run_of("offloaded", offloaded, 64, slow).samples_per_s
    assert all(r >= 0 for r in rates.seconds)


def test_the_least_squares_keep_every_rate_at_or_above_zero_and_are_least_otherwise():
    rng = random.Random(0)
    for _ in range(30):
        a = [[rng.uniform(0, 1) for _ in range(4)] for _ in range(6)]
        b = [rng.uniform(-0.5, 1) for _ in range(6)]
        x = nonnegative_least_squares(a, b)
        assert all(v >= 0 for v in x)
        misfit = sum((sum(aij * xj for aij, xj in zip(row, x)) - bi) ** 2 for row, bi in zip(a, b))
        # no point of a grid over the non-negative orthant fits better
        for grid in itertools.product([0, 0.25, 0.5, 1, 2], repeat=4):
            other = sum((sum(aij * g for aij, g in zip(row, grid)) - bi) ** 2 for row, bi in zip(a, b))
            assert misfit <= other + 1e-9


def test_the_models_error_is_its_largest_miss_of_a_setup_it_did_not_see():
    rng = random.Random(1)
    runs = [run_of("full", FULL, b, noise=0.03, rng=rng) for b in (16, 128)]
    assert model_error(runs) is None  # one setup: none to hold out
    assert held_out(runs, "full") is None
    runs += [run_of("ddp", DDP, 64, noise=0.03, rng=rng), run_of("recomputed", RECOMPUTED, 32, noise=0.03, rng=rng),
             run_of("grad_op", GRAD_OP, 200, noise=0.03, rng=rng)]
    misses = {s: abs(held_out(runs, s) / max(m.samples_per_s for m in runs if m.setup == s) - 1)
              for s in ("full", "ddp", "recomputed", "grad_op")}
    assert model_error(runs) == pytest.approx(max(misses.values()))
    assert 0 < model_error(runs) < 0.5


def test_a_steps_flops_and_bytes_sent_are_counted_from_its_trace():
    """The trace counts what each sharding sends, as a ring sends it between 2 ranks: full
    gathers the parameters twice (forward, backward) and reduce-scatters the gradients once,
    grad_op gathers once, DDP all-reduces its gradient buckets; and the FLOPs the step ran,
    the recomputed forward too."""
    batch = 16
    params = DEPTH * WIDTH * WIDTH * FP32
    works = {}
    for sharding in ("full", "grad_op", "ddp"):
        _, found = traced(f"sharding={sharding}", batch_sizes=[batch, 2 * batch] if sharding == "full" else [batch])
        works[sharding] = found.steps[0]
        if sharding == "full":
            full = found
    assert works["full"].batch_size == batch and full.steps[1].flops == 0  # counted once, at the first size
    # each rank sends half of every whole in a ring of 2; the loss's one all-reduced number beside
    assert works["grad_op"].wire_bytes == pytest.approx(params, abs=64)
    assert works["full"].wire_bytes == pytest.approx(1.5 * params, abs=64)
    assert works["ddp"].wire_bytes == pytest.approx(params, abs=64)
    # forward 2BW^2 a layer; backward the weights' gradient a layer, the input's all but the first
    flops = 2 * batch * WIDTH * WIDTH * (3 * DEPTH - 1)
    assert {s: w.flops for s, w in works.items()} == {s: flops for s in works}
    assert full.optimizer_params == DEPTH * WIDTH * WIDTH // 2  # its shard


def test_the_forward_activation_checkpointing_recomputes_is_in_a_traced_steps_flops():
    """The ViT's blocks hold most of its FLOPs: the step with their forward recomputed runs
    a large share more. (A block of one linear layer recomputes nothing: its backward needs
    only what went in, which the checkpoint keeps.)"""
    def step_flops(checkpointing: str) -> int:
        plan = prepare(compose_checked([*SMALL_VIT, f"train.activation_checkpointing={checkpointing}"]), 0)
        return trace(plan.exp, 2, [8], on_gpu=False).steps[0].flops

    plain, recomputed = step_flops("false"), step_flops("true")
    assert plain > 0 and recomputed > 1.2 * plain


def test_a_named_gpus_roofline_is_its_flops_at_the_peak_and_says_it_is_an_upper_bound():
    record = EstimateRecord(batch_size=64, world_size=8, batches=[{"batch_size": 32}, {"batch_size": 64}],
                            step_work=StepWork(32, 4e12, 1e9, 0, 1e8, 8).to_json())
    rates, words = roofline(gpu_named("H100-SXM"), "bf16")
    add_speeds(record, rates, words, tokens_per_sample=1024)
    # 64 samples a rank at 8e12 FLOPs a step, at 989.5 TFLOP/s: nothing else costs a roofline
    assert record.predicted_samples_per_s == pytest.approx(64 * 8 * 989.5e12 / 8e12)
    assert record.predicted_tokens_per_s == pytest.approx(record.predicted_samples_per_s * 1024)
    assert record.batches[0]["predicted_samples_per_s"] == pytest.approx(32 * 8 * 989.5e12 / 4e12)
    assert record.speed_from.endswith("an upper bound") and "H100 SXM" in record.speed_from
    assert roofline(gpu_named("A100-80GB"), "tf32")[0].seconds[0] == pytest.approx(1 / 156e12)
    assert roofline(gpu_named("T4"), "bf16") is None  # no peak in the table: no figure made up
    assert roofline(gpu_named("24"), "bf16") is None


def test_a_tunes_calibration_says_how_fast_an_estimated_setup_trains(tmp_path):
    rates = calibrate([run_of("full", FULL, 16), run_of("full", FULL, 128), run_of("ddp", DDP, 64)])
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "tune.json").write_text(json.dumps({"speed_model": rates.to_json()}))
    out = tmp_path / "estimate"
    result = run_cli("task=estimate", "model=cnn", "task.batch_sizes=[16,64]", "wandb.mode=disabled",
                     f"task.calibration={tmp_path / 'tuned'}", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    record = read_json(out / "estimate.json")
    work = StepWork.from_json(record["step_work"])
    for batch in record["batches"]:
        assert batch["predicted_samples_per_s"] == pytest.approx(rates.samples_per_s(work, batch["batch_size"]))
    assert record["predicted_samples_per_s"] == pytest.approx(rates.samples_per_s(work, record["batch_size"]))
    assert f"predicted at batch {record['batch_size']}: " in result.stdout
    assert read_json(out / "summary.json")["predicted_samples_per_s"] == record["predicted_samples_per_s"]


def test_a_calibration_that_is_not_a_tunes_is_refused_in_one_line(tmp_path):
    result = run_cli("task=estimate", "model=cnn", "task.calibration=nowhere", cwd=tmp_path)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1
    assert "task.calibration=nowhere: no tune.json there; give a task=tune run's folder or its tune.json" \
        in result.stderr
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tune.json").write_text(json.dumps({"speed_model": None}))
    with pytest.raises(ConfigError, match="that tune has no speed model"):
        read_calibration(str(tmp_path / "plain"))
    (tmp_path / "plain" / "tune.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a tune's record"):
        read_calibration(str(tmp_path / "plain" / "tune.json"))


def test_a_calibration_knows_the_batches_it_was_fitted_at_and_a_prediction_outside_them_says_so():
    rates = calibrate([run_of("full", FULL, 16), run_of("full", FULL, 128), run_of("ddp", DDP, 64)])
    assert rates.batches == (16, 128) and Rates.from_json(rates.to_json()).batches == (16, 128)
    assert rates.fitted_at(16) and rates.fitted_at(100) and not rates.fitted_at(8) and not rates.fitted_at(512)
    record = EstimateRecord(batch_size=512, world_size=2, batches=[{"batch_size": 64}, {"batch_size": 512}],
                            step_work=FULL.to_json())
    add_speeds(record, rates, "task.calibration=x", tokens_per_sample=0)
    assert [b["within_calibration"] for b in record.batches] == [True, False]
    assert "(16 to 128)" in record.speed_from
