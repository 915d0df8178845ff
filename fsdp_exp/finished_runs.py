"""Finished runs as `python -m fsdp_exp.compare` reads them: from run directories at any depth
(a run, a multirun sweep, or `outputs/` with its `multirun/<date>/<time>/<n>/`), or from a
wandb group. A run that did not finish is Skipped, with the reason."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_exp.errors import one_line
from fsdp_exp.metrics.summary import SUMMARY, Summary

NOT_FINISHED = "no summary.json: the run did not finish (interrupted or still running)"
INTERRUPTED = "interrupted before its first logged step: nothing to compare"


class CompareError(Exception):
    """Input the user can fix; the message is the one line they see."""


@dataclass
class Run:
    source: str  # the run directory, or the wandb run's URL
    summary: Summary
    overrides: list[str]
    config: dict  # the experiment's config when known: train.batch_size, values not overridden


@dataclass
class Skipped:
    source: str
    reason: str


def is_run_dir(path: Path) -> bool:
    return (path / SUMMARY).is_file() or (path / ".hydra").is_dir()


def find_run_dirs(path: Path) -> list[Path]:
    """`path` itself when it is a run, else every run below it, at any depth: `outputs/` holds
    single runs at <date>/<time> and sweeps' runs at multirun/<date>/<time>/<n>."""
    if path.name == SUMMARY and path.is_file():
        path = path.parent
    if not path.exists():
        raise CompareError(f"{path}: no such directory")
    if not path.is_dir():
        raise CompareError(f"{path}: not a directory; give a run directory or a directory of runs")
    if is_run_dir(path):
        return [path]
    found = runs_below(path, {path.resolve()})
    if not found:
        raise CompareError(f"{path}: holds no runs (no summary.json or .hydra/ in it or anywhere below it)")
    return found


def runs_below(path: Path, visited: set[Path]) -> list[Path]:
    """The runs under `path`, not looking inside a run: a max_batch run's probes have summaries
    of their own. `visited` guards against a symlink back up the tree."""
    found = []
    for child in subdirs(path):
        if child.resolve() in visited:
            continue
        visited.add(child.resolve())
        found += [child] if is_run_dir(child) else runs_below(child, visited)
    return found


def subdirs(path: Path) -> list[Path]:
    """Subdirectories in the order a person expects: 2 before 10."""
    def natural(p: Path) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", p.name)]

    return sorted((p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")), key=natural)


def load_run(run_dir: Path) -> Run | Skipped:
    path = run_dir / SUMMARY
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
    if summary["status"] == "interrupted" and summary.get("samples_per_s") is None:  # stopped before a logged step
        return Skipped(str(run_dir), INTERRUPTED)
    overrides = summary["overrides"] if "overrides" in summary else read_yaml(run_dir / ".hydra" / "overrides.yaml")
    config = read_yaml(run_dir / ".hydra" / "config.yaml")
    return Run(str(run_dir), Summary.of(summary), list(overrides or []), config if isinstance(config, dict) else {})


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
        raise CompareError(f"--wandb {group}: could not read the group's runs from wandb project {where} "
                           f"({one_line(err, named=True)})") from None
    if not found:
        raise CompareError(f"--wandb {group}: wandb project {where} has no runs in group {group!r}")
    return [r for r in loaded if isinstance(r, Run)], [r for r in loaded if isinstance(r, Skipped)]


def wandb_run(run: Any) -> Run | Skipped:
    if run.state == "running":
        return Skipped(run.url, "still running on wandb")
    if run.state == "killed":
        return Skipped(run.url, INTERRUPTED)
    summary = Summary.of({k: v for k, v in run.summary.items() if not k.startswith("_")})
    config = dict(run.config)
    # wandb keeps no list or dict in its summary, so the status and task come from the run itself.
    summary.status = summary.status or ("ok" if run.state == "finished" else "failed")
    summary.choices = {"task": summary.task or run.job_type or "train"}
    return Run(run.url, summary, [t for t in run.tags if "=" in t], config)
