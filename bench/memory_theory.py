"""Memory against theory: each rank's measured peak against what the sharding should hold.

For `full`, `grad_op`, `ddp` and `full` + `offload=true` on 2 ranks, `python -m fsdp_exp`
trains a GPT (fp32, AdamW) and reports every rank's peak resident memory. The runs are
under a generous `memory.limit_gb`, which makes glibc map every block over 64 KiB from
the kernel and return it on free, so the peak is what the tensors hold (the same run
without a limit is shown too: there glibc's heap keeps freed blocks). The same run with
`model.size=tiny` gives the memory that is not the model's (torch, gloo, the data): its
peak less its own theory. The rest is set against two figures:

- the issue's formula: (params + grads + optimizer state) / shards + activations;
- the formula plus what FSDP2 and DDP hold on top: unsharded parameters and gradients
  of the unit being computed (for `grad_op`, every unit's parameters after forward),
  DDP's gradient buckets, and the one temporary list AdamW's step allocates.

Activations are counted, not estimated: the tensors the plain model saves for backward
at the per-rank batch (parameters left out), through saved-tensors hooks.

    python bench/memory_theory.py [--size small] [--batch-size 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import header

from fsdp_exp.models import build_model

REPO = Path(__file__).resolve().parent.parent
MB = 2**20
RANKS = 2
LIMIT = ["memory.limit_gb=10"]  # far above what any run here needs
FP32 = 4
ADAMW_MOMENTS = 2
VARIANTS = {"full": ["sharding=full"], "grad_op": ["sharding=grad_op"], "ddp": ["sharding=ddp"],
            "full + offload": ["sharding=full", "offload=true"]}


@dataclass
class Shape:
    """Parameter counts of one model: all of it, the root unit (what no block holds) and
    the largest block; and the bytes of activations saved for backward at one batch."""
    params: int
    root: int
    block: int
    activations: int


def shape(size: str, batch_size: int, seq_len: int) -> Shape:
    cfg = {"_target_": "fsdp_exp.models.gpt.build_gpt", "size": size, "vocab_size": 50257, "block_size": 1024,
           "dropout": 0.0, "blocks": ["fsdp_exp.models.gpt.Block"], "init_device": "cpu"}
    torch.manual_seed(0)
    model, blocks = build_model(cfg)
    in_blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, blocks)]
    params = sum(p.numel() for p in model.parameters())
    return Shape(params, params - sum(in_blocks), max(in_blocks), saved_activation_bytes(model, batch_size, seq_len))


def saved_activation_bytes(model: torch.nn.Module, batch_size: int, seq_len: int) -> int:
    """Bytes of the distinct tensors autograd keeps for backward, parameters excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, 256, (batch_size, seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    del loss
    return sum(kept.values())


def theory(variant: str, s: Shape) -> dict[str, float]:
    """Bytes per rank: the formula's terms, and what the sharding holds on top."""
    shards = 1 if variant == "ddp" else RANKS
    params, grads, optimizer = FP32 * s.params, FP32 * s.params, ADAMW_MOMENTS * FP32 * s.params
    formula = (params + grads + optimizer) / shards + s.activations
    if variant == "ddp":
        extra = grads  # the reducer's flat buckets: a second copy of the gradients
    elif variant == "grad_op":
        extra = params + FP32 * s.block  # every unit stays unsharded from forward to backward, plus one unit's grads
    else:
        # The root unit (embedding, tied head, final norm) stays unsharded from forward to
        # backward; one block is unsharded and the next prefetched; one block's full grads
        # wait for their reduce-scatter.
        extra = FP32 * (s.root + 2 * s.block + s.block)
    # AdamW's step (foreach): one new list the size of this rank's parameters, while
    # activations and unsharded units are gone. Whichever phase holds more is the peak.
    step_temporary = params / shards
    on_top = max(extra, step_temporary - s.activations)
    return {"params": params / shards, "grads": grads / shards, "optimizer": optimizer / shards,
            "activations": s.activations, "formula": formula, "on_top": on_top, "theory": formula + on_top}


def measured_peaks(size: str, overrides: list[str], batch_size: int, steps: int, seq_len: int,
                   workdir: Path) -> list[float]:
    out = workdir / f"{size}-{'-'.join(o.replace('=', '_') for o in overrides)}"
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "model=gpt", f"model.size={size}", "data=synthetic_tokens",
         f"data.seq_len={seq_len}", f"train.batch_size={batch_size}", f"train.steps={steps}",
         "train.log_every=1", "metrics.warmup_steps=1", "device=cpu", f"launcher.nproc_per_node={RANKS}",
         "wandb.mode=disabled", *overrides, f"hydra.run.dir={out}"],
        cwd=REPO, capture_output=True, text=True,
    )
    if result.returncode:
        sys.exit(f"run failed: {' '.join(overrides)} (log: {out}/fsdp_exp.log)\n{result.stderr[-2000:]}")
    return [gb * 2**30 for gb in json.loads((out / "summary.json").read_text())["peak_mem_gb_per_rank"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="GPT size (tiny is the baseline)")
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    big, tiny = (shape(size, args.batch_size, args.seq_len) for size in (args.size, "tiny"))
    print(header(RANKS, on_gpu=False))
    print(f"gpt {args.size} ({big.params / 1e6:.1f}M params: root unit {big.root / 1e6:.1f}M, "
          f"largest block {big.block / 1e6:.1f}M), fp32, AdamW, batch {args.batch_size}/rank x "
          f"{args.seq_len} tokens, {args.steps} steps; activations {big.activations / MB:.0f} MB")
    print("per rank, MB; measured = peak less the tiny model's run (its peak less its theory), under "
          f"{LIMIT[0]}; no limit = the same without it")
    columns = (f"{'sharding':<15} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>6} {'formula':>8} "
              f"{'on top':>7} {'theory':>7} {'measured':>9} {'/formula':>9} {'/theory':>8} {'no limit':>9}")
    print(columns)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, overrides in VARIANTS.items():
            t = theory(variant, big)
            run = functools.partial(measured_peaks, batch_size=args.batch_size, steps=args.steps,
                                    seq_len=args.seq_len, workdir=Path(tmp))
            base = [peak - theory(variant, tiny)["theory"] for peak in run("tiny", [*overrides, *LIMIT])]
            measured = max(peak - b for peak, b in zip(run(args.size, [*overrides, *LIMIT]), base))
            unlimited = max(peak - b for peak, b in zip(run(args.size, overrides), base))
            rows[variant] = measured
            print(f"{variant:<15} {t['params'] / MB:>7.0f} {t['grads'] / MB:>7.0f} {t['optimizer'] / MB:>7.0f} "
                  f"{t['activations'] / MB:>6.0f} {t['formula'] / MB:>8.0f} {t['on_top'] / MB:>7.0f} "
                  f"{t['theory'] / MB:>7.0f} {measured / MB:>9.0f} {measured / t['formula']:>9.2f} "
                  f"{measured / t['theory']:>8.2f} {unlimited / MB:>9.0f}", flush=True)
    print(f"full / ddp measured: {rows['full'] / rows['ddp']:.2f}; "
          f"by theory: {theory('full', big)['theory'] / theory('ddp', big)['theory']:.2f}")


if __name__ == "__main__":
    main()
