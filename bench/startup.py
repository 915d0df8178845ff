"""Start-up: the time from the command to the end of the first training step, for
`python -m fsdp_exp` and for a bare `torchrun` of the hand-written FSDP2 loop.

Same model (default ViT), data, per-rank batch and ranks. The two run alternately,
`--reps` times each; the medians and their ratio are printed. The clock starts just
before the command is started and stops at the first step's end as the run itself
records it: `time` in metrics.jsonl's first record, `first_step_at` from the hand loop.

    python bench/startup.py [--reps 5] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import default_ranks, header

REPO = Path(__file__).resolve().parent.parent


def framework(batch_size: int, workdir: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=workdir)) / "run"  # a fresh run directory: metrics.jsonl appends
    start = time.time()
    subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "train.steps=2", "train.log_every=1", f"train.batch_size={batch_size}",
         "wandb.mode=disabled", f"hydra.run.dir={out}"],
        cwd=REPO, check=True, capture_output=True,
    )
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return first["time"] - start


def hand_loop(batch_size: int, nproc: int) -> float:
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         str(REPO / "bench" / "hand_loop.py"), "--steps=2", "--warmup=1", f"--batch-size={batch_size}"],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["first_step_at"] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    nproc = default_ranks()
    print(header(nproc, torch.cuda.is_available()))
    print(f"default ViT, synthetic data, batch {args.batch_size}/rank, {args.reps} alternating reps")
    print(f"{'rep':>3}  {'fsdp_exp s':>10}  {'torchrun hand loop s':>20}  {'ratio':>6}")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(1, args.reps + 1):
            ours.append(framework(args.batch_size, Path(tmp)))
            theirs.append(hand_loop(args.batch_size, nproc))
            print(f"{rep:>3}  {ours[-1]:>10.2f}  {theirs[-1]:>20.2f}  {ours[-1] / theirs[-1]:>6.2f}", flush=True)
    print(f"median: fsdp_exp {statistics.median(ours):.2f} s, hand loop {statistics.median(theirs):.2f} s, "
          f"ratio {statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()
