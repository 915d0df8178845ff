"""`python -m fsdp_exp.gpu_session` (`make gpu-session`): on one GPU, every GPU claim the docs
make proven or disproven, in one table and one JSON file to paste into an issue.

It runs the rows of `python -m fsdp_exp.check_gpu` and the session's own (`session_runs`,
`session_checks`): task=estimate against the measured peaks of three setups (the ViT,
GPT-2 small in bf16 and a ResNet built on the meta device and offloaded; allocated, reserved
and what the device held apart), async pinned checkpoints with a resume, a short task=tune,
and MFU against a bf16 matmul measured on the same GPU. Each row says what it saw; the
JSON (`gpu_session.json` in the working directory, or --out) has every row and the
machine. docs/gpu.md explains each row, and how to set up a bare machine offline.

    make gpu-session                              # PYTHONPATH=<checkout> python -m fsdp_exp.gpu_session
    python -m fsdp_exp.gpu_session --keep DIR     # keep the runs' directories
    python -m fsdp_exp.gpu_session --device cpu   # development: its plumbing on 2 CPU ranks

Exit code 0 when every row passed, 1 when any failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from fsdp_exp import distributed
from fsdp_exp.commands.check_gpu import EXIT_FAILED, EXIT_NO_GPU, check_all, gpus_here, run_fsdp_exp, title
from fsdp_exp.commands.gpu_checks import (
    PARITY_STEPS,
    RESNET,
    VIT,
    Check,
    CheckSetup,
    Overrides,
    checks,
    runs,
    setup_for,
)
from fsdp_exp.commands.gpu_judges import RunResult, estimated, not_ok, resumes
from fsdp_exp.metrics.environment import package_version

MATMUL_SIZE = 8192  # a square bf16 matmul this large runs near the GPU's dense peak
MATMUL_REPEATS = 50


def matmul_tflops(device: torch.device, size: int = MATMUL_SIZE, repeats: int = MATMUL_REPEATS) -> float:
    """The TFLOP/s a square bf16 matmul reaches on `device` (fp32 on a CPU, which has no fast
    bf16): what the run's MFU is set against, measured, beside the datasheet's peak.
    `distributed.synchronize` is the one door to the GPU's queue."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):  # the kernel chosen, the clocks up
        a @ b
    distributed.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    distributed.synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def measure_matmul(device: str) -> tuple[float | None, str]:
    """matmul_tflops in a process of its own, so that this one never holds a CUDA context
    beside the runs it checks; (TFLOP/s, or None and why)."""
    done = subprocess.run([sys.executable, "-m", "fsdp_exp.gpu_session", "--matmul", device],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return float(done.stdout.strip().splitlines()[-1]), ""


def session_runs(setup: CheckSetup, workdir: Path) -> dict[str, Overrides]:
    """The session's runs beyond check_gpu's, by name (check_gpu's `runs` has the rest)."""
    common = [f"device={setup.device}", f"launcher.nproc_per_node={setup.ranks}", "wandb.mode=disabled"]
    vit = [*common, *VIT, f"train.steps={PARITY_STEPS}", "precision.tf32=false"]
    pinned = ["checkpoint=dcp_async_pinned", f"checkpoint.dir={workdir / 'pinned_checkpoints'}"]
    memory_gpt = [*common, *(setup.memory_gpt or setup.gpt), "sharding=full"]
    return {
        "estimate_vit": [*vit, "sharding=full", "task=estimate"],
        "estimate_resnet": [*common, *RESNET, "model.init_device=meta", "task=estimate"],
        "pinned_first_half": [*vit, "sharding=full", *pinned, "checkpoint.overwrite=true",
                              f"train.steps={PARITY_STEPS // 2}"],
        "pinned_resumed": [*vit, "sharding=full", *pinned, "resume=auto"],
        "tune": [*memory_gpt, "task=tune", f"memory.limit_gb={setup.limit_gb:g}", "task.space.sharding=[full,ddp]",
                 "task.space.train.activation_checkpointing=[false]", "task.space.offload=[false]",
                 "task.budget=4m", "task.search_up_to=64"],
    }


def session_checks(setup: CheckSetup, matmul: tuple[float | None, str]) -> list[Check]:
    tol = setup.tolerance
    return [
        Check("task=estimate against the run: the ViT", ("full", "estimate_vit"), estimated),
        Check("task=estimate against the run: ResNet, meta init + offload", ("resnet_meta_offload", "estimate_resnet"),
              estimated),
        Check("async pinned checkpoints: save and resume", ("full", "pinned_first_half", "pinned_resumed"),
              lambda a, b, c: resumes(a, b, c, tol)),
        Check("a short task=tune", ("tune",), tuned),
        Check("MFU against a bf16 matmul measured here", ("gpt",), lambda run: against_matmul(run, *matmul)),
    ]


def tuned(run: RunResult) -> tuple[bool, str]:
    """task=tune ended with a winner whose printed command line, run as printed, completed."""
    if problem := not_ok(run, "task=tune"):
        return False, problem
    s = run.summary
    detail = (f"winner {s.winner}, batch {s.batch_size}, {s.samples_per_s or 0:,.1f} samples/s as its command line "
              f"ran; {s.setups} setups, {s.probes} probes")
    return bool(s.winner) and bool(s.winner_confirmed), detail


def against_matmul(run: RunResult, matmul_tflops_measured: float | None, why: str) -> tuple[bool, str]:
    """The run's TFLOP/s a device against a bf16 matmul's on the same GPU: at most it (a
    training step does more than matmuls), and more than nothing; beside, MFU against the
    peak table."""
    if problem := not_ok(run):
        return False, problem
    if not matmul_tflops_measured:
        return False, f"the matmul was not measured: {why}"
    s = run.summary
    achieved = s.tflops_per_device or 0.0
    share = achieved / matmul_tflops_measured
    detail = (f"{achieved:.1f} TFLOP/s a device, {share:.0%} of a bf16 matmul's {matmul_tflops_measured:.1f} here; "
              f"MFU {s.mfu or 0:.1%} of the table's {s.peak_tflops or 0:g}")
    return 0 < share <= 1.05, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_exp.gpu_session", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="put the runs here and keep them")
    parser.add_argument("--out", type=Path, default=Path("gpu_session.json"), help="the JSON of every row")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: for development only, the session's plumbing on 2 CPU ranks with gloo")
    parser.add_argument("--matmul", choices=("cuda", "cpu"), help=argparse.SUPPRESS)  # the measuring process
    args = parser.parse_args(argv)
    if args.matmul:  # a CPU's: small enough to take a second
        print(matmul_tflops(torch.device(args.matmul), MATMUL_SIZE if args.matmul == "cuda" else 512, 5))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fsdp_exp.gpu_session: needs a GPU (torch.cuda.is_available() is False here); "
              "on a CPU, make test runs what can be checked", file=sys.stderr)
        return EXIT_NO_GPU
    gpus, smallest_gb = gpus_here()
    setup = setup_for(args.device, gpus, None, smallest_gb)
    workdir = (args.keep or Path(tempfile.mkdtemp(prefix="fsdp_exp_gpu_session_"))).resolve()
    print(title(setup).replace("fsdp_exp.check_gpu", "fsdp_exp.gpu_session"))
    machine = {"host": platform.node(), "gpus": gpus, "gpu": torch.cuda.get_device_name(0) if gpus else None,
               "gpu_memory_gb": smallest_gb if gpus else None}
    passed = session(setup, workdir, args.out, machine)
    if passed and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"\nthe runs' directories: {workdir}")
    return 0 if passed else EXIT_FAILED


def session(setup: CheckSetup, workdir: Path, out: Path, machine: dict, run=run_fsdp_exp,
            matmul: tuple[float | None, str] | None = None) -> bool:
    """Every row, printed as it ends, and the JSON of them all in `out`; whether all passed."""
    start = time.perf_counter()
    matmul = matmul or measure_matmul(setup.device)
    rows: list[dict] = []
    plan = {**runs(setup, workdir), **session_runs(setup, workdir)}
    passed = check_all(setup, workdir, run=run, plan=plan,
                       checks_run=[*checks(setup), *session_checks(setup, matmul)], rows=rows)
    wall = time.perf_counter() - start
    record = {"date": str(date.today()), **machine, "fsdp_exp": package_version(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "device": setup.device, "matmul_tflops": matmul[0], "wall_s": wall,
              "passed": passed, "rows": rows}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n{sum(r['result'] == 'pass' for r in rows)} of {len(rows)} rows passed in {wall / 60:.1f} min; "
          f"every row in {out.resolve()}")
    return passed

