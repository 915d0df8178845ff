"""`python -m fsdp_exp.compare PATH ...`: finished runs side by side, as a table, a CSV and a chart.

A PATH is a run directory or a directory of them (a multirun sweep, or `outputs/`). A run is
named by its setup: the overrides in which it differs from the others compared, so a sweep
over `sharding=ddp,full` reads as two rows, `sharding=ddp` and `sharding=full`.
Runs that did not finish are skipped with the reason; runs that failed are rows that say so.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fsdp_exp.metrics.plots import none_fits
from fsdp_exp.metrics.sinks import wandb_project

EXIT_BAD_INPUT = 2
NOT_FINISHED = "no summary.json: the run did not finish (interrupted or still running)"
INTERRUPTED = "interrupted: the run was stopped before it finished"
COLUMNS = ["setup", "task", "status", "max_batch_size", "fastest_batch_size", "near_fastest_batch_size",
           "batch_size", "samples_per_s", "limit_gb", "peak_under_limit_gb", "peak_mem_gb", "world_size", "mfu",
           "note", "run_dir"]
# Shown only when some run has them: most runs have no MFU (it needs a known peak FLOP/s),
# and only max_batch runs have a fastest batch.
OPTIONAL = {"fastest_batch_size", "near_fastest_batch_size", "limit_gb", "peak_under_limit_gb", "mfu", "note"}
HEADINGS = {"max_batch_size": "max batch", "fastest_batch_size": "fastest batch",
            "near_fastest_batch_size": "within 5% of fastest from", "batch_size": "batch per rank",
            "samples_per_s": "samples/s", "limit_gb": "memory.limit_gb", "peak_under_limit_gb": "peak under the limit (GB)",
            "peak_mem_gb": "peak memory (GB)", "world_size": "ranks", "mfu": "MFU", "run_dir": "run"}
FORMATS = {"max_batch_size": ",d", "fastest_batch_size": ",d", "near_fastest_batch_size": ",d", "batch_size": ",",
           "samples_per_s": ",.1f", "limit_gb": "g", "peak_under_limit_gb": ".3f", "peak_mem_gb": ".2f", "mfu": ".1%"}


class CompareError(Exception):
    """Input the user can fix; the message is the one line they see."""


@dataclass
class Run:
    source: str  # the run directory, or the wandb run's URL
    summary: dict
    overrides: list[str]
    config: dict  # the experiment's config when known: train.batch_size, values not overridden


@dataclass
class Skipped:
    source: str
    reason: str


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs, skipped = collect(args)
    except CompareError as err:
        print(f"fsdp_exp.compare: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for skip in skipped:
        print(f"fsdp_exp.compare: skipped {skip.source}: {skip.reason}", file=sys.stderr)
    if not runs:
        print(f"fsdp_exp.compare: nothing to compare: all {len(skipped)} run(s) were skipped", file=sys.stderr)
        return EXIT_BAD_INPUT

    rows = comparison_rows(runs)
    out = Path(args.out) if args.out else default_out_dir(args.paths)
    paths = out / "comparison.md", out / "comparison.csv", out / "comparison.png"
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(markdown(rows, skipped))
        write_csv(rows, paths[1])
    except OSError as err:
        print(f"fsdp_exp.compare: --out {out}: cannot write there ({err.strerror})", file=sys.stderr)
        return EXIT_BAD_INPUT
    from fsdp_exp.metrics.plots import plot_comparison

    plot_comparison(rows, paths[2])
    print(markdown_table(rows))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_exp.compare",
        description="Compare finished runs: a markdown table, a CSV and a bar chart.")
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="a run directory, or a directory of runs (e.g. outputs/multirun/<date>/<time>)")
    parser.add_argument("--out", help="where to write comparison.md/.csv/.png (default: the one "
                        "directory of runs given, else outputs/compare/<date>_<time>)")
    parser.add_argument("--wandb", metavar="GROUP", help="also compare the runs of this wandb group")
    parser.add_argument("--project", default=wandb_project(), help="wandb project (default: WANDB_PROJECT, else fsdp_exp)")
    parser.add_argument("--entity", default=os.environ.get("WANDB_ENTITY") or None,
                        help="wandb entity (default: WANDB_ENTITY, else your default entity)")
    args = parser.parse_args(argv)
    if not args.paths and not args.wandb:
        parser.error("give at least one PATH or --wandb GROUP")
    return args


def collect(args: argparse.Namespace) -> tuple[list[Run], list[Skipped]]:
    runs: list[Run] = []
    skipped: list[Skipped] = []
    seen: set[Path] = set()
    for arg in args.paths:
        for run_dir in find_run_dirs(Path(arg)):
            if run_dir.resolve() in seen:
                continue
            seen.add(run_dir.resolve())
            loaded = load_run(run_dir)
            (runs if isinstance(loaded, Run) else skipped).append(loaded)
    if args.wandb:
        from_wandb, skipped_on_wandb = wandb_runs(args.wandb, args.project, args.entity)
        runs += from_wandb
        skipped += skipped_on_wandb
    return runs, skipped


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / ".hydra").is_dir()


def find_run_dirs(path: Path) -> list[Path]:
    """`path` itself when it is a run, else the runs one and two levels below it."""
    if path.name == "summary.json" and path.is_file():
        path = path.parent
    if not path.exists():
        raise CompareError(f"{path}: no such directory")
    if not path.is_dir():
        raise CompareError(f"{path}: not a directory; give a run directory or a directory of runs")
    if is_run_dir(path):
        return [path]
    found = []
    for child in subdirs(path):
        found += [child] if is_run_dir(child) else [d for d in subdirs(child) if is_run_dir(d)]
    if not found:
        raise CompareError(f"{path}: holds no runs (no summary.json or .hydra/ in it, one or two levels down)")
    return found


def subdirs(path: Path) -> list[Path]:
    """Subdirectories in the order a person expects: 2 before 10."""
    def natural(p: Path) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", p.name)]

    return sorted((p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")), key=natural)


def load_run(run_dir: Path) -> Run | Skipped:
    path = run_dir / "summary.json"
    if not path.is_file():
        return Skipped(str(run_dir), NOT_FINISHED)
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        return Skipped(str(run_dir), f"summary.json is not valid JSON ({err.msg}, line {err.lineno})")
    except (OSError, UnicodeDecodeError) as err:
        return Skipped(str(run_dir), f"summary.json cannot be read ({err})")
    if not isinstance(summary, dict) or "status" not in summary:
        return Skipped(str(run_dir), "summary.json has no run status")
    if summary["status"] == "interrupted":
        return Skipped(str(run_dir), INTERRUPTED)
    overrides = summary["overrides"] if "overrides" in summary else read_yaml(run_dir / ".hydra" / "overrides.yaml")
    config = read_yaml(run_dir / ".hydra" / "config.yaml")
    return Run(str(run_dir), summary, list(overrides or []), config if isinstance(config, dict) else {})


def read_yaml(path: Path) -> Any:
    """The file's content, or None when it is missing or not YAML: it only adds detail."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def wandb_runs(group: str, project: str, entity: str | None) -> tuple[list[Run], list[Skipped]]:
    """The runs of a wandb group, as the same Runs a run directory gives."""
    where = f"{entity}/{project}" if entity else project
    try:
        import wandb

        found = list(wandb.Api(timeout=30).runs(where, filters={"group": group}))
        loaded = [wandb_run(run) for run in found]
    except Exception as err:  # noqa: BLE001 - no key, no network, no project: all one line for the user
        text = str(err).strip()
        detail = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
        raise CompareError(f"--wandb {group}: could not read the group's runs from wandb project {where} ({detail})") from None
    if not found:
        raise CompareError(f"--wandb {group}: wandb project {where} has no runs in group {group!r}")
    return [r for r in loaded if isinstance(r, Run)], [r for r in loaded if isinstance(r, Skipped)]


def wandb_run(run: Any) -> Run | Skipped:
    if run.state == "running":
        return Skipped(run.url, "still running on wandb")
    if run.state == "killed":
        return Skipped(run.url, INTERRUPTED)
    summary = {k: v for k, v in run.summary.items() if not k.startswith("_")}
    config = dict(run.config)
    # wandb keeps no list or dict in its summary, so the status and task come from the run itself.
    summary.setdefault("status", "ok" if run.state == "finished" else "failed")
    summary["choices"] = {"task": summary.get("task") or run.job_type or "train"}
    return Run(run.url, summary, [t for t in run.tags if "=" in t], config)


def comparison_rows(runs: list[Run]) -> list[dict]:
    setups = setup_names(runs)
    return [row(run, setup) for run, setup in zip(runs, setups)]


def row(run: Run, setup: str) -> dict:
    s = run.summary
    task = (s.get("choices") or {}).get("task") or s.get("task") or "train"
    max_batch = s.get("max_batch_size") if task == "max_batch" else None
    limit = s.get("limit_gb") if task == "max_batch" else lookup(run.config, "memory.limit_gb")
    return {
        "setup": setup, "task": task, "status": s["status"], "max_batch_size": max_batch,
        **{k: s.get(k) for k in ("fastest_batch_size", "near_fastest_batch_size", "smallest_batch_needs_gb",
                                 "resolution")},
        "batch_size": max_batch if task == "max_batch" else train_batch_size(run),
        "samples_per_s": s.get("samples_per_s"), "warmup_only": s.get("warmup_only"), "limit_gb": None if limit is MISSING else limit,
        "peak_under_limit_gb": s.get("peak_under_limit_gb"), "peak_mem_gb": s.get("peak_mem_gb"),
        "world_size": s.get("world_size"), "mfu": s.get("mfu"),
        "note": none_fits(s) if task == "max_batch" and max_batch == 0 else None,
        "run_dir": run.source, "error": s.get("error"),
    }


def train_batch_size(run: Run) -> int | float | None:
    """Per rank, as configured; else the global batch shared out over the ranks."""
    configured = lookup(run.config, "train.batch_size")
    if isinstance(configured, int) and not isinstance(configured, bool):
        return configured
    total, world = run.summary.get("global_batch_size"), run.summary.get("world_size")
    if not total or not world:
        return None
    return total // world if total % world == 0 else total / world


MISSING = object()


def lookup(config: dict, dotted_key: str) -> Any:
    value: Any = config
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def setup_names(runs: list[Run]) -> list[str]:
    """Each run's overrides that differ between the runs; all its overrides when none differ.

    A run that leaves an overridden key at its default is compared by that default (from
    its recorded group choices or config), so `sharding=full` matches a run left at full."""
    keys = list(dict.fromkeys(override_key(o) for run in runs for o in run.overrides))
    settings = [{key: setting(run, key) for key in keys} for run in runs]
    differing = [k for k in keys if len({s[k] for s in settings}) > 1] if len(runs) > 1 else []
    names = []
    for run, setting_of in zip(runs, settings):
        shown = [setting_of[k] for k in differing if setting_of[k] is not None] if differing else run.overrides
        names.append(" ".join(shown) or "(defaults)")
    return names


def setting(run: Run, key: str) -> str | None:
    """`key=value` as the run had it: its override, else its default when recorded."""
    for override in run.overrides:
        if override_key(override) == key:
            return override
    choices = run.summary.get("choices") or {}
    value = choices[key] if key in choices else lookup(run.config, key)
    if value is MISSING or isinstance(value, (dict, list)):
        return None
    return f"{key}={yaml_scalar(value)}"


def yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def columns(rows: list[dict]) -> list[str]:
    return [c for c in COLUMNS if c not in OPTIONAL or any(r.get(c) is not None for r in rows)]


def cell(row: dict, column: str) -> str:
    value = row.get(column)
    if column == "max_batch_size" and value == 0 and row.get("note"):
        return row["note"]
    if value is None:
        return "-"
    if column == "samples_per_s" and row.get("warmup_only") and isinstance(value, (int, float)):
        return f"{value:{FORMATS[column]}} (warm-up only)"  # every step was warm-up: not a measurement
    if column in FORMATS and isinstance(value, (int, float)):
        return format(value, FORMATS[column])
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    shown = columns(rows)
    lines = ["| " + " | ".join(HEADINGS.get(c, c) for c in shown) + " |",
             "|" + "|".join("---" for _ in shown) + "|"]
    lines += ["| " + " | ".join(cell(r, c) for c in shown) + " |" for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict], skipped: list[Skipped]) -> str:
    parts = ["# Run comparison", "", markdown_table(rows)]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        parts += ["", "## Failed runs", ""]
        parts += [f"- `{r['run_dir']}` ({r['setup']}): {r['status']}: "
                  f"{(r.get('error') or 'no error recorded').strip().splitlines()[0]}" for r in failed]
    if skipped:
        parts += ["", "## Skipped runs", ""]
        parts += [f"- `{s.source}`: {s.reason}" for s in skipped]
    return "\n".join(parts) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    shown = columns(rows)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=shown, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def default_out_dir(paths: list[str]) -> Path:
    """Next to the runs when one directory of runs was given; else a new folder of its own."""
    if len(paths) == 1 and Path(paths[0]).is_dir() and not is_run_dir(Path(paths[0])):
        return Path(paths[0])
    return Path("outputs") / "compare" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


if __name__ == "__main__":
    sys.exit(main())
