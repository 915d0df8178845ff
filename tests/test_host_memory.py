"""The host's memory per node (`fsdp_exp.estimate.host`): each part by hand on a model small
enough to count, `memory.host_limit_gb` judging the answer, and the figure against a real
node's memory, summed over every process of a run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.estimate.breakdown import GB, estimate_batch
from fsdp_exp.estimate.host import PREFETCH, HostSetup, host_memory
from fsdp_exp.estimate.trace import trace
from tests.conftest import REPO, estimated_first, names, read_json, refused_here, run_cli
from tests.test_estimate import DEPTH, FP32, INT64, LAYER, STACK, WIDTH

SAMPLE = WIDTH * FP32 + INT64  # a sample of Vectors and its class index


def gpu_host(*overrides: str, setup: HostSetup, batch: int = 64) -> dict:
    exp = prepare(compose_checked([*STACK, *overrides]), 0).exp
    traced = trace(exp, 2, [batch], on_gpu=True)
    found = estimate_batch(traced.steps[0], traced, on_gpu=True, offload=exp.offload, baseline_gb=1.0,
                           builds_whole_model=setup.builds_on_every_rank)
    return host_memory(found, traced, setup, on_gpu=True) | {"trace": traced, "batch": found}


def test_on_a_gpu_the_host_holds_offloaded_state_staged_checkpoints_pinned_batches_and_workers() -> None:
    """4 Linear(256, 256) on 2 ranks, batch 64 with 2 data workers: each part by hand."""
    setup = HostSetup(ranks_per_node=8, num_workers=2, stages_checkpoint=True, launcher_gb=0.5, offload=True)
    found = gpu_host("offload=true", "checkpoint=dcp_async_pinned", "data.num_workers=2", setup=setup)
    parts = found["host_per_rank_gb"]
    shards, moments = DEPTH * LAYER // 2, DEPTH * LAYER + DEPTH * FP32  # AdamW's two moments and a step count
    # the staged copy: this rank's parameter shards and the optimizer's state
    assert round(parts["checkpoint staging"] * GB) == shards + moments
    # offloaded: the shards and their gradients pinned (each 256 x 128 x 4 bytes, a power of two
    # already, so not rounded up), the optimizer's state beside them
    assert found["trace"].pinned_shard_bytes == shards
    assert round(parts["offloaded state"] * GB) == 2 * shards + moments
    # the batch being copied to the device, and two ready from each of the two workers
    assert round(parts["pinned batches"] * GB) == (1 + PREFETCH * 2) * 64 * SAMPLE
    worker = found["trace"].data_worker_bytes
    assert 0 < worker < 512 * 2**20  # one real forked worker's own pages
    assert round(parts["data workers"] * GB) == 2 * worker  # their ready batches are the pinned ones
    assert found["host_phase"] == "training"
    assert found["host_gb"] == pytest.approx(8 * sum(parts.values()) + 0.5)


def test_the_whole_model_is_on_the_host_while_it_is_built_on_every_rank_or_on_rank_0_alone() -> None:
    """Building the model on the host before moving it to the GPU: every rank's whole model
    under model.init_device=cpu, only rank 0's under meta (it sends the others their shards)."""
    every = gpu_host(setup=HostSetup(ranks_per_node=4))
    rank0 = gpu_host("model.init_device=meta", setup=HostSetup(ranks_per_node=4, builds_on_every_rank=False))
    whole = DEPTH * LAYER / GB
    runtime = every["host_per_rank_gb"]["runtime and data"]
    assert every["trace"].model_bytes == DEPTH * LAYER
    assert every["host_gb"] >= 4 * (runtime + whole) - 1e-9
    building = rank0["host_per_rank_gb"]["runtime and data"] * 4 + whole
    assert rank0["host_gb"] >= building - 1e-9
    # the same trace under both: the node holds one whole model while it builds, not four
    alone = host_memory(every["batch"], every["trace"], HostSetup(ranks_per_node=4, builds_on_every_rank=False), True)
    assert every["host_gb"] - alone["host_gb"] == pytest.approx(3 * whole)
    # on the device, meta leaves out the build; every rank's build of the whole model is judged there too
    assert "model build" in every["batch"].phases_gb and "model build" not in rank0["batch"].phases_gb
    assert every["batch"].peak_under_limit_gb >= every["batch"].phases_gb["model build"] - every["batch"].breakdown_gb["baseline"]


def test_on_cpu_rank_0_builds_the_whole_model_under_meta_too() -> None:
    """A CPU rank 0 under model.init_device=meta holds the whole model beside its shards,
    which the estimate names as its phase (the slow test below measures it)."""
    exp = prepare(compose_checked([*STACK, "model.init_device=meta"]), 0).exp
    traced = trace(exp, 2, [1], on_gpu=False)
    found = estimate_batch(traced.steps[0], traced, on_gpu=False, offload=False, baseline_gb=0,
                           builds_whole_model=False)
    assert round(found.phases_gb["rank 0's model build"] * GB) == DEPTH * LAYER + DEPTH * LAYER // 2


@pytest.mark.slow
def test_memory_host_limit_gb_judges_the_host_and_the_table_says_what_holds_less(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("task=estimate", *STACK, "memory.host_limit_gb=0.5", "data.num_workers=1",
                     "task.world_size=8", "task.ranks_per_node=4", f"hydra.run.dir={out}", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "estimate.json")
    assert record["ranks_per_node"] == 4 and record["host_limit_gb"] == 0.5
    assert record["host_gb"] > 0.5 and record["largest_batch_fitting"] == 0
    assert "does not fit memory.host_limit_gb=0.5" in result.stdout
    assert "fewer ranks per node, fewer data.num_workers" in result.stdout
    assert "does not fit with the host under memory.host_limit_gb=0.5" in result.stdout + result.stderr

    bad = refused_here("task=estimate", "memory.host_limit_gb=0", "wandb.mode=disabled", cwd=tmp_path)
    assert bad.returncode == 2
    names(bad.stderr, "memory.host_limit_gb=0.0", "greater than 0")
    assert "Traceback" not in bad.stderr


def process_tree(pid: int, leave_out: str | None = None) -> list[int]:
    """`pid` and every process below it; with `leave_out`, not a process whose command line
    holds it, nor any below that one."""
    if leave_out is not None and leave_out in command_line(pid):
        return []
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [p for child in (task / "children").read_text().split()
                      for p in process_tree(int(child), leave_out)]
        except OSError:
            pass
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def proportional_bytes(pid: int) -> int:
    """A process's share of anonymous and shared memory: pages it shares with others (a
    forked process's copy-on-write pages) are split among them, so the sum over processes
    is what the node holds."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in rollup if line.startswith(("Pss_Anon:", "Pss_Shmem:")))


def node_peak_gb(args: list[str], run_dir: Path) -> float:
    """The run's node memory at its peak, summed over every process it starts but its own
    estimate's (the tracing process and what it starts are not the run's), sampled every
    20 ms from the start. Its estimate made first (task=estimate), as the run ends before a
    trace beside it would."""
    estimated_first(*args, cwd=REPO, where=run_dir.with_name(run_dir.name + "_estimate"))
    command = [sys.executable, "-m", "fsdp_exp", *args, f"hydra.run.dir={run_dir}"]
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    deadline = time.monotonic() + 600
    while run.poll() is None and time.monotonic() < deadline:
        peak = max(peak, sum(proportional_bytes(p) for p in process_tree(run.pid, leave_out="fsdp_exp.estimate.")))
        time.sleep(0.02)
    run.kill()
    assert run.wait() == 0
    return peak / GB


@pytest.mark.slow
def test_the_host_per_node_is_what_a_real_node_holds(tmp_path: Path) -> None:
    """A 2-rank ViT run with 2 data workers per rank: every process's memory summed at its
    peak, against the run's own estimate of its node. Ranks started fresh (spawn, as under
    torchrun or SLURM): within 10%. Forked from the rank server (the local launcher's
    default), they share its runtime's pages, and the estimate is an upper bound. Either
    way the data workers are forked from their rank (a spawned one was a fresh interpreter
    with a copy of the data set: 2.75 GB against 1.62 estimated)."""
    run = ["train.batch_size=64", "train.steps=8", "data.num_workers=2", "memory.limit_gb=2", "wandb.mode=disabled"]
    spawned = node_peak_gb([*run, "launcher.start_method=spawn"], tmp_path / "spawn")
    estimated = read_json(tmp_path / "spawn" / "estimate.json")["host_gb"]
    assert abs(estimated / spawned - 1) <= 0.1, (estimated, spawned)
    forked = node_peak_gb(run, tmp_path / "forked")
    assert forked <= read_json(tmp_path / "forked" / "estimate.json")["host_gb"], forked


@pytest.mark.slow
def test_rank_0s_whole_model_under_meta_is_its_peak_on_cpu(tmp_path: Path) -> None:
    """16 Linear(4096, 4096) under SGD on 2 CPU ranks with model.init_device=meta: rank 0's
    whole model beside its shards outgrows a step (rank 1 peaks lower), and the estimate
    names that phase and is within 5% of rank 0's peak."""
    out = tmp_path / "run"
    setup = ["model=custom", "model._target_=tests.test_host_memory.wide", "model.blocks=[torch.nn.Linear]",
             "data=custom", "data._target_=tests.test_host_memory.WideVectors", "device=cpu",
             "optimizer._target_=torch.optim.SGD", "model.init_device=meta", "train.batch_size=2",
             "train.steps=2", "memory.limit_gb=4", "wandb.mode=disabled"]
    estimated_first(*setup, cwd=REPO, where=tmp_path / "estimate")
    result = run_cli(*setup, f"hydra.run.dir={out}", cwd=REPO, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    record = read_json(out / "estimate.json")
    rank0, rank1 = summary["peak_under_limit_gb_per_rank"]
    assert rank0 > rank1 + 0.1, (rank0, rank1)
    assert record["phase"] == "rank 0's model build", record["phase"]
    assert abs(summary["estimate_ratio_peak_under_limit"] - 1) <= 0.05, summary["estimate_ratio_peak_under_limit"]


WIDE = 4096


def wide():  # noqa: ANN201
    from torch import nn

    return nn.Sequential(*[nn.Linear(WIDE, WIDE, bias=False) for _ in range(16)])


class WideVectors:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):  # noqa: ANN204
        import torch

        return torch.zeros(WIDE), torch.tensor(index % WIDE)


@pytest.mark.parametrize(("launcher", "per_node"), [
    (["launcher=torchrun", "launcher.nnodes=2", "launcher.nproc_per_node=3"], 3),  # 6 ranks on 2 nodes
    (["launcher=local", "launcher.nproc_per_node=3"], 3),
    (["launcher=ray", "launcher.num_workers=4"], 4),  # Ray's placement is not in the config: one node
])
def test_the_ranks_on_a_node_are_as_the_launcher_places_them(launcher: list[str], per_node: int) -> None:
    exp = prepare(compose_checked([*launcher, "wandb.mode=disabled"]), 0).exp
    assert exp.launcher.ranks_per_node(exp.launcher.world_size(0)) == per_node


def test_pinned_host_memory_rounds_each_shard_up_to_a_power_of_two() -> None:
    from torch import nn

    from fsdp_exp.estimate.trace import pinned_bytes

    model = nn.Sequential(nn.Linear(100, 10, bias=False), nn.Linear(64, 64, bias=True))
    # 4,000 bytes -> 4,096; 16,384 stays; a 256-byte bias stays
    assert pinned_bytes(model) == 4096 + 16384 + 256
