"""`python -m fsdp_exp.check_gpu` on CPU: the no-GPU path, each check's command lines, how each
judges runs (hand-made summaries in the on-disk format), and the table.

The checks themselves need a GPU. `--device cpu` runs them on 2 gloo ranks for development;
that whole run is the slow test at the end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fsdp_exp import memory
from fsdp_exp.commands.check_gpu import (
    TABLE_HEAD,
    check_all,
    command,
    read_run,
    run_fsdp_exp,
    table_row,
)
from fsdp_exp.commands.gpu_checks import PARITY_STEPS, checks, runs, setup_for
from fsdp_exp.commands.gpu_judges import (
    RunResult,
    compiled_probe,
    device,
    estimated,
    limit_recorded,
    mfu,
    out_of_memory,
    parity,
    resumes,
    trains,
    trains_on_every_gpu,
    under_limit,
)
from fsdp_exp.commands.experiment import compose_config
from fsdp_exp.driver.plan import prepare
from fsdp_exp.metrics.summary import Summary
from tests.conftest import run_cli

GPU = setup_for("cuda", gpus=2)
ONE_GPU = setup_for("cuda", gpus=1)
CPU = setup_for("cpu", gpus=0)
LOSSES = {1: 2.30, 2: 2.10, 3: 1.90, 4: 1.70, 5: 1.55, 6: 1.40}
WEIGHTS = {"head.weight": torch.ones(4, 4), "head.bias": torch.arange(4.0)}


def result(status: str = "ok", losses: dict | None = None, weights: dict | None = None, records: list | None = None,
           error: str = "", **summary) -> RunResult:
    losses = dict(LOSSES if losses is None else losses)
    records = records if records is not None else [{"step": s, "loss": v} for s, v in losses.items()]
    full = {"status": status, "world_size": 2, "device": "cuda", "choices": {"precision": "fp32"}, **summary}
    if error:
        full["error"] = error
    return RunResult(Path("run"), Summary.of(full), losses, records, error, WEIGHTS if weights is None else weights)


# ---- without a GPU ----------------------------------------------------------------------------

def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    done = run_cli(cwd=tmp_path, module=("-m", "fsdp_exp.check_gpu"), extra_env={"CUDA_VISIBLE_DEVICES": ""},
                   timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "no GPU" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


# ---- the command lines --------------------------------------------------------------------------

def fsdp_exp_args(line: list[str]) -> list[str]:
    """A run's command line after `-m fsdp_exp`: what fsdp_exp composes."""
    return line[line.index("fsdp_exp") + 1:]


@pytest.mark.parametrize("setup", [GPU, pytest.param(CPU, marks=pytest.mark.slow)], ids=["cuda", "cpu"])
def test_every_run_composes_and_passes_the_plan(setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `python -m fsdp_exp` checks before it starts a rank, for each run of the check:
    on a (pretended) 2-GPU machine with 80 GB each, and on CPU."""
    monkeypatch.setattr(memory, "device_memory_gb", lambda device: 80.0)
    gpus = 2 if setup.device == "cuda" else 0
    made = {"max_batch": RunResult(tmp_path, Summary(status="ok", max_batch_size=3), {}, [])}
    for name, overrides in runs(setup, tmp_path).items():
        line = command(overrides(made) if callable(overrides) else overrides, tmp_path / name)
        world = None
        if name == "torchrun":  # each process one rank: torchrun's world, as the ranks' plan takes it
            assert line[1:6] == ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={setup.ranks}", "-m"]
            world = setup.ranks
        assert line[line.index("fsdp_exp") - 1] == "-m" and line[-1] == f"hydra.run.dir={tmp_path / name}"
        plan = prepare(compose_config(fsdp_exp_args(line)), gpus, world_size=world)
        assert plan.exp.device.value == setup.device, name
        assert plan.exp.wandb.mode.value == "disabled", name
        assert plan.nproc == (1 if name == "none" else setup.ranks), name


def test_the_runs_compared_differ_only_where_the_check_says() -> None:
    plan = runs(GPU, Path("/tmp/w"))
    for sharded in ("full", "grad_op", "ddp"):
        assert set(plan[sharded]) ^ set(plan["none"]) == {f"sharding={sharded}", "sharding=none"}
    assert "launcher.nproc_per_node=2" in plan["none"]  # the unsharded run stands in for both ranks
    assert "precision.tf32=false" in plan["full"]  # fp32 parity in fp32, not TF32
    # The resumed run is the uninterrupted one, resumed from the first half's checkpoint.
    assert set(plan["resumed"]) - set(plan["full"]) == {"checkpoint=dcp", "checkpoint.dir=/tmp/w/checkpoints",
                                                         "resume=auto"}
    assert f"train.steps={PARITY_STEPS // 2}" in plan["first_half"]
    # the batch that runs out under the limit trains without it: the cap, not the card, stops it
    assert "memory.limit_gb=8" in plan["oom"] and "train.batch_size=7" in plan["oom"] and GPU.cap_proof
    assert set(plan["oom"]) - set(plan["cap_free"]) == {"memory.limit_gb=8"}
    assert "cap_free" not in runs(CPU, Path("/w")) and "cap_free" not in runs(setup_for("cuda", 1, memory_gb=12), Path("/w"))
    assert not any(o.startswith("metrics.peak_tflops") for o in plan["gpt"])  # the table's peak
    assert "metrics.peak_tflops=400" in runs(setup_for("cuda", 2, peak_tflops=400), Path("/w"))["gpt"]
    assert "launcher.nproc_per_node=1" in runs(ONE_GPU, Path("/w"))["full"]


def test_a_development_run_on_cpu_names_its_peak_as_configured() -> None:
    assert (CPU.device, CPU.ranks) == ("cpu", 2)
    assert "metrics.peak_tflops=1" in runs(CPU, Path("/w"))["gpt"]


# ---- the judges --------------------------------------------------------------------------------

def test_parity_passes_within_the_tolerance_and_says_how_close() -> None:
    close = {s: v * (1 + 1e-6) for s, v in LOSSES.items()}
    passed, detail = parity(result(), result(losses=close), GPU.tolerance)
    assert passed and detail.startswith("6 steps on 2 rank(s): losses within 1.0e-06")


def test_parity_on_one_gpu_says_nothing_is_sharded() -> None:
    passed, detail = parity(result(world_size=1), result(world_size=1), GPU.tolerance)
    assert passed and "1 rank: nothing is sharded" in detail


@pytest.mark.parametrize("run, why", [
    (result(losses={**LOSSES, 2: 2.10 * 1.5}), "step 2: loss 3.15, the reference 2.1"),  # a mis-reduced gradient
    (result(losses={**LOSSES, 3: math.nan}), "step 3: loss nan"),
    (result(losses={s: v for s, v in LOSSES.items() if s != 6}), "no loss at step 6"),
    (result(weights={**WEIGHTS, "head.bias": WEIGHTS["head.bias"] * 1.01}), "weight head.bias differs by 1.0e-02"),
    (result(weights={"head.weight": WEIGHTS["head.weight"]}), "other names"),
    (result("failed", error="rank 1 failed: RuntimeError: NCCL error"), "failed: rank 1 failed: RuntimeError: NCCL"),
])
def test_parity_fails_and_says_where(run: RunResult, why: str) -> None:
    passed, detail = parity(result(), run, GPU.tolerance)
    assert not passed and why in detail


def test_parity_needs_a_reference_that_learns() -> None:
    passed, detail = parity(result(losses={1: 2.3, 2: 2.4}), result(losses={1: 2.3, 2: 2.4}), 1e-4)
    assert not passed and "did not learn" in detail


def test_mixed_precision_trains_when_its_losses_are_finite_and_fall() -> None:
    fp16 = {"choices": {"precision": "fp16"}}
    scaled = [{"step": s, "loss": v, "loss_scale": 65536.0} for s, v in LOSSES.items()]
    assert trains(result(**fp16, records=scaled)) == (True, "loss 2.3000 at step 1, 1.4000 at step 6; loss scale 65536")
    assert trains(result(choices={"precision": "bf16"}))[0]
    assert trains(result(**fp16))[1].endswith("no usable loss scale recorded (none)")
    assert not trains(result(**fp16, records=[{**r, "loss_scale": math.inf} for r in scaled]))[0]
    assert trains(result(losses={1: 2.3, 2: math.nan}))[1].startswith("a loss is not finite")
    assert trains(result(losses={1: 2.3, 2: 2.5})) == (False, "did not learn: loss 2.3000 at step 1, 2.5000 at step 2")


def test_fp16_offload_passes_only_on_every_visible_gpu_and_one_gpu_says_it_cannot_show_the_agreement() -> None:
    fp16 = {"choices": {"precision": "fp16"},
            "records": [{"step": s, "loss": v, "loss_scale": 65536.0} for s, v in LOSSES.items()]}
    assert trains_on_every_gpu(result(**fp16), GPU.ranks) == (
        True, "loss 2.3000 at step 1, 1.4000 at step 6; loss scale 65536")
    passed, detail = trains_on_every_gpu(result(**fp16, world_size=1), GPU.ranks)
    assert not passed and detail.startswith("ran on 1 rank(s), not the 2 GPUs visible: loss 2.3000")
    passed, detail = trains_on_every_gpu(result(**fp16, world_size=1), ONE_GPU.ranks)
    assert passed and detail.endswith("(1 rank: the ranks' agreement on inf/NaN needs 2 GPUs)")
    assert not trains_on_every_gpu(result(**fp16, losses={1: 2.3, 2: 2.5}), GPU.ranks)[0]


def test_a_resume_matches_the_uninterrupted_run_after_the_checkpoint() -> None:
    half = result(losses={s: v for s, v in LOSSES.items() if s <= 3}, steps=3)
    resumed = result(losses={s: v for s, v in LOSSES.items() if s > 3}, steps=6, resumed_from_step=3)
    assert resumes(result(), half, resumed, 1e-4) == (
        True, "saved at step 3, resumed: steps 4-6 within 0.0e+00 of the uninterrupted run")
    fresh_start = result(steps=6)
    assert resumes(result(), half, fresh_start, 1e-4)[1] == "resumed from step None, not 3"
    wrong_data = result(losses={**resumed.losses, 4: 1.9}, steps=6, resumed_from_step=3)
    assert resumes(result(), half, wrong_data, 1e-4)[1].startswith("step 4: loss 1.9, the reference 1.7")
    assert resumes(result(), result("failed", error="no .metadata"), resumed, 1e-4)[1] == "first half: failed: no .metadata"


GPT = {"flops_per_step": 1.02e13, "flops_per_step_analytic": 1.0e13, "flops_source": "counted", "mfu": 0.41,
       "peak_tflops": 989.5, "peak_tflops_source": "H100 SXM, bf16",
       "environment": {"device": "NVIDIA H100 80GB HBM3", "device_count": 8, "device_memory_gb": 79.2,
                       "torch": "2.14.1", "cuda": "13.0", "nccl": "2.27.3", "device_seen_by": "rank 0"}}


def test_mfu_within_0_and_1_and_the_counted_flops_within_10_percent_of_6n() -> None:
    assert mfu(result(**GPT)) == (True, "MFU 41.0% of 989.5 TFLOP/s (H100 SXM, bf16); counted FLOPs 1.020 x 6N")
    assert not mfu(result(**{**GPT, "mfu": 1.3}))[0]
    assert not mfu(result(**{**GPT, "mfu": 0.0}))[0]
    assert not mfu(result(**{**GPT, "flops_per_step": 1.2e13}))[0]
    # An attention kernel the counter missed: MFU used 6N, and the count it made is what is judged.
    missed = {**GPT, "flops_source": "analytic", "flops_per_step": 1.0e13, "flops_per_step_counted": 0.8e13}
    assert mfu(result(**missed)) == (False, "MFU 41.0% of 989.5 TFLOP/s (H100 SXM, bf16); counted FLOPs 0.800 x 6N")


def test_a_gpu_without_a_known_peak_fails_the_mfu_check_and_names_the_option() -> None:
    unknown = {**GPT, "mfu": None, "peak_tflops": None, "peak_tflops_source": None,
               "environment": {**GPT["environment"], "device": "NVIDIA GeForce RTX 4090"}}
    passed, detail = mfu(result(**unknown))
    assert not passed and "NVIDIA GeForce RTX 4090" in detail and "--peak-tflops" in detail


def test_the_estimate_row_passes_within_10_percent_and_prints_both_figures_either_way() -> None:
    run = result(peak_mem_gb=10.0, peak_reserved_gb=12.0, device_used_gb=14.0, estimated_device_used_gb=13.1)
    ok, detail = estimated(run, result(peak_mem_gb=9.5, peak_reserved_gb=12.6))
    assert ok and detail == ("peak: estimated 9.50 GB, measured 10.00 GB (-5%); "
                             "reserved: estimated 12.60 GB, measured 12.00 GB (+5%)")
    ok, detail = estimated(run, result(peak_mem_gb=9.5, peak_reserved_gb=10.0))  # reserved 17% low
    assert not ok and "reserved: estimated 10.00 GB, measured 12.00 GB (-17%)" in detail
    on_cpu = result(device="cpu", peak_mem_gb=1.0)
    assert estimated(on_cpu, result(device="cpu", peak_mem_gb=0.65)) == \
        (True, "peak: estimated 0.65 GB, measured 1.00 GB (-35%) (on CPU not judged)")
    assert estimated(run, result(status="failed", error="boom"))[1].startswith("estimate: failed: boom")
    # what the whole device held (mem_get_info) beside its estimate: shown, not judged
    whole = run
    ok, detail = estimated(whole, result(peak_mem_gb=9.5, peak_reserved_gb=12.6, device_used_gb=13.1))
    assert ok and detail.endswith("; device (not judged): estimated 13.10 GB, measured 14.00 GB (-6%)")
    assert estimated(whole, result(peak_mem_gb=9.5, peak_reserved_gb=12.6, device_used_gb=9.0))[0]
    # a GPU run whose own check did not take its GPU path fails the row, and says why
    untraced = result(peak_mem_gb=10.0, peak_reserved_gb=12.0, estimate_failed="task=estimate could not trace")
    assert estimated(untraced, result(peak_mem_gb=9.5, peak_reserved_gb=12.6)) == (
        False, "the run's summary.json has no device_used_gb or estimated_device_used_gb (task=estimate could not trace)")


def test_peak_memory_is_judged_as_the_limit_counts_it() -> None:
    gpu = {"peak_mem_gb": 2.9, "peak_reserved_gb": 3.4}
    assert under_limit(result(**gpu), 8.0) == (True, "peak 3.400 GB (reserved) under memory.limit_gb=8")
    assert not under_limit(result(**{**gpu, "peak_reserved_gb": 8.2}), 8.0)[0]
    cpu = {"peak_mem_gb": 1.7, "peak_under_limit_gb": 1.2, "limit_gb": 1.5}
    assert under_limit(result(**cpu), 1.5) == (True, "peak 1.200 GB (as the limit counts it) under memory.limit_gb=1.5")
    assert under_limit(result("oom", error="rank 0 failed: OutOfMemory"), 8.0) == (
        False, "oom: rank 0 failed: OutOfMemory")


def test_the_limit_and_the_peak_it_caps_are_in_the_summary() -> None:
    gpu = {"peak_reserved_gb": 3.4, "limit_gb": 8.0, "peak_under_limit_gb": 3.4, "peak_under_limit_gb_per_rank": [3.2, 3.4]}
    assert limit_recorded(result(**gpu), 8.0) == (
        True, "limit_gb 8, peak_under_limit_gb 3.400 GB (per rank 3.200, 3.400)")
    assert limit_recorded(result(peak_reserved_gb=3.4), 8.0) == (  # what a GPU run recorded before
        False, "summary.json: limit_gb None, peak_under_limit_gb None, 0 rank(s) of 2 in peak_under_limit_gb_per_rank")
    assert not limit_recorded(result(**{**gpu, "peak_under_limit_gb": 2.9}), 8.0)[0]  # not the reserved peak
    cpu = {"device": "cpu", "peak_mem_gb": 1.7, "limit_gb": 1.5, "peak_under_limit_gb": 1.2,
           "peak_under_limit_gb_per_rank": [1.1, 1.2]}
    assert limit_recorded(result(**cpu), 1.5)[0]


def probe_run(tmp_path: Path, step_time_s: float, wall_s: float) -> RunResult:
    probe = tmp_path / "run" / "probes" / "01_b1"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "summary.json").write_text(json.dumps({"status": "ok", "batch_size": 1, "steps": 3,
                                                    "step_time_s": step_time_s, "wall_s": wall_s}))
    return RunResult(tmp_path / "run", Summary(status="ok"), {}, [])


def test_a_compiled_probe_passes_when_compiling_is_in_its_warmup(tmp_path: Path) -> None:
    assert compiled_probe(probe_run(tmp_path / "a", 0.12, 61.0)) == (
        True, "batch 1: 0.120 s a step after 3 steps in 61 s (compiling in the warm-up)")
    assert compiled_probe(probe_run(tmp_path / "b", 24.0, 61.0)) == (
        False, "the compiler is in the measured steps: batch 1: 24.000 s a step after 3 steps in 61 s")
    assert compiled_probe(RunResult(tmp_path / "c", Summary(status="failed"), {}, [], "rank 0 failed")) == (
        False, "failed: rank 0 failed")


def test_a_forced_oom_passes_only_as_status_oom() -> None:
    error = "rank 1 failed: OutOfMemory: ran out of memory under memory.limit_gb=8: CUDA out of memory."
    assert out_of_memory(result("oom", error=error)) == (True, f"status oom: {error}")
    assert not out_of_memory(result("failed", error="rank 0 failed: RuntimeError: NCCL error"))[0]
    assert not out_of_memory(result())[0]
    assert out_of_memory(RunResult(Path("r"), None, {}, [], "fsdp_exp: train.batch_size=64: larger than ..."))[1] == (
        "status no summary.json: fsdp_exp: train.batch_size=64: larger than ...")


def test_the_device_row_is_rank_0s_device_and_the_peak_it_used() -> None:
    passed, detail = device(result(**GPT), "cuda")
    assert passed and detail == ("cuda: NVIDIA H100 80GB HBM3 (x8, 79 GB), seen by rank 0; torch 2.14.1, cuda 13.0, "
                                 "nccl 2.27.3; peak 989.5 TFLOP/s (H100 SXM, bf16)")
    assert not device(result(**{**GPT, "device": "cpu"}), "cuda")[0]
    assert not device(result(**{**GPT, "environment": {**GPT["environment"], "device_seen_by": "driver"}}), "cuda")[0]


# ---- reading a run, running the checks, the table -------------------------------------------

def test_a_run_is_read_from_its_files_and_the_last_record_of_a_step_counts(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"status": "ok", "steps": 6, "resumed_from_step": 3}))
    lines = [{"step": 3, "loss": 2.0, "lr": 0.05}, {"event": "resumed", "step": 3, "checkpoint": "c"},
             {"step": 3, "loss": 1.9}, {"step": 4, "loss": 1.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = read_run(tmp_path)
    assert run.losses == {3: 1.9, 4: 1.8} and run.weights is None and run.error == ""
    assert read_run(tmp_path / "missing", "Traceback ...\nfsdp_exp: sharding=zero3: no such option\n").error == (
        "fsdp_exp: sharding=zero3: no such option")


def test_a_run_past_its_time_is_ended_and_fails_its_check(tmp_path: Path) -> None:
    run = run_fsdp_exp(["device=cpu", "wandb.mode=disabled"], tmp_path / "slow", timeout_s=0.5)
    assert run.summary is None and run.error == "still running after 0.5 s, ended"
    assert out_of_memory(run) == (False, "status no summary.json: still running after 0.5 s, ended")


def passing_runs(tmp_path: Path, ran: list[str]) -> Callable[[list[str], Path], RunResult]:
    """Runs as a GPU that passes every check would report them, by name (check_gpu's and
    the GPU session's, tests/test_gpu_session.py); each name run is added to `ran`."""

    def fake_run(overrides: list[str], out: Path) -> RunResult:
        ran.append(out.name)
        if out.name == "oom":
            return result("oom", error="rank 0 failed: OutOfMemory: ...")
        if out.name in ("first_half", "pinned_first_half"):
            return result(steps=3)
        if out.name in ("resumed", "pinned_resumed"):
            return result(steps=6, resumed_from_step=3)
        if out.name == "under_limit":
            return result(peak_reserved_gb=3.0, limit_gb=8.0, peak_under_limit_gb=3.0,
                          peak_under_limit_gb_per_rank=[2.9, 3.0])
        if out.name == "max_batch":
            return result(max_batch_size=5, bounded_by="oom")
        if out.name == "max_batch_device":
            assert not any(o.startswith("memory.limit_gb") for o in overrides)
            return result(max_batch_size=40, bounded_by="noise", limit_gb=79.1)
        if out.name == "at_max_batch":
            assert "train.batch_size=5" in overrides
            return result(peak_reserved_gb=7.5)
        if out.name == "compiled_probe":
            return probe_run(tmp_path, step_time_s=0.1, wall_s=60.0)
        if out.name.startswith("estimate_"):
            return result(peak_mem_gb=10.2, peak_reserved_gb=12.5)
        if out.name == "cap_free":
            assert not any(o.startswith("memory.limit_gb") for o in overrides)
            return result(peak_reserved_gb=11.5)
        if out.name == "tune":
            return result(winner="sharding=full", winner_confirmed=True, batch_size=3, samples_per_s=40.0, setups=2,
                          probes=6)
        return result(**GPT, peak_mem_gb=10.0, peak_reserved_gb=12.0, device_used_gb=14.0, estimated_device_used_gb=13.1,
                      tflops_per_device=300.0)

    return fake_run


def test_the_checks_print_one_row_each_and_a_run_two_checks_read_runs_once(tmp_path: Path) -> None:
    ran: list[str] = []
    fake_run = passing_runs(tmp_path, ran)

    traced: dict[str, bool] = {}

    def own_estimate_noted(overrides: list[str], out: Path) -> RunResult:
        traced[out.name] = "memory.estimate=false" not in overrides
        return fake_run(overrides, out)

    lines: list[str] = []
    assert check_all(GPU, tmp_path, run=own_estimate_noted, out=lines.append)
    assert sorted(ran) == sorted(runs(GPU, tmp_path)) and ran.count("gpt") == 1
    # a run traces its own estimate only where a check reads it against task=estimate's
    assert {name for name, on in traced.items() if on} == {"gpt", "estimate_gpt"}
    assert lines[0] == TABLE_HEAD
    assert [line.split(" | ")[:2] for line in lines[1:]] == [["| " + c.name, "pass"] for c in checks(GPU)]

    def broken_ddp(overrides: list[str], out: Path) -> RunResult:
        return result("failed", error="rank 1 failed: boom") if out.name == "ddp" else fake_run(overrides, out)

    lines.clear()
    assert not check_all(GPU, tmp_path, run=broken_ddp, out=lines.append)
    assert "| parity: ddp = none | fail | failed: rank 1 failed: boom |" in lines[3]

    def odd_summary(overrides: list[str], out: Path) -> RunResult:
        return result(mfu=0.5, peak_tflops=None) if out.name == "gpt" else fake_run(overrides, out)

    lines.clear()
    assert not check_all(GPU, tmp_path, run=odd_summary, out=lines.append)
    assert "| MFU and FLOPs | fail | could not judge the run: TypeError" in next(
        line for line in lines if line.startswith("| MFU and FLOPs"))


def test_a_table_cell_cannot_break_the_row() -> None:
    assert table_row("a", "b|c", "d\ne", 3) == "| a | b/c | d e | 3 |"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_check_passes_on_two_cpu_ranks(tmp_path: Path) -> None:
    """The whole check end to end on CPU (`--device cpu`, gloo): the plumbing of every check
    against real runs. About 12 runs."""
    done = run_cli("--device", "cpu", "--keep", str(tmp_path / "runs"), cwd=tmp_path,
                   module=("-m", "fsdp_exp.check_gpu"), timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "CPU, 2 gloo ranks: a development run" in lines[0]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| check", "| ---"))]
    assert len(rows) == len(checks(setup_for("cpu", 0))) and all(" | pass | " in row for row in rows), rows


@pytest.mark.slow  # test_every_run_composes_and_passes_the_plan prepares every run for 80 GB in the fast suite
def test_every_runs_limit_on_a_small_card_is_one_the_plan_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an 8 GB card, every run of the check composes and its plan accepts its limit (a
    limit above the card is refused)."""
    monkeypatch.setattr(memory, "device_memory_gb", lambda device: 8.0)
    made = {"max_batch": RunResult(tmp_path, Summary(status="ok", max_batch_size=3), {}, [])}
    for name, overrides in runs(setup_for("cuda", gpus=2, memory_gb=8), tmp_path).items():
        overrides = overrides(made) if callable(overrides) else overrides
        prepare(compose_config(fsdp_exp_args(command(overrides, tmp_path / name))), 2)


@pytest.mark.parametrize("memory_gb", [80, 8, 5])
def test_the_checks_fit_the_gpu_they_run_on(memory_gb: float, tmp_path: Path) -> None:
    """On a card or MIG slice of any size, every run's limit is at most the rank's share of
    the card, the run meant to fit leaves room under it, and the MFU run fits the card, by
    task=estimate's figures for GPT-2 small (GPT2_SMALL_*_GB)."""
    from fsdp_exp.commands.gpu_checks import (
        GPT2_SMALL_BF16_GB,
        GPT2_SMALL_FP32_GB,
        OUTSIDE_ALLOCATOR_GB,
        gpt2_small_fp32_gb,
    )

    setup = setup_for("cuda", gpus=2, memory_gb=memory_gb)
    plan = runs(setup, tmp_path)
    assert setup.limit_gb <= memory_gb / 2
    if "model.size=small" in plan["under_limit"]:
        assert GPT2_SMALL_FP32_GB[setup.limit_batch] <= 0.875 * setup.limit_gb
    if "data.seq_len=1024" in plan["gpt"]:
        assert GPT2_SMALL_BF16_GB[setup.mfu_batch] + OUTSIDE_ALLOCATOR_GB <= 0.9 * memory_gb
    assert setup.mfu_batch >= 1 and setup.limit_batch >= 1 and setup.oom_batch > 3 * setup.limit_batch
    if setup.cap_proof:  # the oom run's batch needs a quarter more than the limit, and fits the card without it
        need = gpt2_small_fp32_gb(setup.oom_batch)
        assert 1.25 * setup.limit_gb < need <= 0.8 * memory_gb - OUTSIDE_ALLOCATOR_GB


def test_the_cap_is_proven_by_a_batch_that_trains_without_it_and_runs_out_under_it() -> None:
    """reserved <= limit cannot fail (the allocator enforces it): the row that proves the cap
    needs a run that must hit it."""
    from fsdp_exp.commands.gpu_judges import cap_holds

    capped, free = result("oom", error="rank 0 failed: OutOfMemory: ..."), result(peak_reserved_gb=11.5)
    assert cap_holds(capped, free, 8.0) == (True, "batch without the limit: ok, 11.50 GB reserved; under "
                                                  "memory.limit_gb=8: oom")
    assert not cap_holds(result(peak_reserved_gb=7.9), free, 8.0)[0]  # the cap did not stop it
    assert not cap_holds(capped, result(peak_reserved_gb=7.5), 8.0)[0]  # the batch fits the limit anyway
    assert not cap_holds(capped, result("oom", error="rank 0 failed: OutOfMemory"), 8.0)[0]  # the card stopped it


def test_a_search_without_a_limit_is_a_gpus_row_whose_limit_is_the_devices_memory() -> None:
    from fsdp_exp.commands.gpu_judges import device_memory_search

    assert "max_batch_device" in runs(GPU, Path("/w")) and "max_batch_device" not in runs(CPU, Path("/w"))
    assert ("max_batch_device",) in [c.runs for c in checks(GPU)]
    assert ("max_batch_device",) not in [c.runs for c in checks(CPU)]
    found = result(max_batch_size=40, bounded_by="noise", limit_gb=77.9, environment={"device_memory_gb": 79.2})
    assert device_memory_search(found) == (True, "max batch 40 (bounded by noise) under the 77.9 GB the device "
                                                 "leaves its allocator")
    assert not device_memory_search(result(max_batch_size=40, bounded_by="noise", limit_gb=8.0,
                                           environment={"device_memory_gb": 79.2}))[0]  # not the device's memory
    assert not device_memory_search(result(max_batch_size=40, bounded_by="noise", limit_gb=79.2,
                                           environment={"device_memory_gb": 79.2}))[0]  # the context's left in
    assert not device_memory_search(result(max_batch_size=40, bounded_by="search_up_to", limit_gb=79.1))[0]
    assert not device_memory_search(result("failed", error="rank 0 failed: TypeError: ..."))[0]


def test_the_search_answer_check_trains_at_the_answer_and_needs_a_memory_bound() -> None:
    from fsdp_exp.commands.gpu_checks import at_max_batch
    from fsdp_exp.commands.gpu_judges import answer_trains

    search = result(max_batch_size=6, bounded_by="oom")
    assert at_max_batch(search, ["model=gpt"], 8.0) == ["model=gpt", "memory.limit_gb=8", "train.batch_size=6",
                                                       "train.steps=3", "metrics.warmup_steps=1"]
    assert at_max_batch(result("failed"), [], 8.0) is None and at_max_batch(result(max_batch_size=0), [], 8.0) is None
    assert answer_trains(search, result(peak_reserved_gb=7.9), 8.0) == (
        True, "max batch 6 (bounded by oom); trained at it: peak 7.900 GB (reserved) under memory.limit_gb=8")
    assert not answer_trains(search, result("oom", error="rank 0 failed: OutOfMemory"), 8.0)[0]
    assert answer_trains(result(max_batch_size=6, bounded_by="noise"), result(peak_reserved_gb=7.0), 8.0)[0]
    assert not answer_trains(result(max_batch_size=6, bounded_by="search_up_to"), result(peak_reserved_gb=7.0), 8.0)[0]


def test_a_meta_build_must_train_as_the_plain_build() -> None:
    from fsdp_exp.commands.gpu_judges import same_training

    assert same_training(result(), result(), 1e-4)[0]
    assert same_training(result(), result(losses={**LOSSES, 1: 2.5}), 1e-4) == (
        False, "step 1: loss 2.5, the reference 2.3 (tolerance 0.0001)")
    assert same_training(result(), result("failed", error="Expected all tensors to be on the same device"),
                         1e-4)[1] == "failed: Expected all tensors to be on the same device"
