"""Waiting for data at an epoch's start: the share of each logged window the ranks waited for
their next batch (`host_data_wait_share`), in windows that hold an epoch's first step against
those that do not, and the samples/s of each, in the same runs.

A small data set (15 steps an epoch at the default batch) read by 2 DataLoader workers a
rank, so that the run crosses an epoch's start every other window:

    python bench/epoch_start.py [--reps 3] [--steps 40]
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
SAMPLES, LOG_EVERY = 960, 8


def run(steps: int, out: Path) -> tuple[list[dict], int]:
    """The run's logged windows, and its steps an epoch."""
    subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "model.num_layers=4", f"data.num_samples={SAMPLES}",
         "data.num_workers=2", f"train.steps={steps}", f"train.log_every={LOG_EVERY}",
         "wandb.mode=disabled", "memory.estimate=false", f"hydra.run.dir={out}"],
        cwd=REPO, check=True, capture_output=True,
    )
    summary = json.loads((out / "summary.json").read_text())
    per_epoch = SAMPLES // summary["global_batch_size"]  # each rank reads its share of both
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], per_epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(header(default_ranks(), torch.cuda.is_available()))
    waits: dict[bool, list[float]] = {True: [], False: []}
    speeds: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(1, args.reps + 1):
            windows, per_epoch = run(args.steps, Path(tmp) / str(rep))
            first = 1
            for window in windows:
                holds = any((step - 1) % per_epoch == 0 for step in range(max(first, 2), window["step"] + 1))
                waits[holds].append(window["host_data_wait_share"])
                speeds[holds].append(window["samples_per_s"])
                first = window["step"] + 1
            print(f"rep {rep}: " + "  ".join(
                f"{w['step']}:{w['samples_per_s']:.0f}/{100 * w['host_data_wait_share']:.1f}%" for w in windows), flush=True)
    print(f"{'windows':<22} {'count':>5} {'waiting (median)':>17} {'samples/s (median)':>19}")
    for holds in (True, False):
        print(f"{'with an epoch start' if holds else 'without':<22} {len(waits[holds]):>5} "
              f"{100 * statistics.median(waits[holds]):>16.1f}% {statistics.median(speeds[holds]):>19.1f}")
    print(f"ratio of waiting, with an epoch start / without: "
          f"{statistics.median(waits[True]) / statistics.median(waits[False]):.2f} (goal: about 1)")


if __name__ == "__main__":
    main()
