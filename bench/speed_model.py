"""task=estimate's samples/s, calibrated by a tune, against training runs of the same setups.

1. A tune on the model (its speed model fitted to its probes on this machine): the calibration.
2. For each sharding and batch size: a training run (`python -m fsdp_exp ... train.steps=N`
   under the tune's `memory.limit_gb`, as the tune's command lines run; its summary's
   samples/s over its timed steps) and `task=estimate` of the same setup with
   `task.calibration=<the tune>` (its predicted samples/s at that batch).

The table: each setup's measured and predicted samples/s, and the error; then the median
and the largest. Runs alternate with the estimates, so a drift of the machine falls on both.

    python bench/speed_model.py                      # the CNN
    python bench/speed_model.py --model vit          # the 2-layer ViT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import header

MODELS = {"cnn": (["model=cnn"], 0.6), "vit": (["model.num_layers=2"], 0.6)}
SPACE = ["task.space.sharding=[full,grad_op,ddp]", "task.space.train.activation_checkpointing=[false]"]


def fsdp_exp(args: list[str], cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "fsdp_exp", *args, "wandb.mode=disabled", "memory.estimate=false"],
                          cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    out = next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))
    return json.loads((cwd / out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--batches", default="32,128,192", help="per-rank batch sizes to run and predict")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    overrides, limit = MODELS[args.model]
    print(header(2, False))
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        fsdp_exp(["task=tune", *overrides, f"memory.limit_gb={limit}", *SPACE, "hydra.run.dir=tune"], cwd)
        model = json.loads((cwd / "tune" / "tune.json").read_text())["speed_model"]
        print(f"calibration: {model['runs']} probes of {model['setups']} setups, held-out error {model['error']:.0%}")
        for sharding in ("full", "grad_op", "ddp"):
            for batch in (int(b) for b in args.batches.split(",")):
                name = f"{sharding}-{batch}"
                # under the tune's limit, as its command lines run: on a CPU the limit costs speed
                run = fsdp_exp([*overrides, f"sharding={sharding}", f"train.batch_size={batch}",
                                f"train.steps={args.steps}", f"memory.limit_gb={limit}", f"hydra.run.dir=run-{name}"],
                               cwd)
                est = fsdp_exp(["task=estimate", *overrides, f"sharding={sharding}", f"train.batch_size={batch}",
                                "task.calibration=tune", f"hydra.run.dir=estimate-{name}"], cwd)
                measured, predicted = run["samples_per_s"], est["predicted_samples_per_s"]
                errors.append(abs(predicted / measured - 1))
                rows.append(f"| sharding={sharding} | {batch} | {measured:,.1f} | {predicted:,.1f} | "
                            f"{predicted / measured - 1:+.0%} |")
                print(rows[-1], flush=True)
    errors.sort()
    print("| setup | batch | measured samples/s | predicted | error |\n|---|---|---|---|---|\n" + "\n".join(rows))
    print(f"median error {errors[len(errors) // 2]:.0%}, largest {errors[-1]:.0%}")


if __name__ == "__main__":
    main()
