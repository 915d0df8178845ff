"""task=estimate: the breakdown of a model small enough to count by hand, and the task end
to end for every sharding option."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.errors import ConfigError
from fsdp_exp.estimate.breakdown import GB, attention_workspace, estimate_batch
from fsdp_exp.estimate.allocator import cuda_block
from fsdp_exp.estimate.trace import for_tracing, trace
from tests.conftest import REPO, read_json, refused_here, run_cli

WIDTH, DEPTH, FP32, INT64 = 256, 4, 4, 8
LAYER = WIDTH * WIDTH * FP32  # one Linear's weight: 262,144 bytes


class Vectors(Dataset):
    """WIDTH features, a class index among WIDTH classes."""

    def __init__(self, num_samples: int = 64):
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(WIDTH), torch.tensor(index % WIDTH)


def linear_stack() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])


class ReadsItsInput(nn.Module):
    """A forward that branches on a value: fake tensors have none, so it cannot be traced."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum().item() >= 0 else -self.linear(x)


TOKENS, HEAD_DIM = 64, 4  # one head over 64 tokens: the WIDTH features of a sample


class SelfAttention(nn.Module):
    """Causal self-attention with attention dropout, as GPT-2 has it (0.1)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HEAD_DIM, HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x.view(x.shape[0], 1, TOKENS, HEAD_DIM))
        return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True).flatten(1)


STACK = ["model=custom", "model._target_=tests.test_estimate.linear_stack", "model.blocks=[torch.nn.Linear]",
         "data=custom", "data._target_=tests.test_estimate.Vectors", "device=cpu", "wandb.mode=disabled"]


def traced(*overrides: str, batch_sizes: list[int]) -> tuple:
    plan = prepare(compose_checked([*STACK, *overrides]), 0)
    return plan.exp, trace(plan.exp, 2, batch_sizes, on_gpu=False)


def in_bytes(parts: dict[str, float]) -> dict[str, int]:
    return {k: round(v * GB) for k, v in parts.items() if k != "baseline"}


def test_full_sharding_backward_peak_counted_by_hand():
    """4 Linear(256, 256) units, `full` on 2 fake ranks, batch 64: the peak falls in backward
    (at batch 16 the first optimizer step's temporaries are larger)."""
    exp, result = traced("sharding=full", batch_sizes=[64])
    found = estimate_batch(result.steps[0], result, on_gpu=False, offload=False, baseline_gb=0,
                           builds_whole_model=True)
    assert found.phase == "backward"
    batch_row = 64 * WIDTH * FP32  # one layer's input (or its gradient) for the batch: 65,536 bytes
    expected = {
        # each rank keeps half of every weight
        "parameters": DEPTH * LAYER // 2,  # 524,288
        # AdamW's two moments of this rank's halves, and a 4-byte step count per parameter
        "optimizer_state": 2 * DEPTH * LAYER // 2 + DEPTH * 4,  # 1,048,592
        # backward has reached the second layer: the two layers above it have their sharded gradients
        "gradients": 2 * LAYER // 2,  # 262,144
        # the inputs the three lower layers saved for their weight gradients, the targets,
        # three scalars (the loss, its gradient, the step's summed loss), and the two that weigh
        # this rank's loss (the targets it counts, and its share of the ranks', trainer.weighed)
        "activations": 3 * batch_row + 64 * INT64 + 3 * FP32 + INT64 + FP32,  # 197,144
        # the layer's whole weight gradient, and the gradients of its input and output
        "temporaries": LAYER + 2 * batch_row,  # 393,216
        # the layer's gathered weight, the next layer's all-gather buffer (prefetched), and
        # the whole gradient waiting in its reduce-scatter buffer
        "unsharded_and_buffers": 3 * LAYER,  # 786,432
    }
    assert in_bytes(found.breakdown_gb) == expected
    # and what the math libraries keep outside malloc, measured by replaying the step's ops (none
    # where this process already ran them: it depends on the tests before)
    library = result.steps[0].library.data_bytes if result.steps[0].library is not None else 0
    assert found.step_peak_gb * GB == pytest.approx(sum(expected.values()) + library)


def test_gradient_accumulation_under_full_sharding_is_traced_a_micro_batch_at_a_time():
    """train.grad_accum=2 runs each module's forward twice a step, which torch's FSDP
    tracker refuses unless its per-module stats start anew: batch 64 in two micro-batches
    holds about the activations of 32 (one layer's input of 32 more, the next micro-batch's),
    not those of 64."""
    _, micro = traced("sharding=full", batch_sizes=[32])
    _, halves = traced("sharding=full", "train.grad_accum=2", batch_sizes=[64])
    _, whole = traced("sharding=full", batch_sizes=[64])
    one, two, all_64 = (in_bytes(estimate_batch(r.steps[0], r, False, False, 0, True).breakdown_gb)
                        for r in (micro, halves, whole))
    assert one["activations"] <= two["activations"] <= one["activations"] + 32 * WIDTH * FP32
    assert two["activations"] < 0.75 * all_64["activations"] and two["parameters"] == one["parameters"]


def test_ddp_counts_a_whole_replica_and_its_buckets():
    exp, result = traced("sharding=ddp", batch_sizes=[16])
    found = estimate_batch(result.steps[0], result, on_gpu=False, offload=False, baseline_gb=0,
                           builds_whole_model=True)
    assert found.phase == "optimizer_step"
    parts = in_bytes(found.breakdown_gb)
    assert parts["parameters"] == DEPTH * LAYER  # every rank holds the whole model
    assert parts["gradients"] == DEPTH * LAYER
    assert parts["optimizer_state"] == 2 * DEPTH * LAYER + DEPTH * 4
    # DDP's buckets: a flat copy of every gradient, there from construction on
    assert parts["unsharded_and_buffers"] == DEPTH * LAYER
    # AdamW's per-parameter loop on the CPU: at most three weight-sized temporaries at once
    assert parts["temporaries"] <= 3 * LAYER + 16 * WIDTH * FP32 * 2


def test_the_step_grows_with_the_batch_and_the_build_is_the_whole_model():
    exp, result = traced("sharding=ddp", batch_sizes=[16, 64])
    small, large = (estimate_batch(s, result, False, False, 0, True) for s in result.steps)
    assert large.breakdown_gb["parameters"] == small.breakdown_gb["parameters"]
    assert large.step_peak_gb > small.step_peak_gb
    assert result.build_bytes == DEPTH * LAYER  # every rank builds the whole model first
    assert result.params == DEPTH * WIDTH * WIDTH


def test_attention_for_a_gpu_keeps_no_tokens_by_tokens_matrix():
    """With dropout the CPU's attention falls back to the math kernel, which keeps the
    64 x 64 attention matrix of each sample (and more); a GPU's flash kernel keeps none, so
    the trace for a GPU runs it as the CPU's flash kernel and adds the GPU kernel's workspace."""
    attention = [o.replace("tests.test_estimate.linear_stack", "tests.test_estimate.SelfAttention") for o in STACK]
    plan = prepare(compose_checked(attention), 0)
    batch, matrix = 64, 64 * TOKENS * TOKENS * FP32  # one fp32 attention matrix per sample: 1 MiB
    on_cpu, on_gpu = (trace(plan.exp, 2, [batch], on_gpu=gpu) for gpu in (False, True))
    cpu_parts, gpu_parts = (estimate_batch(t.steps[0], t, gpu, False, 0, False).breakdown_gb
                            for t, gpu in ((on_cpu, False), (on_gpu, True)))
    assert on_cpu.steps[0].attention == [] and on_gpu.steps[0].attention == [(batch, 1, TOKENS, HEAD_DIM)]
    assert (cpu_parts["activations"] - gpu_parts["activations"]) * GB >= matrix
    assert gpu_parts["activations"] * GB < matrix / 2  # queries, outputs and row sums: a few KB a sample


@pytest.mark.parametrize(("on_gpu", "changed"), [(False, True), (True, False)])
def test_the_trace_sets_the_environment_of_the_run_it_predicts(monkeypatch, on_gpu: bool, changed: bool):
    """The tracing process measures as the run it predicts: a CPU run that an estimate
    measures turns wandb's error reporting off (fsdp_exp.memory.MEASURING_ENVIRONMENT); a GPU
    run, traced on fake tensors here as on a GPU machine, keeps the user's environment."""
    import multiprocessing

    from fsdp_exp.estimate.predict import _traced
    from fsdp_exp.memory import MEASURING_ENVIRONMENT

    for key in MEASURING_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    plan = prepare(compose_checked(STACK), 0)
    received, sent = multiprocessing.Pipe(duplex=False)
    _traced(sent, plan.exp, 2, [4], on_gpu, None, None, {}, (), None)
    assert received.recv()[0] is True  # traced
    assert os.environ.get("WANDB_ERROR_REPORTING") == ("false" if changed else None)


def test_gpu_side_rounds_blocks_offloads_state_and_adds_attention():
    assert cuda_block(1) == 512 and cuda_block(513) == 1024 and cuda_block(0) == 0
    # batch 2, 12 heads, 128 tokens, 64 per head: an fp32 copy of the query and a row sum
    assert attention_workspace([(2, 12, 128, 64), (1, 1, 1, 1)]) == 4 * (2 * 12 * 128 * 64 + 2 * 12 * 128)
    exp, result = traced("sharding=full", "offload=true", batch_sizes=[16])
    on_gpu = estimate_batch(result.steps[0], result, on_gpu=True, offload=True, baseline_gb=0.5,
                            builds_whole_model=False)
    # on the GPU the sharded parameters, gradients and optimizer state are in host memory
    assert on_gpu.breakdown_gb["parameters"] == on_gpu.breakdown_gb["optimizer_state"] == 0
    assert on_gpu.offloaded_gb * GB >= DEPTH * LAYER // 2 * 3
    assert on_gpu.breakdown_gb["baseline"] == 0.5
    on_cpu = estimate_batch(result.steps[0], result, False, True, 0.5, False)
    assert on_gpu.step_peak_gb < on_cpu.step_peak_gb


SLOW = pytest.mark.slow  # the same path as full (DDP's counts are checked by hand above): make test-slow


@pytest.mark.parametrize("sharding", [["sharding=full"], pytest.param(["sharding=grad_op"], marks=SLOW),
                                      pytest.param(["sharding=ddp"], marks=SLOW),
                                      pytest.param(["sharding=hybrid", "sharding.replicate=2"], marks=SLOW),
                                      pytest.param(["sharding=none"], marks=SLOW),
                                      pytest.param(["sharding=full", "offload=true"], marks=SLOW)],
                         ids=["full", "grad_op", "ddp", "hybrid", "none", "full-offload"])
def test_task_estimate_end_to_end(sharding, tmp_path):
    """The command a user types, at a world size this machine could not run."""
    out = tmp_path / "run"
    result = run_cli("task=estimate", "model=gpt", "data=synthetic_tokens", "task.world_size=4",
                     "task.batch_sizes=[2,8]", "memory.limit_gb=64", "device=cpu", "wandb.mode=disabled",
                     *sharding, f"hydra.run.dir={out}", cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = read_json(out / "estimate.json")
    world = 1 if sharding == ["sharding=none"] else 4
    # before the seconds of tracing, a line says what is being traced
    tracing = f"tracing one rank of {world} on fake tensors: its build, sharding and a training step at 2 batch sizes"
    assert tracing in result.stdout + result.stderr
    assert record["world_size"] == world and record["device"] == "cpu"
    assert [b["batch_size"] for b in record["batches"]] == [2, 8]
    small, large = record["batches"]
    assert 0 < small["peak_with_runtime_gb"] < large["peak_with_runtime_gb"]
    for batch in record["batches"]:
        assert sum(batch["breakdown_gb"].values()) == pytest.approx(batch["step_peak_gb"])
    assert record["largest_batch_fitting"] == 8
    # Past 8 along the line through 2 and 8: where it reaches 64 GB
    per_sample = (large["peak_under_limit_gb"] - small["peak_under_limit_gb"]) / 6
    assert record["predicted_max_batch"] == int(8 + (64 - large["peak_under_limit_gb"]) / per_sample)
    shards = {"full": 4, "grad_op": 4, "ddp": 1, "hybrid": 2, "none": 1}
    assert record["shards"] == shards[sharding[0].split("=")[1]]
    assert "predicted peak per rank" in result.stdout
    assert read_json(out / "summary.json")["peak_with_runtime_gb"] == record["peak_with_runtime_gb"]


@pytest.mark.slow
def test_more_ranks_hold_less_per_rank(tmp_path):
    records = []
    for world in (2, 8):
        out = tmp_path / f"w{world}"
        result = run_cli("task=estimate", "model=gpt", "data=synthetic_tokens", f"task.world_size={world}",
                         "device=cpu", "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=REPO)
        assert result.returncode == 0, result.stderr[-2000:]
        records.append(read_json(out / "estimate.json"))
    two, eight = (r["batches"][0]["breakdown_gb"] for r in records)
    assert eight["parameters"] == pytest.approx(two["parameters"] / 4, rel=0.01)
    assert eight["optimizer_state"] == pytest.approx(two["optimizer_state"] / 4, rel=0.01)


def test_bad_estimate_settings_are_one_line(tmp_path):
    result = refused_here("task=estimate", "task.world_size=0", "wandb.mode=disabled", cwd=tmp_path)
    assert result.returncode != 0
    assert "task.world_size=0" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(ConfigError, match="task.device=tpu: choose one of: auto, cpu, cuda"):
        compose_checked(["task=estimate", "task.device=tpu", "wandb.mode=disabled"])
    with pytest.raises(ConfigError, match=r"task.seq_lens: data=SyntheticImages has no sequence length; it is for "
                                          r"token data \(synthetic_tokens, text, token_file, padded_tokens\)"):
        compose_checked(["task=estimate", "task.seq_lens=[128]", "wandb.mode=disabled"])
    with pytest.raises(ConfigError, match="task.gpu=A100: name a GPU"):
        compose_checked(["task=estimate", "task.gpu=A100", "wandb.mode=disabled"])
    with pytest.raises(ConfigError, match="task.gpu=L4: names a GPU to estimate for; leave task.device=auto or set cuda"):
        compose_checked(["task=estimate", "task.gpu=L4", "task.device=cpu", "wandb.mode=disabled"])


@pytest.mark.slow
def test_for_token_data_the_answer_is_in_tokens_too_and_over_sequence_lengths(tmp_path):
    out = tmp_path / "run"
    result = run_cli("task=estimate", "model=gpt", "model.size=tiny", "model.block_size=256", "data=synthetic_tokens",
                     "task.seq_lens=[64,128,512]", "task.batch_sizes=[4,16]", "memory.limit_gb=2", "train.grad_accum=2",
                     "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    record = read_json(out / "estimate.json")
    # a micro-batch is half the batch (train.grad_accum=2) of data.seq_len=128 tokens
    assert record["seq_len"] == 128 and record["tokens_per_micro_batch"] == record["largest_batch_fitting"] // 2 * 128
    short, configured, long = record["by_seq_len"]
    assert (short["seq_len"], configured["seq_len"]) == (64, 128) and long["seq_len"] == 512
    assert configured["largest_batch_fitting"] == record["largest_batch_fitting"]
    assert short["peak_mem_gb"] < configured["peak_mem_gb"] or short["largest_batch_fitting"] > configured["largest_batch_fitting"]
    for row in (short, configured):
        assert row["tokens_per_micro_batch"] == row["largest_batch_fitting"] // 2 * row["seq_len"]
    assert long["error"].endswith("sequence length 512 is longer than block_size=256")  # this length, not the run, fails
    assert (out / "estimate_seq_lens.png").stat().st_size > 0
    assert "tokens/micro-batch" in result.stdout and "     512  task=estimate could not trace this setup" in result.stdout


@pytest.mark.slow
def test_a_model_that_cannot_be_traced_is_one_line(tmp_path):
    stack = [o.replace("tests.test_estimate.linear_stack", "tests.test_estimate.ReadsItsInput") for o in STACK]
    result = run_cli("task=estimate", *stack, f"hydra.run.dir={tmp_path / 'run'}", cwd=REPO)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "task=estimate could not trace this setup" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert read_json(tmp_path / "run" / "summary.json")["status"] == "failed"


@pytest.mark.slow
def test_estimate_for_a_gpu_on_a_machine_without_one(tmp_path):
    out = tmp_path / "run"
    result = run_cli("task=estimate", "task.gpu=A100-40GB", "model=gpt", "data=synthetic_tokens", "precision=bf16",
                     "memory.limit_gb=80", "task.world_size=8", "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = read_json(out / "estimate.json")
    # outside the allocator: the CUDA context and the world's NCCL communicator of 8 (no NVLS on an A100)
    assert record["device"] == "cuda" and record["outside_allocator_gb"] == {"cuda_context": 0.5, "nccl": 0.688}
    assert record["breakdown_gb"]["baseline"] == pytest.approx(1.188)
    allocated = record["step_peak_gb"] - record["breakdown_gb"]["baseline"]
    assert record["peak_reserved_gb"] >= allocated and record["device_used_gb"] == pytest.approx(record["peak_reserved_gb"] + 1.188)
    fitting = record["device_used_gb"] <= 39.39 and record["peak_reserved_gb"] <= 80
    assert record["gpu"] == "A100-40GB" and record["gpu_memory_gb"] == 39.39  # as torch reports it (40 GB sold)
    assert record["largest_batch_fitting"] == (record["batch_size"] if fitting else 0)
    assert "cuda context 0.50 GB, nccl 0.69 GB" in result.stdout
    result = refused_here("task=estimate", "device=cuda", "wandb.mode=disabled", cwd=tmp_path)
    assert result.returncode != 0 and "task.device=cuda" in result.stderr


# --- the estimate in task=max_batch (task.estimate=true) ---


def test_max_batch_traces_doubling_sizes_up_to_the_first_over_the_limit():
    """task.estimate traces resolution, 2x, 4x, ... and stops at the first size whose
    step goes over the limit (task=max_batch's own call runs it in a child process, as
    task=estimate does; tests/test_max_batch.py runs that end to end)."""
    from fsdp_exp.tasks.max_batch.prior import doubling, prior

    assert doubling(1, 4096) == [2**k for k in range(13)] and doubling(4, 100) == [4, 8, 16, 32, 64, 100]
    exp, everything = traced(batch_sizes=doubling(1, 4096))
    peaks = [estimate_batch(s, everything, False, False, 0, False).peak_under_limit_gb for s in everything.steps]
    assert len(peaks) == 13 and all(a < b for a, b in zip(peaks[8:], peaks[9:]))
    limit = (peaks[8] + peaks[10]) / 2  # between the peaks at 256 and 1024

    def enough(step, baseline_bytes):
        return estimate_batch(step, None, False, False, 0, False).peak_under_limit_gb > limit

    stopped = trace(exp, 2, doubling(1, 4096), on_gpu=False, enough=enough)
    sizes = [s.batch_size for s in stopped.steps]
    assert sizes == doubling(1, 4096)[:len(sizes)] and sizes[-1] in (512, 1024)
    # judged as `enough` judges them (what the math libraries keep is added after, and on some
    # CPUs it is not monotonic in the batch)
    last, before = (estimate_batch(s, None, False, False, 0, False).peak_under_limit_gb for s in stopped.steps[-1:-3:-1])
    assert last > limit >= before  # stopped at the first size over it
    curve = prior({"peaks_gb": [[b, gb] for b, gb in zip(doubling(1, 4096), peaks, strict=True)]})
    assert curve.peak_gb(256) == peaks[8] and curve.peak_gb(384) == pytest.approx((peaks[8] + peaks[9]) / 2)


def test_max_batch_searches_without_the_estimate_when_it_cannot_trace(caplog):
    from fsdp_exp.tasks.max_batch.prior import estimate_curve, prior

    stack = [o.replace("tests.test_estimate.linear_stack", "tests.test_estimate.ReadsItsInput") for o in STACK]
    exp = prepare(compose_checked([*stack, "task=max_batch", "memory.limit_gb=1"]), 0).exp
    with caplog.at_level("WARNING", logger="fsdp_exp"):
        record = estimate_curve(exp, 2, limit_gb=1.0)
    assert record["error"] and prior(record) is None  # no curve: the search places its probes without one
    assert [r.levelname for r in caplog.records if r.name.startswith("fsdp_exp")] == ["WARNING"]


def normed_over_the_batch() -> nn.Module:
    """BatchNorm over the batch: a step of one sample does not train (one value per channel)."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))


def test_a_model_that_cannot_train_on_one_sample_is_traced_from_two(caplog):
    """task=max_batch's estimate of a BatchNorm net that a batch of 1 cannot train: traced
    again from 2, as its search probes 2 after 1 failed, so it still places the probes."""
    from fsdp_exp.tasks.max_batch.prior import estimate_curve, prior

    stack = [o.replace("linear_stack", "normed_over_the_batch") for o in STACK]
    exp = prepare(compose_checked([*stack, "task=max_batch", "memory.limit_gb=1", "task.search_up_to=2"]), 0).exp
    with caplog.at_level("INFO", logger="fsdp_exp"):
        record = estimate_curve(exp, 2, limit_gb=1.0)
    assert "error" not in record, record
    assert [b for b, _ in record["peaks_gb"]] == [2] and prior(record) is not None
    assert "Expected more than 1 value per channel" in caplog.text  # the first trace's failure, then from 2


def test_the_trace_of_a_gpu_run_asks_for_foreach_and_leaves_the_runs_settings_as_they_were() -> None:
    """On a GPU torch's AdamW takes its foreach kernels, whose temporaries the trace (on the
    CPU) must see, so the traced experiment asks for them; it is derived with `replace`, so
    the run's own experiment keeps the user's optimizer and model."""
    exp = prepare(compose_checked(["task=estimate", "task.device=cuda", "wandb.mode=disabled"]), 0).exp
    before = dict(exp.optimizer)
    on_gpu, on_cpu = for_tracing(exp, on_gpu=True), for_tracing(exp, on_gpu=False)
    assert on_gpu.optimizer["foreach"] is True and "foreach" not in on_cpu.optimizer
    assert dict(exp.optimizer) == before and "foreach" not in exp.optimizer
    assert on_gpu.model is not exp.model and exp.model.init_device == "cpu" and not exp.train.compile


def test_task_eval_of_the_weights_is_estimated_by_hand():
    """task=eval's forward of the whole linear stack at batch 64, without gradients: the
    inputs and targets, two layers' outputs at a time, then the logits and their log-softmax."""
    from fsdp_exp.estimate.breakdown import evaluation_gb

    _, result = traced("sharding=full", batch_sizes=[64])
    batch_row = 64 * WIDTH * FP32
    forward = result.steps[0].eval_forward_bytes
    assert 3 * batch_row + 64 * INT64 <= forward <= 3 * batch_row + 64 * INT64 + 16, forward
    # the whole model (4 layers) and, beside it, the weights file read whole (larger than this forward)
    assert evaluation_gb(result.steps[0], result, False, 0.25) * GB == pytest.approx(0.25 * GB + 2 * DEPTH * LAYER)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_task_eval_holds_what_the_estimate_says(tmp_path):
    """GPT-2 small's weights, evaluated at batch 8 and 32 (logits of 50257 a token): the
    command's anonymous memory at its peak, sampled, against the estimate's eval_gb."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    gpt = ["model=gpt", "model.size=small", "data=synthetic_tokens", "wandb.mode=disabled"]
    trained = run_cli(*gpt, "train.steps=1", "train.batch_size=2", "checkpoint.export_full=true",
                      f"hydra.run.dir={tmp_path / 'train'}", cwd=REPO, timeout=400)
    assert trained.returncode == 0, trained.stderr[-2000:]
    shown = run_cli("task=estimate", *gpt, "task.batch_sizes=[8,32]", f"hydra.run.dir={tmp_path / 'estimate'}",
                    cwd=REPO, timeout=400)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "task=eval of these weights, in one process at task.batch_size 8:" in shown.stdout
    estimated = {b["batch_size"]: b["eval_gb"] for b in read_json(tmp_path / "estimate" / "estimate.json")["batches"]}
    for batch in (8, 32):
        command = [sys.executable, "-m", "fsdp_exp", "task=eval", *gpt, f"task.weights={tmp_path / 'train' / 'model.safetensors'}",
                   f"task.batch_size={batch}", f"hydra.run.dir={tmp_path / f'eval{batch}'}"]
        run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peak = 0
        while run.poll() is None:
            status = Path(f"/proc/{run.pid}/status")
            try:
                peak = max(peak, next(int(line.split()[1]) for line in status.read_text().splitlines()
                                      if line.startswith("RssAnon:")) * 1024)
            except (OSError, StopIteration):
                pass
            time.sleep(0.01)
        assert run.returncode == 0
        assert abs(estimated[batch] / (peak / GB) - 1) <= 0.15, (batch, estimated[batch], peak / GB)


def test_a_build_that_loads_pretrained_weights_is_named_so():
    """model.pretrained=true: a build that outgrows the step is the pretrained load, and the
    table says what avoids it."""
    from dataclasses import replace

    from fsdp_exp.tasks.estimate import OUTGROWING

    _, result = traced("sharding=full", batch_sizes=[16])
    heavy = replace(result, build_bytes=GB)  # a whole model far above the step
    named = {pretrained: estimate_batch(heavy.steps[0], heavy, False, False, 0, True, pretrained=pretrained).phase
             for pretrained in (True, False)}
    assert named == {True: "pretrained load", False: "model build"}
    assert "rank 0 alone loads them" in OUTGROWING["pretrained load"][1]


# The library ops a step runs, recorded under fake tensors as the trace records them
SEEN = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from fsdp_exp.estimate import library

class Seen(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.see(func, args)
        return func(*args, **(kwargs or {}))
"""

LIBRARY_PROBE = SEEN + """
linear, conv = library.LibraryOps(), library.LibraryOps()
with FakeTensorMode():
    with Seen(linear):
        torch.nn.Linear(9216, 128)(torch.zeros(32, 9216, requires_grad=True)).sum().backward()
    with Seen(conv):
        torch.nn.Conv2d(3, 16, 3)(torch.zeros(8, 3, 64, 64, requires_grad=True)).sum().backward()
replay = library.Replay()
first, second = replay.kept(linear, 1), replay.kept(conv, 1)
library.REPLAY_FLOPS = linear.flops() / 2
print(len(linear.seen), linear.flops(), first.in_use_bytes, first.data_bytes, len(conv.seen),
      second.data_bytes - first.data_bytes, library.kept(linear, 1))
"""


REAL_LINEAR_STEP = """
import torch
from fsdp_exp.linux import heap_in_use_bytes, map_large_blocks
map_large_blocks()  # as the replay: blocks over 64 KiB go back to the system on free
torch.set_num_threads(1)
layer, x = torch.nn.Linear(9216, 128), torch.zeros(32, 9216, requires_grad=True)
start = heap_in_use_bytes()
layer(x).sum().backward()
x.grad = layer.weight.grad = layer.bias.grad = None
print(heap_in_use_bytes() - start)
"""


SWEEP_PROBE = SEEN + """
steps = {b: library.LibraryOps() for b in (8, 16, 64, 128)}
with FakeTensorMode():
    for b, ops in steps.items():
        with Seen(ops):
            torch.nn.Linear(4096, 512)(torch.zeros(b, 4096, requires_grad=True)).sum().backward()
library.REPLAY_FLOPS = steps[64].flops()  # batch 128 is past it
swept = library.kept_by_step(list(steps), list(steps.values()), 1)
for kept in library.cache_dir().joinpath("library").glob("*.json"):
    kept.unlink()  # replayed again, not read back
alone = library.replayed_alone(steps[64], 1)
one_process = library.Replay()
after = [one_process.kept(ops, 1) for ops in list(steps.values())[:3]]
print(*(k.in_use_bytes for k in swept), alone.in_use_bytes, after[2].in_use_bytes)
"""


def test_a_trace_of_several_batches_measures_each_as_a_rank_running_it_alone() -> None:
    """The libraries keep buffers per shape: replayed one after another in one process, the
    largest batch holds the smaller ones' too. A trace of several batches replays its largest
    in a fresh process (as a rank that runs only it) and puts those between on the line; a
    batch past REPLAY_FLOPS keeps at least what the largest replayed keeps, not nothing."""
    shown = subprocess.run([sys.executable, "-c", SWEEP_PROBE], capture_output=True, text=True, cwd=REPO, check=True)
    first, middle, largest, past, alone, _ = (int(x) for x in shown.stdout.split())
    # (what a sweep in one process would say, the last figure, depends on the CPU: with
    # AVX-512 without AMX, MKL held each shape's buffers, 0.5 MB and more above `alone`; on a
    # CPU with AMX, less than `alone`)
    assert largest == pytest.approx(alone, rel=0.05, abs=64 * 1024), shown.stdout
    assert middle == round(first + (16 - 8) / (64 - 8) * (largest - first))
    assert past == largest > first, shown.stdout


KEPT_REPLAY = SEEN + """
import json, threading
ops, wider = library.LibraryOps(), library.LibraryOps()
with FakeTensorMode():
    with Seen(ops):
        torch.nn.Linear(1024, 256)(torch.zeros(16, 1024, requires_grad=True)).sum().backward()
    with Seen(wider):
        torch.nn.Linear(1024, 256)(torch.zeros(32, 1024, requires_grad=True)).sum().backward()
described = [(library.op_name(f), a) for f, a in ops.seen]
path = library.kept_at(described, 1)
got = {}
with library.one_at_a_time(path):  # another trace replaying the same ops
    second = threading.Thread(target=lambda: got.update(kept=library.replayed_alone(ops, 1)))
    second.start()
    second.join(1.0)
    waited = second.is_alive()
    path.write_text(json.dumps({"in_use_bytes": 7, "data_bytes": 11}))  # what its replay kept
second.join()
path.write_text("{damaged")
replayed = library.replayed_alone(ops, 1)
print(waited, got["kept"].in_use_bytes, got["kept"].data_bytes, replayed.in_use_bytes,
      json.loads(path.read_text())["in_use_bytes"], path == library.kept_at(described, 2),
      path == library.kept_at([(library.op_name(f), a) for f, a in wider.seen], 1))
"""


def test_a_replay_of_the_same_ops_is_read_back_and_traces_side_by_side_take_turns() -> None:
    """What a fresh process keeps after a set of library ops is kept in the cache folder: a
    trace that needs the same replay while another makes it waits for it and reads it back
    (no second replay); a damaged record is replayed again and rewritten; other threads or
    other shapes are another record."""
    shown = subprocess.run([sys.executable, "-c", KEPT_REPLAY], capture_output=True, text=True, cwd=REPO, check=True)
    waited, in_use, data, replayed, rewritten, same_for_threads, same_for_shapes = shown.stdout.split()
    assert waited == "True", shown.stdout  # it did not replay while the other held the record
    assert (int(in_use), int(data)) == (7, 11), shown.stdout  # the other's, read back
    assert int(replayed) != 7 and int(rewritten) == int(replayed), shown.stdout
    assert same_for_threads == same_for_shapes == "False", shown.stdout


def test_what_the_math_libraries_keep_after_a_steps_ops_is_measured() -> None:
    """MKL keeps its packing buffers after a multiplication, oneDNN the code it generates for
    a convolution: the trace records a step's library ops (a 9216 x 128 layer's forward and
    backward at batch 32: 3 multiplications; a convolution's forward and backward) and runs
    each once on zeros, in a fresh process; what stays allocated, and the growth of the data
    segment memory.limit_gb counts, are what a rank holds besides its tensors. Past
    REPLAY_FLOPS nothing is replayed."""
    shown = subprocess.run([sys.executable, "-c", LIBRARY_PROBE], capture_output=True, text=True, cwd=REPO, check=True)
    count, flops, in_use, data, convs, conv_data, capped = shown.stdout.split()
    assert int(count) == 3 and float(flops) == pytest.approx(3 * 2 * 32 * 9216 * 128)
    # what the replay of the recorded ops keeps is what the layer's real step keeps, on this
    # CPU (MKL's buffers: 6.6 MB with AVX-512, a few kB where it has AMX)
    real = subprocess.run([sys.executable, "-c", REAL_LINEAR_STEP], capture_output=True, text=True, cwd=REPO, check=True)
    assert int(in_use) == pytest.approx(int(real.stdout), rel=0.1, abs=256 * 1024), (shown.stdout, real.stdout)
    assert int(convs) == 2 and int(conv_data) > 0, shown.stdout  # oneDNN's kernels for the convolution
    assert capped == "None"
