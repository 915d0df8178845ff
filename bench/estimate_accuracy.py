"""task=estimate against the peaks real runs measure, over a corpus of setups.

Each row is one real 2-rank training run (3 steps) that checks its own estimate
(memory.estimate, fsdp_exp.estimate.beside): the estimate of its setup, traced beside it,
against what it measured. Two figures:

- under memory.limit_gb (10 GB here, far above the runs' need): the peak as the limit
  counts it (`peak_under_limit_gb`, every phase since the limit was set, the runtime in)
  against `estimated_peak_under_limit_gb`. There glibc maps every block over 64 KiB from the
  kernel and returns it on free, so the peak is what the run holds;
- the resident peak of the training steps, the runtime left out (`peak_mem_gb`) against
  `estimated_peak_mem_gb`.

The corpus: GPT-2 small and the ViT under every sharding, offload, activation
checkpointing and gradient accumulation; a Hugging Face Llama (`model=hf`); a GPT-2-shaped
Hugging Face model loaded from a directory with its weights (`model=hf_dir`, written here);
a user's own convolutional net with BatchNorm (a package written here); the CNN; two batch
sizes each.

    python bench/estimate_accuracy.py                 # every row (about 30 minutes on 2 CPU cores)
    python bench/estimate_accuracy.py --only vit hf   # the rows whose name starts so
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import header

from fsdp_exp.metrics.summary import Summary

REPO = Path(__file__).resolve().parent.parent
COMMON = ["device=cpu", "launcher.nproc_per_node=2", "wandb.mode=disabled", "memory.limit_gb=10",
          "train.steps=3", "train.log_every=1", "metrics.warmup_steps=1"]
GPT_SMALL = ["model=gpt", "model.size=small", "data=synthetic_tokens"]

USER_NET = '''
from torch import nn


class Block(nn.Module):
    """Conv, BatchNorm, ReLU, twice, with a skip: a ResNet's basic block."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x):
        return (x + self.body(x)).relu()


def small_resnet(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         Block(64), Block(64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))
'''


def corpus(tmp: Path) -> dict[str, tuple[list[str], list[int]]]:
    rows: dict[str, tuple[list[str], list[int]]] = {}
    for sharding in ("full", "grad_op", "ddp"):
        rows[f"gpt-small {sharding}"] = ([*GPT_SMALL, f"sharding={sharding}"], [1, 4])
    rows["gpt-small full + offload"] = ([*GPT_SMALL, "sharding=full", "offload=true"], [1, 4])
    rows["gpt-small full + activation checkpointing"] = (
        [*GPT_SMALL, "sharding=full", "train.activation_checkpointing=true"], [2, 8])
    for sharding in ("full", "grad_op", "ddp"):
        rows[f"vit {sharding}"] = ([f"sharding={sharding}"], [32, 256])
    rows["vit full + offload"] = (["sharding=full", "offload=true"], [32, 256])
    rows["vit full + activation checkpointing"] = (["sharding=full", "train.activation_checkpointing=true"], [32, 256])
    rows["vit full + grad_accum=4"] = (["sharding=full", "train.grad_accum=4"], [32, 256])
    rows["hf llama full"] = (["model=hf", "sharding=full"], [8, 32])
    rows["hf llama ddp"] = (["model=hf", "sharding=ddp"], [8, 32])
    rows["hf_dir gpt2-shaped, pretrained"] = (["model=hf_dir", f"model.path={gpt2_dir(tmp)}", "model.pretrained=true",
                                               "data=synthetic_tokens", "sharding=full"], [2, 8])
    rows["user resnet with BatchNorm full"] = (
        ["model=custom", "model._target_=user_net.small_resnet", "model.blocks=[user_net.Block]",
         "data=synthetic", "sharding=full"], [16, 64])
    rows["user resnet with BatchNorm ddp"] = (
        ["model=custom", "model._target_=user_net.small_resnet", "model.blocks=[user_net.Block]",
         "data=synthetic", "sharding=ddp"], [16, 64])
    rows["cnn full"] = (["model=cnn", "sharding=full"], [64, 512])
    return rows


def gpt2_dir(tmp: Path) -> Path:
    """A GPT-2-shaped Hugging Face model (its 50257-token vocabulary, 4 layers of 256), saved
    with its weights, as a user's checkpoint directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp / "gpt2-shaped"
    if not path.exists():
        GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=512)).save_pretrained(path)
    return path


def run(overrides: list[str], out: Path, pythonpath: Path) -> dict:
    """task=estimate of the setup (kept for it), then the run, which checks against it at once."""
    start = time.perf_counter()
    for words, where in ((["task=estimate"], out.with_name(out.name + "_estimate")), ([], out)):
        result = subprocess.run([sys.executable, "-m", "fsdp_exp", *COMMON, *overrides, *words,
                                 f"hydra.run.dir={where}"], cwd=REPO, capture_output=True, text=True,
                                env=env_with(pythonpath))
        if result.returncode:
            sys.exit(f"failed: {' '.join([*overrides, *words])} (log: {where}/fsdp_exp.log)\n"
                     f"{result.stdout[-1500:]}{result.stderr[-1500:]}")
    summary = Summary.read(out)
    return summary.as_dict() | {"command_s": time.perf_counter() - start,
                      "estimate": json.loads((out / "estimate.json").read_text())}


def env_with(path: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name starts with one of these")
    args = parser.parse_args()
    print(header(2, on_gpu=False))
    rows = ["| setup | batch | phase | under the limit: estimated GB | measured GB | ratio "
            "| steps' resident peak: estimated GB | measured GB | ratio | trace s | run s |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    limited, resident = [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "user_net.py").write_text(USER_NET)
        for name, (overrides, sizes) in corpus(tmp).items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            for size in sizes:
                slug = "".join(c if c.isalnum() else "_" for c in name)
                found = run([*overrides, f"train.batch_size={size}"], tmp / f"{slug}-b{size}", tmp)
                if "estimate_failed" in found:
                    rows.append(f"| {name} | {size} | no estimate: {found['estimate_failed']} | | | | | | | | |")
                    print(rows[-1], flush=True)
                    continue
                limited.append(found["estimate_ratio_peak_under_limit"])
                resident.append(found["estimate_ratio_peak_mem"])
                rows.append(f"| {name} | {size} | {found['estimate']['phase']} | {found['estimated_peak_under_limit_gb']:.3f} | "
                            f"{found['peak_under_limit_gb']:.3f} | {limited[-1]:.3f} | {found['estimated_peak_mem_gb']:.3f} | "
                            f"{found['peak_mem_gb']:.3f} | {resident[-1]:.3f} | {found['estimate']['trace_s']:.0f} | "
                            f"{found['command_s']:.0f} |")
                print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))
    for what, ratios in (("under the limit", limited), ("steps' resident peak", resident)):
        if ratios:
            worst = max(ratios, key=lambda r: abs(r - 1))
            within = sum(abs(r - 1) <= 0.10 for r in ratios)
            print(f"{what}: {within} of {len(ratios)} within 10%; the farthest off {worst:.3f}")


if __name__ == "__main__":
    main()
