"""Framework overhead: `python -m fsdp_exp` against a hand-written FSDP2 loop.

Same model (default ViT), data (synthetic), per-rank batch, steps and warm-up; the two
run alternately, `--reps` times each, the one that goes first swapping every rep (so a
machine that speeds up or slows down over the run favours neither), and the median steps/s
ratio is printed. Steps/s is timed the same way in both: from the end of the warm-up steps
to the last step.

    python bench/overhead.py [--reps 3] [--steps 60] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from machine import default_ranks, header

REPO = Path(__file__).resolve().parent.parent


def framework(steps: int, batch_size: int, warmup: int, workdir: Path) -> float:
    out = workdir / "run"
    subprocess.run(
        [sys.executable, "-m", "fsdp_exp", f"train.steps={steps}", f"train.batch_size={batch_size}",
         f"metrics.warmup_steps={warmup}", "wandb.mode=disabled", f"hydra.run.dir={out}"],
        cwd=REPO, check=True, capture_output=True,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    return summary["steps_per_s"]


def hand_loop(steps: int, batch_size: int, warmup: int, nproc: int) -> float:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         str(REPO / "bench" / "hand_loop.py"), f"--steps={steps}", f"--batch-size={batch_size}",
         f"--warmup={warmup}"],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["steps_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    nproc = default_ranks()

    print(header(nproc, torch.cuda.is_available()))
    print(f"default ViT, synthetic data, batch {args.batch_size}/rank, {args.steps} steps "
          f"({args.warmup} warm-up), {args.reps} alternating reps")
    print(f"{'rep':>3}  {'fsdp_exp steps/s':>16}  {'hand loop steps/s':>17}  {'ratio':>6}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(1, args.reps + 1):
            if rep % 2:
                ours = framework(args.steps, args.batch_size, args.warmup, Path(tmp))
                theirs = hand_loop(args.steps, args.batch_size, args.warmup, nproc)
            else:
                theirs = hand_loop(args.steps, args.batch_size, args.warmup, nproc)
                ours = framework(args.steps, args.batch_size, args.warmup, Path(tmp))
            ratios.append(ours / theirs)
            print(f"{rep:>3}  {ours:>16.3f}  {theirs:>17.3f}  {ratios[-1]:>6.3f}", flush=True)
    print(f"median ratio fsdp_exp / hand loop: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}; goal: >= 0.97)")


if __name__ == "__main__":
    main()
