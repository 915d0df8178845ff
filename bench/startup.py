"""Start-up: the time from the command to the end of the first training step, for
`python -m fsdp_exp` (its ranks forked from the rank server, and spawned) and for a bare
`torchrun` of the hand-written FSDP2 loop; then where fsdp_exp's start-up goes, and the
start-up of task=max_batch's probes.

Same model (default ViT), data, per-rank batch and ranks. The three run alternately,
`--reps` times each; the medians and their ratios to the hand loop are printed. The clock
starts just before the command is started and stops at the first step's end as the run
itself records it: `time` in metrics.jsonl's first record, `first_step_at` from the hand
loop. The breakdown is the run's own marks (summary.json's `startup`, see
fsdp_exp/metrics/startup.py). A probe's start-up is `startup_s` in max_batch.json: from its
launch to its first step's start.

    python bench/startup.py [--reps 5] [--batch-size 32] [--no-probes]
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
METHODS = ("forkserver", "spawn")
# (name, from mark, to mark): the parts of fsdp_exp's start-up; "start" is the command's
# start as this script saw it, "first_step" the end of the first step.
PARTS = [
    ("import", "start", "imported"),
    ("compose and check", "imported", "composed"),
    ("run directory, launch", "composed", "launched"),
    ("start the ranks", "launched", "rank_ready"),
    ("process group", "rank_ready", "process_group"),
    ("build", "process_group", "built"),
    ("sinks, checkpoint", "built", "ready"),
    ("first step (its FLOPs counted as it runs)", "ready", "first_step"),
]


def framework(batch_size: int, workdir: Path, method: str) -> dict[str, float]:
    """One run: its marks, from the command's start (0)."""
    out = Path(tempfile.mkdtemp(dir=workdir)) / "run"  # a fresh run directory: metrics.jsonl appends
    start = time.time()
    subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "train.steps=2", "train.log_every=1", f"train.batch_size={batch_size}",
         "wandb.mode=disabled", f"launcher.start_method={method}", f"hydra.run.dir={out}"],
        cwd=REPO, check=True, capture_output=True,
    )
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    marks = json.loads((out / "summary.json").read_text())["startup"]
    return {"start": 0.0, **{k: v - start for k, v in marks.items()}, "first_step": first["time"] - start}


def hand_loop(batch_size: int, nproc: int) -> float:
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         str(REPO / "bench" / "hand_loop.py"), "--steps=2", "--warmup=1", f"--batch-size={batch_size}"],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["first_step_at"] - start


def probes(workdir: Path, method: str) -> list[float]:
    """The start-up of every probe of one small task=max_batch search."""
    out = workdir / f"search-{method}"
    subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "task=max_batch", "memory.limit_gb=0.6", "model.num_layers=2",
         "task.resolution=64", "task.search_up_to=1024", "wandb.mode=disabled",
         f"launcher.start_method={method}", f"hydra.run.dir={out}"],
        cwd=REPO, check=True, capture_output=True,
    )
    record = json.loads((out / "max_batch.json").read_text())
    return [p["startup_s"] for p in record["probes"] if p.get("startup_s") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-probes", action="store_true", help="leave out task=max_batch's probes")
    args = parser.parse_args()
    nproc = default_ranks()
    print(header(nproc, torch.cuda.is_available()))
    print(f"default ViT, synthetic data, batch {args.batch_size}/rank, {args.reps} alternating reps\n")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    theirs: list[float] = []
    print(f"| rep | {' | '.join(f'fsdp_exp, {m} s' for m in METHODS)} | torchrun hand loop s |")
    print(f"| ---: | {' | '.join('---:' for _ in METHODS)} | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(1, args.reps + 1):
            for method in METHODS:
                runs[method].append(framework(args.batch_size, Path(tmp), method))
            theirs.append(hand_loop(args.batch_size, nproc))
            cells = " | ".join(f"{runs[m][-1]['first_step']:.2f}" for m in METHODS)
            print(f"| {rep} | {cells} | {theirs[-1]:.2f} |", flush=True)
        hand = statistics.median(theirs)
        medians = {m: statistics.median(r["first_step"] for r in runs[m]) for m in METHODS}
        cells = " | ".join(f"{medians[m]:.2f} ({medians[m] / hand:.2f}x)" for m in METHODS)
        print(f"| median (ratio to the hand loop) | {cells} | {hand:.2f} |")

        print(f"\nWhere fsdp_exp's start-up goes (medians over the reps, s)\n\n| part | {' | '.join(METHODS)} |")
        print(f"| --- | {' | '.join('---:' for _ in METHODS)} |")
        for name, start, end in PARTS:
            cells = " | ".join(f"{statistics.median(r[end] - r[start] for r in runs[m]):.2f}" for m in METHODS)
            print(f"| {name} | {cells} |")

        if not args.no_probes:
            print("\ntask=max_batch probes: start-up from launch to the first step (median, s)\n")
            print("| start method | probes | median s |\n| --- | ---: | ---: |")
            for method in METHODS:
                times = probes(Path(tmp), method)
                print(f"| {method} | {len(times)} | {statistics.median(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
