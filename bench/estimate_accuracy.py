"""task=estimate against the peaks real runs measure.

For each model and sharding, one `task=estimate` call predicts every batch size
(`task.batch_sizes`), and a real 2-rank training run at each size measures its peak as
memory.limit_gb counts it (`peak_under_limit_gb`, the larger rank), under a limit far above
the run's need (so glibc returns freed blocks and the peak is what the tensors and the
runtime hold). The table gives both and their ratio.

    python bench/estimate_accuracy.py              # gpt small and the ViT, 4 shardings, 3 sizes each
    python bench/estimate_accuracy.py --models vit
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
LIMIT = "memory.limit_gb=10"
MODELS = {
    "gpt-small": (["model=gpt", "model.size=small", "data=synthetic_tokens"], [1, 2, 4]),
    "vit": (["model=vit"], [32, 128, 512]),
}
SHARDINGS = {"full": ["sharding=full"], "grad_op": ["sharding=grad_op"], "ddp": ["sharding=ddp"],
             "full + offload": ["sharding=full", "offload=true"]}
COMMON = ["device=cpu", "launcher.nproc_per_node=2", "wandb.mode=disabled", LIMIT]


def fsdp_exp(overrides: list[str], out: Path) -> dict:
    """The run's summary.json, with the command's wall time."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "fsdp_exp", *COMMON, *overrides, f"hydra.run.dir={out}"],
                            cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(overrides)} (log: {out}/fsdp_exp.log)\n{result.stdout[-1500:]}{result.stderr[-1500:]}")
    return json.loads((out / "summary.json").read_text()) | {"command_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(header(2, on_gpu=False))
    rows = ["| model | sharding | batch | predicted GB | measured GB | predicted / measured | estimate s (3 sizes) | run s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, (model_overrides, sizes) in MODELS.items():
            if model not in args.models:
                continue
            for sharding, sharding_overrides in SHARDINGS.items():
                setup = [*model_overrides, *sharding_overrides]
                name = f"{model}-{sharding.replace(' + ', '-')}"
                estimated = fsdp_exp([*setup, "task=estimate", f"task.batch_sizes=[{','.join(map(str, sizes))}]"],
                         Path(tmp) / f"{name}-estimate")
                record = json.loads((Path(tmp) / f"{name}-estimate" / "estimate.json").read_text())
                predicted = {b["batch_size"]: b["predicted_peak_gb"] for b in record["batches"]}
                for size in sizes:
                    run = fsdp_exp([*setup, f"train.batch_size={size}", f"train.steps={args.steps}",
                                    "train.log_every=1", "metrics.warmup_steps=1"], Path(tmp) / f"{name}-b{size}")
                    measured = run["peak_under_limit_gb"]
                    ratio = predicted[size] / measured
                    ratios.append(ratio)
                    rows.append(f"| {model} | {sharding} | {size} | {predicted[size]:.3f} | {measured:.3f} | "
                                f"{ratio:.3f} | {estimated['command_s']:.0f} | {run['command_s']:.0f} |")
                    print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))
    worst = max(ratios, key=lambda r: abs(r - 1))
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    print(f"\n{within} of {len(ratios)} predictions within 10% of the measured peak; the farthest off: {worst:.3f}")


if __name__ == "__main__":
    main()
