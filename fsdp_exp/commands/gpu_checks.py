"""The checks of `python -m fsdp_exp.check_gpu`: the runs each one needs, and which judge
(fsdp_exp.commands.gpu_judges) reads them.

A run is a list of overrides for `python -m fsdp_exp`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


from fsdp_exp.commands.gpu_judges import (
    RunResult,
    answer_trains,
    cap_holds,
    compiled_probe,
    device,
    device_memory_search,
    estimated,
    limit_recorded,
    mfu,
    out_of_memory,
    parity,
    resumes,
    same_training,
    trains,
    trains_on_every_gpu,
    under_limit,
)


@dataclass(frozen=True)
class CheckSetup:
    """Where the checks run, and the sizes that suit it."""

    device: str  # cuda; cpu only for development
    ranks: int
    # Relative difference allowed between two runs that must agree. A mis-reduced gradient
    # is off by a factor (2 when summed over 2 ranks instead of averaged), far above either.
    # On a GPU the kernels choose their algorithm by shape and some add atomically, so one
    # process's batch and the ranks' halves round differently: 10x the CPU's tolerance.
    tolerance: float
    gpt: tuple[str, ...]  # the GPT of the MFU check
    mfu_batch: int
    limit_gb: float  # memory.limit_gb of the memory checks
    limit_batch: int  # trains well under limit_gb
    oom_batch: int  # too big for limit_gb; with cap_proof, one the GPU trains without the limit
    cap_proof: bool = False  # oom_batch also runs without the limit ("cap_free"): it must train there
    peak_tflops: float | None = None  # metrics.peak_tflops, when given
    memory_gpt: tuple[str, ...] = ()  # the GPT of the memory checks; () the MFU check's


TINY_GPT = ("model=gpt", "model.size=tiny", "model.vocab_size=256", "data=synthetic_tokens", "data.seq_len=128",
            "model.block_size=128", "data.num_samples=8192")


# What GPT-2 small needs on one GPU, as task=estimate predicts it (reserved GB, 1 rank,
# sharding=full, AdamW, 1024 tokens a sample; the commands in docs/BENCHMARKS.md, "check_gpu's
# sizes"). They size the checks to the GPU, so that a check fails for what it checks, not
# because a 12 GB card or a MIG slice had less room than an 80 GB one.
GPT2_SMALL_BF16_GB = {8: 10.52, 4: 6.30, 2: 4.26, 1: 3.27}  # by batch: the MFU run
GPT2_SMALL_FP32_GB = {2: 4.76, 1: 3.49}  # by batch: the run under memory.limit_gb


def gpt2_small_fp32_gb(batch: int) -> float:
    """GPT-2 small's fp32 need past the table, on its line (1.27 GB a sample of 1024 tokens)."""
    slope = GPT2_SMALL_FP32_GB[2] - GPT2_SMALL_FP32_GB[1]
    return GPT2_SMALL_FP32_GB[1] + slope * (batch - 1)


def cap_batch(limit_gb: float, memory_gb: float) -> int | None:
    """The smallest batch of GPT-2 small (fp32) that needs a quarter more than limit_gb yet
    trains on the card without it (0.8 of its memory less what sits outside the allocator):
    the batch that proves the cap, running out under it and training without it; None on a
    card too small for one."""
    return next((b for b in range(1, 65) if gpt2_small_fp32_gb(b) > 1.25 * limit_gb
                 and gpt2_small_fp32_gb(b) <= 0.8 * memory_gb - OUTSIDE_ALLOCATOR_GB), None)
OUTSIDE_ALLOCATOR_GB = 1.5  # the CUDA context and NCCL's buffers (0.5-0.7 GB a communicator), with room
MAX_LIMIT_GB = 8.0


def setup_for(device: str, gpus: int, peak_tflops: float | None = None, memory_gb: float = 80.0) -> CheckSetup:
    """The checks' sizes for `gpus` GPUs of `memory_gb` each (the smallest, when they differ)."""
    if device == "cuda":
        gpt = ("model=gpt", "model.size=small", "data=synthetic_tokens", "data.vocab_size=50257",
               "data.seq_len=1024", "model.block_size=1024")
        room = 0.9 * memory_gb - OUTSIDE_ALLOCATOR_GB
        mfu_batch = max((b for b, need in GPT2_SMALL_BF16_GB.items() if need <= room), default=0)
        if not mfu_batch:  # a MIG slice of 5 GB: 256 tokens a sample
            gpt, mfu_batch = (*gpt[:4], "data.seq_len=256", "model.block_size=256"), 1
        limit_gb = min(MAX_LIMIT_GB, memory_gb / 2)  # half the card: the limit, not the card, bounds the runs
        # the largest batch that leaves an eighth of the limit free, by the estimate
        limit_batch = max((b for b, need in GPT2_SMALL_FP32_GB.items() if need <= 0.875 * limit_gb), default=0)
        if limit_batch:
            proving = cap_batch(limit_gb, memory_gb)
            return CheckSetup("cuda", max(gpus, 1), 1e-4, gpt, mfu_batch=mfu_batch, limit_gb=limit_gb,
                              limit_batch=limit_batch, oom_batch=proving or 64, peak_tflops=peak_tflops,
                              cap_proof=proving is not None)
        # under 8 GB a card: the memory checks on the development run's small GPT
        return CheckSetup("cuda", max(gpus, 1), 1e-4, gpt, mfu_batch=mfu_batch, limit_gb=min(1.5, limit_gb),
                     limit_batch=4, oom_batch=2048, peak_tflops=peak_tflops, memory_gpt=TINY_GPT)
    # A CPU has no peak TFLOP/s; a nominal 1 keeps the MFU plumbing running, and the summary
    # names it as metrics.peak_tflops.
    return CheckSetup("cpu", 2, 1e-5, TINY_GPT, mfu_batch=4, limit_gb=1.5, limit_batch=4, oom_batch=2048,
                 peak_tflops=peak_tflops or 1.0)


# tests/test_parity.py's setup: a 2-layer ViT, SGD with momentum (its update is linear in
# the gradient, so a mis-reduced gradient shows at once), 6 steps, the weights exported.
PARITY_STEPS = 6
VIT = ["model.num_layers=2", "train.batch_size=16", "train.log_every=1", "train.lr=0.05",
       "optimizer._target_=torch.optim.SGD", "+optimizer.momentum=0.9", "checkpoint.export_full=true"]


# A model with buffers (BatchNorm's running statistics), built on the meta device and
# offloaded, against the same run built plainly: the same initial weights, so the same losses.
RESNET = ["model=resnet", "sharding=full", "offload=true", "train.batch_size=8", "train.steps=4", "train.log_every=1",
          "precision.tf32=false", "optimizer._target_=torch.optim.SGD", "train.lr=0.05"]

Overrides = list[str] | Callable[[dict[str, RunResult]], list[str] | None]  # a run made from earlier runs' results


TORCHRUN = "torchrun:"  # a run's first word: under an external torchrun (fsdp_exp.check_gpu.command)


def runs(setup: CheckSetup, workdir: Path) -> dict[str, Overrides]:
    """Every run the checks read, by name: the overrides of `python -m fsdp_exp`, or how to
    make them from the runs before it (None: it cannot run)."""
    common = [f"device={setup.device}", f"launcher.nproc_per_node={setup.ranks}", "wandb.mode=disabled"]
    vit = [*common, *VIT, f"train.steps={PARITY_STEPS}", "precision.tf32=false"]
    checkpoint = ["checkpoint=dcp", f"checkpoint.dir={workdir / 'checkpoints'}"]
    gpt = [*common, *setup.gpt, "sharding=full", "train.log_every=5"]
    memory_gpt = [*common, *(setup.memory_gpt or setup.gpt), "sharding=full", "train.log_every=5"]
    peak = [f"metrics.peak_tflops={setup.peak_tflops:g}"] if setup.peak_tflops else []
    return {
        "none": [*vit, "sharding=none"],
        "full": [*vit, "sharding=full"],
        # the same run under an external torchrun: each process one rank, each rank its own GPU
        "torchrun": [f"{TORCHRUN}--nproc_per_node={setup.ranks}",
                     *[o for o in vit if not o.startswith("launcher.")], "sharding=full"],
        "grad_op": [*vit, "sharding=grad_op"],
        "ddp": [*vit, "sharding=ddp"],
        "bf16_offload": [*vit, "sharding=full", "offload=true", "precision=bf16"],
        "fp16_offload": [*vit, "sharding=full", "offload=true", "precision=fp16"],
        # overwrite: the checkpoints of an earlier check kept in the same directory (--keep)
        "first_half": [*vit, "sharding=full", *checkpoint, "checkpoint.overwrite=true",
                       f"train.steps={PARITY_STEPS // 2}"],
        "resumed": [*vit, "sharding=full", *checkpoint, "resume=auto"],
        "gpt": [*gpt, "precision=bf16", f"train.batch_size={setup.mfu_batch}", "train.steps=20",
                "metrics.warmup_steps=5", *peak],
        # task=estimate of the MFU run, traced for this device and these ranks
        "estimate_gpt": [*gpt, "precision=bf16", f"train.batch_size={setup.mfu_batch}", "task=estimate"],
        "under_limit": [*memory_gpt, f"memory.limit_gb={setup.limit_gb:g}", f"train.batch_size={setup.limit_batch}",
                        "train.steps=4"],
        "oom": [*memory_gpt, f"memory.limit_gb={setup.limit_gb:g}", f"train.batch_size={setup.oom_batch}",
                "train.steps=2"],
        "resnet_offload": [*common, *RESNET],
        "resnet_meta_offload": [*common, *RESNET, "model.init_device=meta"],
        "max_batch": [*memory_gpt, f"memory.limit_gb={setup.limit_gb:g}", "task=max_batch"],
        "at_max_batch": lambda done: at_max_batch(done["max_batch"], memory_gpt, setup.limit_gb),
        # one probe (batch 1) of task=max_batch with train.compile=true (its answer is not run again)
        "compiled_probe": [*memory_gpt, "task=max_batch", f"memory.limit_gb={setup.limit_gb:g}", "train.compile=true",
                           "task.search_up_to=1", "task.estimate=false", "task.verify_steps=0"],
        # on a GPU, task=max_batch without memory.limit_gb: the device's memory is the limit
        **({"max_batch_device": [*memory_gpt, "task=max_batch", "task.verify_steps=5"]} if setup.device == "cuda" else {}),
        # the oom run's batch without the limit: it trains, so the cap, not the card, stopped it
        **({"cap_free": [*memory_gpt, f"train.batch_size={setup.oom_batch}", "train.steps=2"]}
           if setup.cap_proof else {}),
    }


def at_max_batch(search: RunResult, memory_gpt: list[str], limit_gb: float) -> list[str] | None:
    """The search's answer trained once more, directly, under the same limit."""
    size = search.summary.max_batch_size if search.summary is not None else None
    if not size:
        return None
    return [*memory_gpt, f"memory.limit_gb={limit_gb:g}", f"train.batch_size={size}", "train.steps=3",
            "metrics.warmup_steps=1"]


@dataclass
class Check:
    name: str
    runs: tuple[str, ...]  # what the judge reads, in its order
    judge: Callable[..., tuple[bool, str]] = field(repr=False)


def checks(setup: CheckSetup) -> list[Check]:
    tol = setup.tolerance
    return [
        *(Check(f"parity: {s} = none", ("none", s), lambda ref, run: parity(ref, run, tol))
          for s in ("full", "grad_op", "ddp")),
        Check("under an external torchrun = launcher=local", ("full", "torchrun"),
              lambda local, torchrun: same_training(local, torchrun, tol, "launcher=local")),
        Check("bf16 + offload trains", ("bf16_offload",), trains),
        Check("fp16 + offload trains on every GPU", ("fp16_offload",), lambda run: trains_on_every_gpu(run, setup.ranks)),
        Check("DCP save and resume", ("full", "first_half", "resumed"), lambda a, b, c: resumes(a, b, c, tol)),
        Check("MFU and FLOPs", ("gpt",), mfu),
        Check("peak under memory.limit_gb", ("under_limit",), lambda run: under_limit(run, setup.limit_gb)),
        Check("forced OOM is status oom", ("oom",), out_of_memory),
        Check("device and peak", ("gpt",), lambda run: device(run, setup.device)),
        Check("task=estimate against the run", ("gpt", "estimate_gpt"), estimated),
        Check("meta init + offload, a model with buffers", ("resnet_offload", "resnet_meta_offload"),
              lambda plain, meta: same_training(plain, meta, tol)),
        Check("max_batch's answer trains under the limit", ("max_batch", "at_max_batch"),
              lambda search, run: answer_trains(search, run, setup.limit_gb)),
        Check("peak_under_limit_gb present", ("under_limit",), lambda run: limit_recorded(run, setup.limit_gb)),
        Check("a compiled max_batch probe", ("compiled_probe",), compiled_probe),
        *([Check("max_batch with the GPU's memory as the limit", ("max_batch_device",), device_memory_search)]
          if setup.device == "cuda" else []),
        *([Check("the cap: a batch the GPU trains runs out under memory.limit_gb", ("oom", "cap_free"),
                 lambda capped, free: cap_holds(capped, free, setup.limit_gb))] if setup.cap_proof else []),
    ]
