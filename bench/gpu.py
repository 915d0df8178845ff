"""The GPU benchmarks of docs/BENCHMARKS.md.

- throughput, on one GPU: `model=gpt model.size=medium` and `large`, bf16, 1024-token
  sequences of GPT-2's vocabulary, with `train.compile` off and on, run alternately;
  tokens/s and MFU, and the compile speed-up as a ratio within each rep.
- blog: the FSDP blog's max-batch table under `memory.limit_gb=24` per GPU: `model.size=large`
  and `xl` under `sharding=ddp`, `full` and `full` + `offload=true`, fp32 as the blog ran;
  the largest batch per rank and the samples/s at it (task=max_batch). It runs on 2 ranks,
  as the blog did, when there are 2 GPUs. On 1 GPU `full` shards nothing and `ddp` has no
  one to talk to, so the table there is 1 rank of `sharding=none` against `full` +
  `offload=true` (offload still moves the parameters, gradients and optimizer state off the
  GPU), and says so.

    python bench/gpu.py [--part throughput|blog|all] [--sizes large xl] [--reps 2]
    python bench/gpu.py --smoke   # the same commands on CPU with gpt tiny (blog: 2 gloo ranks): checks the plumbing only

Every figure comes from a run's summary.json or max_batch.json, as `python -m fsdp_exp`
writes them. The tables print as Markdown, after the benchmarks' header line.
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
from machine import header

REPO = Path(__file__).resolve().parent.parent
TOKENS = ["model=gpt", "data=synthetic_tokens", "data.vocab_size=50257", "wandb.mode=disabled"]
BLOG_SETUPS = {"ddp": ["sharding=ddp"], "full": ["sharding=full"], "full + offload": ["sharding=full", "offload=true"]}
# On one rank `full` shards nothing and `ddp` reduces with no one: the rows that still mean something.
BLOG_SETUPS_ONE_RANK = {"none": ["sharding=none"], "full + offload": ["sharding=full", "offload=true"]}


def fsdp_exp(overrides: list[str], out: Path) -> Path:
    """One `python -m fsdp_exp` run into `out`; a failed run stops the benchmark with its error."""
    result = subprocess.run([sys.executable, "-m", "fsdp_exp", *overrides, f"hydra.run.dir={out}"],
                            cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"failed: python -m fsdp_exp {' '.join(overrides)}\n{result.stderr[-2000:]}")
    return out


def throughput(sizes: list[str], seq_len: int, batch_size: int, steps: int, reps: int, extra: list[str],
               workdir: Path) -> None:
    print(f"\nGPT, bf16, {seq_len}-token sequences, batch {batch_size}/rank, {steps} steps (5 warm-up), "
          f"{reps} alternating reps\n")
    print("| size | rep | compile | tokens/s | MFU | step s | peak GB | compile / eager |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        ratios = []
        for rep in range(1, reps + 1):
            tokens = {}
            for compiled in (False, True):
                out = fsdp_exp([*TOKENS, "launcher.nproc_per_node=1", f"model.size={size}", "precision=bf16",
                                f"train.compile={str(compiled).lower()}",
                                f"data.seq_len={seq_len}", f"model.block_size={seq_len}",
                                f"train.batch_size={batch_size}", f"train.steps={steps}", "metrics.warmup_steps=5",
                                f"train.log_every={steps}", *extra], workdir / f"{size}-{rep}-{compiled}")
                s = json.loads((out / "summary.json").read_text())
                tokens[compiled] = s["tokens_per_s"]
                mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "-"
                ratio = f"{tokens[True] / tokens[False]:.3f}" if compiled else ""
                print(f"| {size} | {rep} | {'on' if compiled else 'off'} | {s['tokens_per_s']:,.0f} | {mfu} "
                      f"| {s['step_time_s']:.4f} | {s['peak_mem_gb']:.2f} | {ratio} |", flush=True)
            ratios.append(tokens[True] / tokens[False])
        print(f"| {size} | median | | | | | | **{statistics.median(ratios):.3f}** |")


def blog_setups(ranks: int) -> tuple[dict[str, list[str]], str]:
    """The blog table's rows on `ranks` ranks, and what the table's title says of them."""
    if ranks >= 2:
        return BLOG_SETUPS, f"{ranks} ranks"
    return BLOG_SETUPS_ONE_RANK, ("1 rank (one GPU): sharding=full would shard nothing and ddp would reduce "
                                  "with no one, so only the unsharded run and full + offload")


def blog(sizes: list[str], seq_len: int, limit_gb: float, search_up_to: int, ranks: int, extra: list[str],
         workdir: Path) -> None:
    setups, ranks_text = blog_setups(ranks)
    print(f"\nFSDP blog table: largest batch per rank under memory.limit_gb={limit_gb:g} per rank, fp32, "
          f"{seq_len}-token sequences, samples/s at that batch (all ranks), on {ranks_text}\n")
    print("| size | setup | ranks | max batch | bounded by | samples/s | peak GB | probes |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for size in sizes:
        for name, setup in setups.items():
            out = fsdp_exp([*TOKENS, f"launcher.nproc_per_node={ranks}", "task=max_batch", f"model.size={size}",
                            "precision=fp32", *setup,
                            f"data.seq_len={seq_len}", f"model.block_size={seq_len}",
                            f"memory.limit_gb={limit_gb}", f"task.search_up_to={search_up_to}", *extra],
                           workdir / f"blog-{size}-{name.replace(' + ', '-')}")
            r = json.loads((out / "max_batch.json").read_text())
            size_text = "none fits" if r["max_batch_size"] is None else r["max_batch_size"]
            speed = f"{r['samples_per_s']:,.1f}" if r["samples_per_s"] else "-"
            peak = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "-"
            print(f"| {size} | {name} | {ranks} | {size_text} | {r['bounded_by'] or '-'} | {speed} | {peak} "
                  f"| {r['probe_count']} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("throughput", "blog", "all"), default="all")
    parser.add_argument("--sizes", nargs="+", choices=("small", "medium", "large", "xl"),
                        help="model sizes (default: medium large for throughput, large xl for blog)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="gpt tiny on CPU: checks the commands, not the speed")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        sys.exit("bench/gpu.py: needs a GPU (torch.cuda.is_available() is False); --smoke runs it on CPU with gpt tiny")

    if args.smoke:
        sizes, seq_len, limit_gb, search_up_to = ["tiny"], 128, 1.0, 64
        batch_size, steps, reps = 4, 8, 1
        extra = ["device=cpu", "task.steps_per_probe=2"]
    else:
        sizes, seq_len, limit_gb, search_up_to = args.sizes, 1024, 24.0, 4096
        batch_size, steps, reps, extra = args.batch_size, args.steps, args.reps, []
    # The blog ran 2 GPUs; 2 gloo ranks on CPU, so the smoke run takes the 2-rank path too.
    blog_ranks = 2 if args.smoke or torch.cuda.device_count() >= 2 else 1
    gpus = f"  ({torch.cuda.device_count()} GPUs here)" if on_gpu else ""
    print(header(1, on_gpu) + gpus + ("  (smoke: gpt tiny on CPU, figures mean nothing)" if args.smoke else ""))
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("throughput", "all"):
            throughput(sizes or ["medium", "large"], seq_len, batch_size, steps, reps, extra, Path(tmp))
        if args.part in ("blog", "all"):
            blog(sizes or ["large", "xl"], seq_len, limit_gb, search_up_to, blog_ranks, extra, Path(tmp))


if __name__ == "__main__":
    main()
