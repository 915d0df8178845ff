"""task=tune against the exhaustive grid, on the same machine, alternating.

- The grid: every setup of the space searched to its fastest batch, as a user would run it:
  one `-m task=max_batch` sweep over the space's options (`python -m fsdp_exp -m
  task=max_batch sharding=full,grad_op,ddp train.activation_checkpointing=false,true
  offload=false,true ...`), each search with its estimate, as by default. Its answer is the
  setup with the most samples/s at its fastest batch (`fastest_samples_per_s`).
- task=tune: `python -m fsdp_exp task=tune ...`, the same model, limit and space.

Each model runs grid, tune, grid, tune (`--rounds`), so that a drift of the machine falls on
both. The table: each command's wall time (the whole command, as typed), its probes and its
answer; tune's wall time over the grid's; whether tune's answer (its winner at its batch, at
the speed its command line ran) is within the grid's noise of the grid's best (how far a
setup's fastest samples/s moved between the grid's rounds, and between its `offload=false`
and `offload=true` rows, which on a CPU are one setup run twice; at least 5%).

    python bench/tune.py                  # every model (hours on 2 cores)
    python bench/tune.py cnn --rounds 1   # one model, one round
    python bench/tune.py --out runs       # keep every run (runs/<model>/grid0, tune0, ...)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from machine import header

from fsdp_exp.tasks.tune.ranking import SPEED_NOISE

GRID = ["sharding=full,grad_op,ddp", "train.activation_checkpointing=false,true", "offload=false,true"]


REPO = Path(__file__).resolve().parent.parent


@dataclass
class Model:
    name: str
    overrides: list[str]
    limit_gb: float
    cwd: Path | None = None  # where its command runs (a user's project, with its config folder)


MODELS = [
    Model("vit", ["model.num_layers=2"], 0.6),
    Model("cnn", ["model=cnn"], 0.6),
    Model("gpt-small", ["model=gpt", "model.size=small", "data=synthetic_tokens"], 2.2),
    # not one of the repository's models: the example project's residual MLP from its own
    # package and config folder, wide enough and its data large enough that memory bounds it
    Model("my_project", ["model=mynet", "hydra.searchpath=[file://./conf]", "model.width=512", "model.depth=8",
                         "data.num_samples=65536"], 0.8, REPO / "examples" / "my_project"),
]


def run(args: list[str], cwd: Path, exits: tuple[int, ...] = (0,)) -> float:
    """The command's wall time, with a cache folder of its own (as a first run: no estimate nor
    replay kept by the commands before it); `exits`, the exit codes it may end with."""
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fsdp_exp", *args], cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, "FSDP_EXP_CACHE": cache})
        wall = time.perf_counter() - start
    if done.returncode not in exits:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return wall


def setup_key(overrides: list[str]) -> str:
    """The grid's keys of a command line, their values as the tune writes them (a sweep's
    summary has Hydra's `True` where the tune has `true`)."""
    keys = [o.split("=", 1) for o in overrides if o.split("=")[0] in ("sharding", "train.activation_checkpointing",
                                                                       "offload")]
    return " ".join(f"{k}={v.lower() if v in ('True', 'False') else v}" for k, v in sorted(keys))


def grid(model: Model, out: Path) -> dict:
    wall = run(["-m", "task=max_batch", f"memory.limit_gb={model.limit_gb}", "wandb.mode=disabled",
                "memory.estimate=false", *model.overrides, *GRID, f"hydra.sweep.dir={out}"], model.cwd or out.parent,
               exits=(0, 3))  # 3: a search found that nothing of its setup fits
    rows = {}
    for summary_path in sorted(out.glob("*/summary.json")):
        summary = json.loads(summary_path.read_text())
        setup = setup_key(summary.get("overrides", []))
        record_path = summary_path.parent / "max_batch.json"
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        rows[setup] = {"status": summary["status"], "speed": summary.get("fastest_samples_per_s"),
                       "batch": summary.get("fastest_batch_size"), "probes": record.get("probe_count", 0)}
    best = max((s for s in rows if rows[s]["speed"]), key=lambda s: rows[s]["speed"])
    return {"wall_s": wall, "rows": rows, "best": best, "speed": rows[best]["speed"],
            "probes": sum(r["probes"] for r in rows.values())}


def tune(model: Model, out: Path) -> dict:
    wall = run(["task=tune", f"memory.limit_gb={model.limit_gb}", "wandb.mode=disabled", "memory.estimate=false",
                *model.overrides, f"hydra.run.dir={out}"], model.cwd or out.parent)
    record = json.loads((out / "tune.json").read_text())
    full = next(r for r in record["rows"] if r["winner"])["overrides"]
    setup = setup_key(full)
    # the speed model's miss of each measured setup, fitted to the other setups alone
    misses = sorted(abs(r["predicted_samples_per_s"] / r["samples_per_s"] - 1) for r in record["rows"]
                    if r["status"] == "measured" and r.get("predicted_samples_per_s") and r["samples_per_s"])
    return {"wall_s": wall, "best": setup, "speed": record["samples_per_s"], "probes": record["probes"],
            "settled": record["settled"], "setups": record["setups"], "misses": misses}


def grid_noise(grids: list[dict]) -> float:
    """How far a setup's fastest samples/s moved between the grid's rounds, and within one
    round between each setup with `offload=true` and without (on a CPU offload moves nothing,
    so the two are one setup run twice); SPEED_NOISE at least."""
    moves = [SPEED_NOISE]
    for setup in grids[0]["rows"]:
        speeds = [g["rows"].get(setup, {}).get("speed") for g in grids]
        if len(speeds) > 1 and all(speeds):
            moves.append(max(speeds) / min(speeds) - 1)
    for g in grids:
        for setup, row in g["rows"].items():
            twin = g["rows"].get(setup.replace("offload=false", "offload=true"), {}).get("speed")
            if "offload=false" in setup and row["speed"] and twin:
                moves.append(max(row["speed"], twin) / min(row["speed"], twin) - 1)
    return max(moves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help=f"some of: {', '.join(m.name for m in MODELS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="keep every run here (<out>/<model>/grid0, tune0, ...); default: a temporary folder")
    args = parser.parse_args()
    chosen = [m for m in MODELS if not args.models or m.name in args.models]
    print(header(2, False))
    lines = ["| model | limit GB | grid: wall s, probes, setups | tune: wall s, probes, setups, settled | tune / grid | grid's best "
             "(samples/s) | tune's winner (samples/s) | within the grid's noise | speed model's miss, held out "
             "(median, largest) |", "|" + "---|" * 9]
    for model in chosen:
        grids, tunes = [], []
        with (contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory()) as tmp:
            tmp = Path(tmp) / model.name
            tmp.mkdir(parents=True, exist_ok=True)
            for k in range(args.rounds):
                grids.append(grid(model, Path(tmp) / f"grid{k}"))
                print(f"{model.name} grid {k}: {grids[-1]['wall_s']:.0f} s, {grids[-1]['probes']} probes, best "
                      f"{grids[-1]['best']} {grids[-1]['speed']:.1f}", flush=True)
                tunes.append(tune(model, Path(tmp) / f"tune{k}"))
                print(f"{model.name} tune {k}: {tunes[-1]['wall_s']:.0f} s, {tunes[-1]['probes']} probes, winner "
                      f"{tunes[-1]['best']} {tunes[-1]['speed']:.1f}", flush=True)
        noise = grid_noise(grids)
        for g, t in zip(grids, tunes):
            grid_speed_of_winner = g["rows"].get(t["best"], {}).get("speed") or 0.0
            # the answer as a whole, its setup at its batch: the speed its command line ran at
            within = t["speed"] >= g["speed"] * (1 - noise)
            misses = t["misses"]
            missed = (f"{misses[len(misses) // 2]:.0%}, {misses[-1]:.0%} ({len(misses)} setups)" if misses
                      else "none measured")
            lines.append(f"| {model.name} | {model.limit_gb:g} | {g['wall_s']:.0f}, {g['probes']}, {len(g['rows'])} | {t['wall_s']:.0f}, "
                         f"{t['probes']}, {t['setups']}, {t['settled']} | {t['wall_s'] / g['wall_s']:.2f} | {g['best']} "
                         f"({g['speed']:.1f}) | {t['best']} ({t['speed']:.1f}; the grid's {grid_speed_of_winner:.1f}) "
                         f"| {'yes' if within else 'no'} (noise {noise:.0%}) | {missed} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
