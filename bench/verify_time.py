"""task=max_batch's wall time split into probing and verifying, and whether the verifying
grows with train.steps: each setup searched twice into fresh run directories, with
`train.steps=50` and with `train.steps=5000`, the command as a user types it.

The table: per search, the probes' and the verification's seconds (max_batch.json's
`probe_wall_s` and `verify_wall_s`: every run of the command, which also measures what a run
holds beyond a probe), the steps each run of the command trained (`*`: a probe run as the
command, at the size the search expected to answer, whose seconds are probing), the answer,
and the ratio verifying / probing (goal: at most 1, and the same for both train.steps).

    python bench/verify_time.py                 # every setup
    python bench/verify_time.py vit             # some of them
    python bench/verify_time.py --steps 50 5000 # the train.steps to compare
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import header

REPO = Path(__file__).resolve().parent.parent

SETUPS = {
    "vit": ["memory.limit_gb=0.8"],  # the README's example
    "cnn": ["model=cnn", "memory.limit_gb=2"],
    "gpt2-small": ["model=gpt", "model.size=small", "data=synthetic_tokens", "memory.limit_gb=3"],
    # not one of the repository's models: the example project's own net, from its config folder,
    # made wide enough, and its data large enough, that memory bounds the search, not the data
    "my_project": ["model=mynet", "hydra.searchpath=[file://./conf]", "model.width=512", "model.depth=8",
                   "data.num_samples=65536", "memory.limit_gb=0.8"],
}
CWD = {"my_project": REPO / "examples" / "my_project"}


def search(name: str, train_steps: int, out: Path) -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "fsdp_exp", "task=max_batch", *SETUPS[name],
                             f"train.steps={train_steps}", "wandb.mode=disabled", f"hydra.run.dir={out}"],
                            cwd=CWD.get(name, REPO), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name}, train.steps={train_steps}: exit {result.returncode}\n{result.stderr[-2000:]}")
    record = json.loads((out / "max_batch.json").read_text())
    runs = (record["verification"] or {}).get("runs", [])
    steps = [(f"{r.get('steps')}*" if r.get("as_command") else r.get("steps")) if r.get("status") == "ok"
             else r.get("status") for r in runs]
    return {"wall_s": wall, "probe_s": record["probe_wall_s"], "verify_s": record["verify_wall_s"],
            "probes": record["probe_count"], "answer": record["max_batch_size"], "run_steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("setups", nargs="*", default=list(SETUPS))
    parser.add_argument("--steps", nargs="+", type=int, default=[50, 5000])
    args = parser.parse_args()
    print(header(2, False))
    print(f"{'setup':<11} {'train.steps':>11} {'wall s':>7} {'probes':>6} {'probing s':>9} {'verifying s':>11} "
          f"{'verify/probe':>12} {'answer':>6}  runs of the command (steps)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups:
            for steps in args.steps:
                row = search(name, steps, Path(tmp) / f"{name}_{steps}")
                ratio = row["verify_s"] / row["probe_s"] if row["probe_s"] else float("nan")
                print(f"{name:<11} {steps:>11} {row['wall_s']:>7.0f} {row['probes']:>6} {row['probe_s']:>9.0f} "
                      f"{row['verify_s']:>11.0f} {ratio:>12.2f} {row['answer']:>6}  {row['run_steps']}", flush=True)


if __name__ == "__main__":
    main()
