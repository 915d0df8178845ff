"""`python -m fsdp_exp.compare PATH ...`: finished runs side by side, as a table, a CSV and a chart.

A PATH is a run directory or a directory holding runs at any depth (a multirun sweep, or
`outputs/` with its `multirun/<date>/<time>/<n>/`). A run is named by its setup: the overrides
whose values differ between the runs compared, so a sweep over `sharding=ddp,full` reads as
two rows, `sharding=ddp` and `sharding=full`; the CSV keeps every override.
Runs that did not finish are skipped with the reason; runs that failed are rows that say why.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from fsdp_exp.finished_runs import CompareError, Run, Skipped, find_run_dirs, is_run_dir, load_run, wandb_runs
from fsdp_exp.keys import MISSING, lookup
from fsdp_exp.metrics.plots import none_fits, plot_comparison, plot_throughput_vs_memory
from fsdp_exp.metrics.summary import ANSWERED, PEAK_GB, Summary
from fsdp_exp.metrics.wandb_sink import wandb_project

EXIT_BAD_INPUT = 2
COLUMNS = ["setup", "task", "status", "max_batch_size", "fastest_batch_size", "near_fastest_batch_size",
           "batch_size", "samples_per_s", PEAK_GB, "estimated_peak_mem_gb", "peak_in_use_gb", "estimate_error", "limit_gb",
           "peak_under_limit_gb", "world_size", "mfu", "final_loss", "eval_loss", "eval_accuracy", "note", "run_dir"]
# The CSV only: a table cell of every override is what made rows unreadable.
CSV_ONLY = ["overrides"]
# Shown only when some run has them: most runs have no MFU (it needs a known peak FLOP/s),
# only max_batch runs have a fastest batch, max_batch runs have no loss, and a run with
# memory.estimate=false no estimate of its own; only CPU runs read what their allocations
# held (the figure their estimate error is of).
OPTIONAL = {"estimated_peak_mem_gb", "peak_in_use_gb", "estimate_error", "fastest_batch_size", "near_fastest_batch_size", "limit_gb",
            "peak_under_limit_gb", "mfu", "final_loss", "eval_loss", "eval_accuracy", "note"}
HEADINGS = {"max_batch_size": "max batch", "fastest_batch_size": "fastest batch",
            "near_fastest_batch_size": "within 5% of fastest from", "batch_size": "batch per rank",
            "samples_per_s": "samples/s", "limit_gb": "memory.limit_gb", "peak_under_limit_gb": "peak under the limit (GB)",
            PEAK_GB: "peak memory (GB)", "estimated_peak_mem_gb": "estimated (GB)", "peak_in_use_gb": "in use (GB)",
            "estimate_error": "estimate error",
            "world_size": "ranks", "mfu": "MFU", "final_loss": "final loss", "eval_loss": "eval loss",
            "eval_accuracy": "eval accuracy", "run_dir": "run"}
FORMATS = {"max_batch_size": ",d", "fastest_batch_size": ",d", "near_fastest_batch_size": ",d", "batch_size": ",",
           "samples_per_s": ",.1f", "limit_gb": "g", "peak_under_limit_gb": ".3f", PEAK_GB: ".2f",
           "estimated_peak_mem_gb": ".2f", "peak_in_use_gb": ".3f", "estimate_error": "+.0%", "mfu": ".1%", "final_loss": ".4f", "eval_loss": ".4f",
           "eval_accuracy": ".2%"}
# A failure's reason in a table cell; the CSV and comparison.md keep the whole first line.
REASON_CHARS = 120


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
    common = common_overrides(runs)
    out = Path(args.out) if args.out else default_out_dir(args.paths)
    paths = [out / "comparison.md", out / "comparison.csv", out / "comparison.png"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(markdown(rows, skipped, common))
        write_csv(rows, paths[1])
    except OSError as err:
        print(f"fsdp_exp.compare: --out {out}: cannot write there ({err.strerror})", file=sys.stderr)
        return EXIT_BAD_INPUT
    plot_comparison(rows, paths[2])
    points = memory_points(rows)
    if points:
        paths.append(out / "throughput_vs_memory.png")
        plot_throughput_vs_memory(points, paths[-1], title=common_title(common) if len(runs) > 1 else None,
                                  memory_label=memory_label(rows))
    if len(runs) > 1 and common:
        print(f"every run: {' '.join(common)}")
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


def memory_points(rows: list[dict]) -> list[tuple[str, float, float]]:
    """(setup, samples/s, peak GB) of each run that has both, all on one axis
    (`memory_figure`)."""
    figure = memory_figure(rows)
    return [(r["setup"], r["samples_per_s"], r[figure]) for r in rows
            if r["status"] == "ok" and r.get("samples_per_s") is not None and r.get(figure) is not None]


def memory_figure(rows: list[dict]) -> str:
    """The peak the runs are placed by: as memory.limit_gb counts it when every run that
    measured samples/s had a limit, else the peak each run measured (a run without a limit
    has none as the limit counts it, whose figure also holds the runtime: one axis does not
    mix the two)."""
    timed = [r for r in rows if r["status"] == "ok" and r.get("samples_per_s") is not None]
    limited = timed and all(r.get("peak_under_limit_gb") is not None for r in timed)
    return "peak_under_limit_gb" if limited else PEAK_GB


def memory_label(rows: list[dict]) -> str:
    if memory_figure(rows) == "peak_under_limit_gb":
        return "peak memory per rank (GB, as memory.limit_gb counts it)"
    return "peak memory per rank (GB)"


def comparison_rows(runs: list[Run]) -> list[dict]:
    setups = setup_names(runs)
    return [row(run, setup) for run, setup in zip(runs, setups)]


def row(run: Run, setup: str) -> dict:
    s = run.summary
    task = (s.choices or {}).get("task") or s.task or "train"
    limit = s.limit_gb if task in SEARCHES else lookup(run.config, "memory.limit_gb")
    return {
        "setup": setup, "task": task, "status": s.status,
        **{k: s.get(k) for k in ("fastest_batch_size", "near_fastest_batch_size", "smallest_batch_needs_gb",
                                 "resolution")},
        "samples_per_s": s.samples_per_s, "warmup_only": s.warmup_only, "limit_gb": None if limit is MISSING else limit,
        "peak_under_limit_gb": s.peak_under_limit_gb, PEAK_GB: s.peak_mem_gb,
        # the run's own estimate (memory.estimate); summaries before the figures were named
        # after what they predict called it estimated_peak_gb
        "estimated_peak_mem_gb": s.get("estimated_peak_mem_gb", s.get("estimated_peak_gb")),
        "peak_in_use_gb": s.peak_in_use_gb,
        "estimate_error": s.estimate_ratio - 1 if s.estimate_ratio else None,
        "world_size": s.world_size, "mfu": s.mfu,
        **{k: s.get(k) for k in ("final_loss", "eval_loss", "eval_accuracy")},
        "note": failure_reason(s) if not s.answered else None,
        **task_figures(task, s, run),
        "run_dir": run.source, "error": s.error, "overrides": " ".join(run.overrides),
    }


# The tasks whose summary holds the memory limit they searched or estimated under.
SEARCHES = ("max_batch", "tune", "estimate")


def task_figures(task: str, s: Summary, run: Run) -> dict:
    """The batch a row's figures are for, and its largest batch, in each task's own terms:
    a search's answer; a tune's winner (its batch, the largest it fits, its peak); an
    estimate's batch and the largest it puts under the limit (its peak is estimated, so it
    goes in the estimate's column); a run's configured batch."""
    if task == "max_batch":
        max_batch = s.max_batch_size
        verified = s.verification  # with none fitting, there was nothing to verify
        note = verification_note(s) if verified not in (None, "completed") and (max_batch or verified == "none completed") \
            else none_fits(s) if max_batch == 0 else None
        return {"max_batch_size": max_batch, "batch_size": max_batch,
                **({"note": note} if note and s.answered else {})}
    if task == "tune":
        peak_key = "peak_under_limit_gb" if s.limit_gb is not None else PEAK_GB
        return {"max_batch_size": s.max_batch_size, "batch_size": s.batch_size,
                peak_key: s.peak_gb, **({"note": tune_note(s)} if s.answered else {})}
    if task == "estimate":
        return {"max_batch_size": s.largest_batch_fitting, "batch_size": s.batch_size,
                "estimated_peak_mem_gb": s.peak_mem_gb, PEAK_GB: None,
                **({"note": "estimated, not measured"} if s.status == "ok" else {})}
    return {"max_batch_size": None, "batch_size": train_batch_size(run)}


def verification_note(s: Summary) -> str:
    """What the run of the command at the search's answer said (fsdp_exp.tasks.max_batch.verify)."""
    status, found = s.verification, s.searched_max_batch_size
    if status == "stepped down":
        return f"stepped down from {found}: a run of the command there ran out of memory"
    if status == "none completed":
        return f"none verified: the probes found {found}, and no run of the command completed"
    return "NOT VERIFIED: " + ("its run failed, not for lack of memory" if status == "failed"
                               else "task.verify_steps=0")


def tune_note(s: Summary) -> str:
    if not s.winner:
        return "no setup trained under the limit"
    confirmed = s.confirmed
    if not confirmed:
        return f"winner {s.winner}, NOT CONFIRMED: its command line was never run"
    if confirmed.get("status") != "ok":
        return f"winner {s.winner}, NOT CONFIRMED: its command line did not train ({confirmed.get('status')})"
    probed = s.probed_samples_per_s
    ran = f" as its command line ran (its probes: {probed:,.1f})" if probed and probed != s.samples_per_s else ""
    return f"winner {s.winner}{ran}"


def failure_reason(summary: Summary) -> str:
    """The first line of what a failed, out-of-memory or refused run recorded; for an
    interrupted one, where it stopped (its figures are those of the steps it logged)."""
    if summary.status == "interrupted":
        return f"interrupted ({summary.signal or 'stopped'}) after step {summary.steps_done}: its figures so far"
    text = str(summary.error or summary.reason or "").strip()
    return text.splitlines()[0] if text else "no error recorded"


def train_batch_size(run: Run) -> int | float | None:
    """Per rank, as configured; else the global batch shared out over the ranks."""
    configured = lookup(run.config, "train.batch_size")
    if isinstance(configured, int) and not isinstance(configured, bool):
        return configured
    total, world = run.summary.global_batch_size, run.summary.world_size
    if not total or not world:
        return None
    return total // world if total % world == 0 else total / world


def setup_names(runs: list[Run]) -> list[str]:
    """Each run's settings whose values differ between the runs; a lone run's overrides.
    Past SHORT_NAME_KEYS such settings, a run leaves out those where it has the value most
    runs have (`usual_values`).

    A run that leaves an overridden key at its default is compared by that default (from its
    recorded group choices or config), so `sharding=full` matches a run left at full, and
    `train.lr=1e-3` matches a default of 0.001. Runs alike in every setting are named by
    their directories."""
    if len(runs) == 1:
        return [" ".join(runs[0].overrides) or "(defaults)"]
    keys = list(dict.fromkeys(override_key(o) for run in runs for o in run.overrides if not is_hydras(o)))
    settings = [{key: setting(run, key) for key in keys} for run in runs]
    differing = [k for k in keys if len({s[k][1] for s in settings if s[k] is not None}) > 1]
    if not differing:
        return run_names(runs)
    usual = usual_values(settings, differing) if len(differing) > SHORT_NAME_KEYS else {}
    names = [" ".join(s[k][0] for k in differing if s[k] is not None and s[k][0] and usual.get(k) != s[k][1])
             or "(defaults)" for s in settings]
    # Runs alike where the others differ (a setup run twice): told apart by their directories.
    return [f"{name} [{where}]" if names.count(name) > 1 else name for name, where in zip(names, run_names(runs))]


SHORT_NAME_KEYS = 4  # past this many settings that differ, a run is named by those where it is unusual


def usual_values(settings: list[dict], keys: list[str]) -> dict[str, str]:
    """The value of each key that most of the runs have (more than half): runs of a folder
    that differ in many settings are named by where each differs from most, not by all."""
    usual = {}
    for key in keys:
        values = [s[key][1] for s in settings if s[key] is not None]
        top = max(set(values), key=values.count, default=None)
        if top is not None and values.count(top) * 2 > len(settings):
            usual[key] = top
    return usual


def run_names(runs: list[Run]) -> list[str]:
    """Each run's directory below the directory they share (`3`, `14-02-11/0`), or its URL."""
    local = [Path(run.source) for run in runs if "://" not in run.source]
    base = Path(os.path.commonpath([p.resolve() for p in local])) if len(local) > 1 else None
    names = []
    for run in runs:
        path = Path(run.source).resolve()
        names.append(run.source if base is None or "://" in run.source or path == base
                     else str(path.relative_to(base)))
    return names


def common_overrides(runs: list[Run]) -> list[str]:
    """The overrides every run was given, alike (the last of a key's, as Hydra takes it): said
    once, above the rows."""
    keys = dict.fromkeys(override_key(o) for o in runs[0].overrides if not is_hydras(o))
    return [override_of(runs[0], key) for key in keys
            if all(override_of(run, key) == override_of(runs[0], key) for run in runs)]


def override_of(run: Run, key: str) -> str | None:
    """The run's override of `key`: the last one given, as Hydra takes it."""
    return next((o for o in reversed(run.overrides) if override_key(o) == key), None)


def common_title(common: list[str]) -> str | None:
    text = " ".join(common)
    return f"every run: {text}" if text else None


def is_hydras(override: str) -> bool:
    """Hydra's own settings (`hydra.sweep.dir=...`) say where a run went, not what it ran."""
    return override.lstrip("+~").startswith(("hydra.", "hydra/"))


ABSENT = "(not set)"


def setting(run: Run, key: str) -> tuple[str, str] | None:
    """`key=value` as the run had it (its override, else its default when recorded) and the
    value in a form that compares alike however it was written; None when not known."""
    override = override_of(run, key)
    if override is not None:
        if override.startswith("~") or "=" not in override:  # deleted from the config
            return "", ABSENT
        return override, comparable(override.split("=", 1)[1])
    choices = run.summary.choices or {}
    value = choices[key] if key in choices else lookup(run.config, key)
    if value is MISSING:
        # A recorded config without the key: the run did not have it (a `+key=` elsewhere).
        return ("", ABSENT) if run.config else None
    if isinstance(value, (dict, list)):
        return None
    return f"{key}={yaml_scalar(value)}", comparable(value)


def comparable(value: Any) -> str:
    """1e-3, 0.001 and '0.001' alike; 5 and 5.0 alike."""
    import yaml

    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    return json.dumps(value, sort_keys=True, default=str)


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
    if column == "note" and isinstance(value, str) and len(value) > REASON_CHARS:
        value = value[:REASON_CHARS - 1] + "…"
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


def markdown(rows: list[dict], skipped: list[Skipped], common: list[str] | None = None) -> str:
    parts = ["# Run comparison", ""]
    if common and len(rows) > 1:
        parts += [f"Every run: `{' '.join(common)}`", ""]
    parts += [markdown_table(rows)]
    failed = [r for r in rows if r["status"] not in ANSWERED]
    if failed:
        parts += ["", "## Failed runs", ""]
        parts += [f"- `{r['run_dir']}` ({r['setup']}): {r['status']}: {r['note']}" for r in failed]
    if skipped:
        parts += ["", "## Skipped runs", ""]
        parts += [f"- `{s.source}`: {s.reason}" for s in skipped]
    return "\n".join(parts) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    shown = columns(rows) + CSV_ONLY
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=shown, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def default_out_dir(paths: list[str]) -> Path:
    """Next to the runs when one directory of runs was given; else a new folder of its own."""
    if len(paths) == 1 and Path(paths[0]).is_dir() and not is_run_dir(Path(paths[0])):
        return Path(paths[0])
    return Path("outputs") / "compare" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")

