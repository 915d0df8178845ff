"""`python -m fsdp_exp.check_gpu`: does fsdp_exp work on this machine's GPUs? A few minutes of real runs.

Each check runs `python -m fsdp_exp ...` as a user would, into a directory of its own, reads
the run's summary.json and metrics.jsonl, and prints one row: check, pass or fail, what it
saw, seconds. The checks are in fsdp_exp/commands/gpu_checks.py, how each is judged in gpu_judges.py.
Exit code 0 when every check passed, 1 when any failed, 2 without a GPU.

    python -m fsdp_exp.check_gpu                     # every GPU here, one rank each
    python -m fsdp_exp.check_gpu --peak-tflops 400   # a GPU not in the peak table: its dense bf16 peak
    python -m fsdp_exp.check_gpu --keep DIR          # keep the runs in DIR (kept anyway when a check fails)
    python -m fsdp_exp.check_gpu --device cpu        # development: the same checks on 2 CPU ranks (gloo)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from fsdp_exp.commands.gpu_checks import TORCHRUN, CheckSetup, checks, runs, setup_for
from fsdp_exp.commands.gpu_judges import RunResult
from fsdp_exp.errors import one_line
from fsdp_exp.metrics.environment import package_version
from fsdp_exp.metrics.sinks import METRICS, JsonLines
from fsdp_exp.metrics.summary import Summary

RUN_TIMEOUT_S = 900
EXIT_FAILED, EXIT_NO_GPU = 1, 2
# The variables a launcher sets for a rank: a check started inside a torchrun or SLURM job
# must start runs of its own, not act as one of that job's ranks.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "GROUP_RANK", "ROLE_")


def command(overrides: list[str], out: Path) -> list[str]:
    """`python -m fsdp_exp <overrides>`; a run whose first word is `torchrun:--nproc_per_node=N`
    runs under an external torchrun of N processes on this machine instead."""
    if overrides and overrides[0].startswith(TORCHRUN):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", overrides[0][len(TORCHRUN):],
                "-m", "fsdp_exp", *overrides[1:], f"hydra.run.dir={out}"]
    return [sys.executable, "-m", "fsdp_exp", *overrides, f"hydra.run.dir={out}"]


def run_fsdp_exp(overrides: list[str], out: Path, timeout_s: float = RUN_TIMEOUT_S) -> RunResult:
    """One run into `out`, in a session of its own, so that a run past its time is ended
    with all its ranks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(RANK_VARIABLES)}
    env["WANDB_MODE"] = "disabled"
    env["FSDP_EXP_CACHE"] = str(out.parent / "cache")  # the runs' own estimates: this session's traces (estimate_* first)
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: a kept directory's old run must go
    out.parent.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(command(overrides, out), cwd=out.parent, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except BaseException as err:  # past its time, or Ctrl-C (which the run's own session does not get)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if not isinstance(err, subprocess.TimeoutExpired):
                raise
            return RunResult(out, None, {}, [], f"still running after {timeout_s:g} s, ended")
    return read_run(out, stderr)


def read_run(out: Path, stderr: str = "") -> RunResult:
    """A finished run as its files show it: the summary, the loss at each step (the last
    record of a step counts, as after a resume), and the full weights when exported."""
    summary = Summary.read(out)
    records = [r for r in JsonLines.read(out / METRICS) if "loss" in r]
    weights = None
    if (out / "model.safetensors").is_file():
        from safetensors.torch import load_file

        weights = load_file(out / "model.safetensors")
    error = (summary or {}).get("error") or next(iter(stderr.strip().splitlines()[-1:]), "")
    return RunResult(out, summary, {r["step"]: r["loss"] for r in records}, records, error, weights)


def title(setup: CheckSetup) -> str:
    where = (f"{setup.ranks} GPU(s) visible, one rank each (nccl)" if setup.device == "cuda" else
             f"CPU, {setup.ranks} gloo ranks: a development run of the checks, which says nothing of a GPU")
    return (f"fsdp_exp.check_gpu  {date.today()}  {platform.node()}  fsdp_exp {package_version() or '-'}  "
            f"torch {torch.__version__}  CUDA {torch.version.cuda or '-'}  {where}")


def table_row(*cells: object) -> str:
    return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"


TABLE_HEAD = table_row("check", "result", "detail", "s") + "\n" + table_row("---", "---", "---", "---:")


def check_all(setup: CheckSetup, workdir: Path, run=run_fsdp_exp, out=print, plan: dict | None = None,
              checks_run: list | None = None, rows: list | None = None) -> bool:
    """Run every check in order (check_gpu's, or `checks_run` on the runs of `plan`),
    printing its row as it ends, and adding it to `rows`; whether all passed. A run two
    checks read (the GPT run: MFU and the device) runs once."""
    plan, done, all_passed = plan if plan is not None else runs(setup, workdir), {}, True
    to_check = checks_run if checks_run is not None else checks(setup)

    # A run's own estimate (memory.estimate) is traced only where a check reads it, and there
    # its setup's task=estimate runs first (below): any other run's trace, held through its
    # timed steps, could end after the run, which would wait for it.
    read_against = {n for check in to_check if any(r.startswith("estimate") for r in check.runs) for n in check.runs}

    def run_once(name: str) -> None:
        if name not in done:
            overrides = plan[name](done) if callable(plan[name]) else plan[name]
            if overrides is not None and name not in read_against:
                overrides = [*overrides, "memory.estimate=false"]
            done[name] = (run(overrides, workdir / name) if overrides is not None else
                          RunResult(workdir / name, None, {}, [], "not run: the run it follows did not finish"))

    # task=estimate first (seconds each): a run of the same setup then has its own estimate at
    # once (fsdp_exp.estimate.earlier), where its trace beside it could end after it
    for name in dict.fromkeys(n for check in to_check for n in check.runs if n.startswith("estimate")):
        run_once(name)
    out(TABLE_HEAD)
    for check in to_check:
        start = time.perf_counter()
        for name in check.runs:
            run_once(name)
        try:
            passed, detail = check.judge(*(done[name] for name in check.runs))
        except Exception as err:  # noqa: BLE001 - a summary the judge did not expect is a failed check, not a crash
            passed, detail = False, f"could not judge the run: {one_line(err, named=True, whole=True)}"
        all_passed &= passed
        seconds = time.perf_counter() - start
        out(table_row(check.name, "pass" if passed else "fail", detail, f"{seconds:.0f}"))
        if rows is not None:
            rows.append({"check": check.name, "result": "pass" if passed else "fail", "detail": detail, "s": seconds})
        sys.stdout.flush()
    return all_passed


def gpus_here() -> tuple[int, float]:
    """The GPUs this machine shows, and the memory of the smallest (80 GB where there are none)."""
    gpus = torch.cuda.device_count()
    return gpus, min((torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(gpus)), default=80.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_exp.check_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, where the table has none")
    parser.add_argument("--keep", type=Path, help="put the runs here and keep them")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: for development only, the same checks on 2 CPU ranks with gloo")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("fsdp_exp.check_gpu: no GPU here (torch.cuda.is_available() is False), so nothing to check",
              file=sys.stderr)
        return EXIT_NO_GPU
    gpus, smallest_gb = gpus_here()
    setup = setup_for(args.device, gpus, args.peak_tflops, smallest_gb)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fsdp_exp_check_gpu_"))
    print(title(setup))
    passed = check_all(setup, workdir.resolve())
    if passed and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"\nthe runs' directories (logs, summary.json, metrics.jsonl): {workdir.resolve()}")
    print("\nall checks passed" if passed else "\nsome checks FAILED: please send this output with the run directories' "
          "rank logs in a bug report")
    return 0 if passed else EXIT_FAILED

