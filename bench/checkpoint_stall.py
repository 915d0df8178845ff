"""Checkpoint stall: how long training is blocked per save, for checkpoint=dcp, dcp_async
and dcp_async_pinned.

Same model (a ViT made larger than the default, so that a save is measurable), data
(synthetic), per-rank batch, steps and save interval; the three modes run alternately,
`--reps` times each. Each run reports, in summary.json, `checkpoint_blocked_s`: the mean
over its saves of the training time lost to a save (the max over ranks). For dcp that is
the whole write; for dcp_async the copy to CPU memory; for dcp_async_pinned the dispatch
plus the wait for the background staging before the next optimizer step. The table gives
the median over reps, the median per-rep ratio to dcp, and steps/s (steady state, saves
included). Goal: each async mode blocks for at most 10% of dcp's time.

Checkpoints go to a temporary directory, removed afterwards.

`--breakdown` instead times the pieces of one save outside training, on the same model
sharded the same way over 2 gloo ranks (started by `torchrun`, after one optimizer step):
`get_state_dict`, the staging copy as dcp_async makes it (a new stager, so fresh CPU
memory each save), the same copy into reused buffers, only the bytes of it (a plain
`copy_` of each local shard into a reused tensor), and dcp's write (`dcp.save`). Each
`--reps` times; the median, the max over ranks.

    python bench/checkpoint_stall.py [--reps 3] [--steps 20] [--every 5] [--batch-size 8] [--num-layers 4]
    python bench/checkpoint_stall.py --breakdown [--reps 5] [--num-layers 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import default_ranks, header

REPO = Path(__file__).resolve().parent.parent
MODES = ("dcp", "dcp_async", "dcp_async_pinned")
GOAL = 0.10  # an async mode blocks for at most this share of dcp's time
TIMEOUT_S = 600  # one run; past it the run is taken to hang


def model_overrides(num_layers: int) -> list[str]:
    return ["model.hidden_dim=512", "model.mlp_dim=2048", f"model.num_layers={num_layers}", "model.num_heads=8"]


def run(mode: str, args: argparse.Namespace, out: Path) -> dict:
    """One training run with checkpoint=`mode`; its summary plus the size of one checkpoint."""
    command = [sys.executable, "-m", "fsdp_exp", f"checkpoint={mode}", f"checkpoint.every={args.every}",
               f"train.steps={args.steps}", f"train.batch_size={args.batch_size}",
               *model_overrides(args.num_layers), "wandb.mode=disabled", f"hydra.run.dir={out}"]
    try:
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        failed = isinstance(err, subprocess.CalledProcessError)
        what = f"exit {err.returncode}" if failed else f"no end after {TIMEOUT_S} s"
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        sys.exit(f"python {' '.join(command[1:])}: {what}\n{stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    newest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    summary["checkpoint_mb"] = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 1e6
    shutil.rmtree(out)
    return summary


def breakdown_worker(args: argparse.Namespace) -> None:
    """On each rank (under torchrun): time each piece of a save; rank 0 prints JSON."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchvision.models.vision_transformer import EncoderBlock

    from fsdp_exp.models.vit import build_vit

    dist.init_process_group("gloo")
    model = build_vit(image_size=28, patch_size=7, num_layers=args.num_layers, num_heads=8,
                      hidden_dim=512, mlp_dim=2048, num_classes=10)
    for block in [m for m in model.modules() if isinstance(m, EncoderBlock)]:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(args.batch_size, 1, 28, 28)).sum().backward()
    optimizer.step()  # so the optimizer state exists

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    leaves = [t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in leaves]
    reused = [t.clone() for t in local]
    persistent = DefaultStager(StagingOptions(False, False, False, False))
    persistent.stage(state)  # allocate its buffers once, as the persistent stager does on the first save

    def fresh_stager() -> None:
        stager = DefaultStager(StagingOptions(False, False, False, False))  # what dcp.async_save makes
        stager.stage(state)
        stager.close()

    def bytes_only() -> None:
        for dst, src in zip(reused, local):
            dst.copy_(src)

    root = [tempfile.mkdtemp(prefix="checkpoint_stall-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)  # one directory, rank 0's
    saves = iter(range(10**6))
    pieces = {
        "get_state_dict": lambda: get_state_dict(model, optimizer),
        "staging, new stager (dcp_async)": fresh_stager,
        "staging, reused buffers": lambda: persistent.stage(state),
        "of which bytes only (copy_)": bytes_only,
        "dcp.save (dcp: write and fsync)": lambda: dcp.save(state, checkpoint_id=Path(root[0]) / str(next(saves))),
    }
    medians = {}
    for name, piece in pieces.items():
        times = []
        for _ in range(args.reps):
            dist.barrier()
            start = time.perf_counter()
            piece()
            times.append(time.perf_counter() - start)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, statistics.median(times))
        medians[name] = max(gathered)
    dist.barrier()
    persistent.close()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0])
        mb = sum(t.numel() * t.element_size() for t in local) / 1e6
        print(json.dumps({"tensors": len(local), "mb_per_rank": mb, "seconds": medians}))
    dist.destroy_process_group()


def breakdown(args: argparse.Namespace, nproc: int) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", __file__, "--worker",
         f"--reps={args.reps}", f"--num-layers={args.num_layers}", f"--batch-size={args.batch_size}"],
        cwd=REPO, check=True, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"one save, per rank: {found['mb_per_rank']:.0f} MB in {found['tensors']} tensors (model and AdamW "
          f"state); median of {args.reps}, max over ranks\n")
    print("| piece | s |")
    print("| --- | ---: |")
    for name, seconds in found["seconds"].items():
        print(f"| {name} | {seconds:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="steps between saves")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--breakdown", action="store_true", help="time the pieces of one save instead (CPU)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        breakdown_worker(args)
        return
    nproc = default_ranks()

    print(header(nproc, torch.cuda.is_available()))
    if args.breakdown:
        breakdown(args, 2)
        return
    print(f"ViT {' '.join(model_overrides(args.num_layers))}, AdamW, synthetic data, batch "
          f"{args.batch_size}/rank, {args.steps} steps, a save every {args.every} steps and at the last, "
          f"{args.reps} alternating reps")
    print(f"{'rep':>3}  {'mode':<16}  {'saves':>5}  {'blocked s/save':>14}  {'steps/s':>7}", flush=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="checkpoint_stall-") as tmp:
        for rep in range(1, args.reps + 1):
            for mode in MODES:
                summary = run(mode, args, Path(tmp) / f"{mode}-{rep}")
                runs[mode].append(summary)
                print(f"{rep:>3}  {mode:<16}  {summary['checkpoint_saves']:>5}  "
                      f"{summary['checkpoint_blocked_s']:>14.4f}  {summary['steps_per_s']:>7.3f}", flush=True)

    sync = [s["checkpoint_blocked_s"] for s in runs["dcp"]]
    size = statistics.median(s["checkpoint_mb"] for s in runs["dcp"])
    print(f"\none checkpoint: {size:.0f} MB on disk (all ranks); ratio: median over reps of the "
          f"mode's blocked time / dcp's in the same rep\n")
    print("| mode | saves | blocked s per save (median) | ratio to dcp | steps/s (median) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    ratios = {}
    for mode in MODES:
        blocked = [s["checkpoint_blocked_s"] for s in runs[mode]]
        ratios[mode] = statistics.median(b / d for b, d in zip(blocked, sync))
        saves = {s["checkpoint_saves"] for s in runs[mode]}
        print(f"| {mode} | {'/'.join(map(str, sorted(saves)))} | {statistics.median(blocked):.4f} "
              f"({min(blocked):.4f}-{max(blocked):.4f}) | {ratios[mode]:.3f} | "
              f"{statistics.median(s['steps_per_s'] for s in runs[mode]):.3f} |")
    print()
    for mode in MODES[1:]:
        verdict = "meets" if ratios[mode] <= GOAL else "misses"
        print(f"{mode}: blocks {ratios[mode]:.1%} of dcp's time; {verdict} the goal (<= {GOAL:.0%})")


if __name__ == "__main__":
    main()
