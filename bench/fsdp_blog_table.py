"""The FSDP blog's table, predicted by task=estimate: GPT-2 large and XL on 2 x 24 GB GPUs.

Hugging Face's "Accelerate Large Model Training using PyTorch Fully Sharded Data Parallel"
(2022) trained GPT-2 large (762M) and XL (1.5B) with `run_clm_no_trainer.py` on 2 Titan RTX
(23.65 GiB each), fp32 and AdamW, under DDP and FSDP1 FULL_SHARD with `min_num_params: 2000`,
with and without `offload_params`, and tried batch sizes until one fit. This predicts the
largest batch per GPU for the same setups without a GPU: `task.gpu=23.65` (a GPU of that
memory), `task.world_size=2`, FSDP2 with `sharding.wrap=size
sharding.min_params=2000`. The blog printed `--block_size 12`, but its command has no line
continuation before that flag, so the shell ran the script without it: block size 1024
(GPT-2's context), as run_clm_no_trainer.py then takes. Both are predicted.

For each row, one estimate traces batch 1, 128 and 512, then the sizes around where the line
through two of them meets the limit, until the largest size that fits and the next are both
traced: the answer is exact for the estimate, not read off a line.

    python bench/fsdp_blog_table.py                  # both models, both block sizes
    python bench/fsdp_blog_table.py --models large --block-sizes 12
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
LIMIT_GB = 23.65  # a Titan RTX, as the blog's out-of-memory message gives it
MODELS = {"large": "gpt2_large", "xl": "gpt2_xl"}
SETUPS = {
    "DDP": ["sharding=ddp"],
    "FSDP": ["sharding=full", "sharding.wrap=size", "sharding.min_params=2000"],
    "FSDP + offload": ["sharding=full", "sharding.wrap=size", "sharding.min_params=2000", "offload=true"],
}
# The blog's "Batch Size Max" per GPU on 2 GPUs (0: out of memory at batch 1).
BLOG = {("large", "DDP"): 7, ("large", "FSDP"): 15, ("large", "FSDP + offload"): 22,
        ("xl", "DDP"): 0, ("xl", "FSDP"): 5, ("xl", "FSDP + offload"): 14}
COMMON = ["hydra.searchpath=[file://bench/conf]", "task=estimate", f"task.gpu={LIMIT_GB}", "task.world_size=2",
          "precision=fp32", "data=synthetic_tokens", "data.vocab_size=50257", "wandb.mode=disabled"]


def estimate(overrides: list[str], sizes: list[int], out: Path) -> list[dict]:
    """The estimate's batches (batch_size, device_used_gb: what the GPU would hold, the allocator's
    reserved memory and the CUDA context and NCCL beside it)."""
    result = subprocess.run([sys.executable, "-m", "fsdp_exp", *COMMON, *overrides,
                             f"task.batch_sizes=[{','.join(map(str, sizes))}]", f"hydra.run.dir={out}"],
                            cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)}: {result.stderr.strip().splitlines()[-1]}")
    return json.loads((out / "estimate.json").read_text())["batches"]


def predicted_max(overrides: list[str], scratch: Path) -> tuple[int, dict[int, float], int]:
    """(the largest batch predicted to fit, the device GB of every size traced, estimate calls)."""
    seen: dict[int, float] = {}
    calls = 0

    def trace(sizes: list[int]) -> None:
        nonlocal calls
        calls += 1
        for b in estimate(overrides, sizes, scratch / f"call{calls}"):
            seen[b["batch_size"]] = b["device_used_gb"]

    trace([1, 128, 512])  # past the knee at 128 and 512 the peak grows by a fixed amount a sample
    while calls < 10:
        fit = max((b for b, gb in seen.items() if gb <= LIMIT_GB), default=0)
        over = min((b for b, gb in seen.items() if gb > LIMIT_GB), default=None)
        if fit == 0 or over == fit + 1:
            return fit, seen, calls
        a, b = (fit, over) if over is not None and fit > 1 else sorted(seen)[-2:]
        slope = (seen[b] - seen[a]) / (b - a)
        guess = int(a + (LIMIT_GB - seen[a]) / slope) if slope > 0 else 8 * b
        guess = max(fit + 1, min(guess, 8 * b, (over or 10**9) - 1))
        trace(sorted({guess - 1, guess, guess + 1} - set(seen) - {0}))
    raise SystemExit(f"{' '.join(overrides)}: no exact answer after {calls} estimate calls: {seen}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--block-sizes", nargs="*", type=int, default=[12, 1024])
    args = parser.parse_args()
    print(header(2, False))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for setup, overrides in SETUPS.items():
                cells = []
                for block in args.block_sizes:
                    start = time.perf_counter()
                    found, seen, calls = predicted_max([f"model={MODELS[model]}", f"data.seq_len={block}", *overrides],
                                                       Path(tmp) / f"{model}-{setup}-{block}".replace(" ", ""))
                    wall = time.perf_counter() - start
                    at = seen.get(found) if found else seen.get(1)
                    cells.append(f"{found or 'OOM at 1'} ({at:.2f} GB)")
                    print(f"GPT-2 {model}, {setup}, block {block}: {found} ({calls} estimate calls, {wall:.0f} s); "
                          f"device GB by batch: {json.dumps({b: round(gb, 3) for b, gb in sorted(seen.items())})}",
                          flush=True)
                blog = BLOG[(model, setup)]
                rows.append(f"| GPT-2 {model} | {setup} | {blog or 'OOM at 1'} | " + " | ".join(cells) + " |")
    print("\n| model | setup | blog (FSDP1, 2022) | " + " | ".join(f"predicted, block {b} (device GB at it)"
                                                            for b in args.block_sizes) + " |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in args.block_sizes) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
