"""Where each run's figures go as it trains: metrics.jsonl, the console and wandb (summary.json: fsdp_exp.metrics.summary)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsdp_exp.errors import Choice, ConfigError, one_line

log = logging.getLogger("fsdp_exp")


METRICS = "metrics.jsonl"  # a run directory's records, one a logged step, written by rank 0


class JsonLines:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open until close()

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()

    @staticmethod
    def read(path: Path) -> list[dict]:
        """The records a run wrote (none where there is no file); a line cut short (a run
        killed while writing) says nothing and is skipped."""
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def record_line(record: dict, total_steps: int) -> str:
    return f"step {record['step']:>{len(str(total_steps))}}/{total_steps}  {record_figures(record)}"


def record_figures(record: dict) -> str:
    parts = [f"loss {record['loss']:.4f}"]
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    parts.append(f"{record['samples_per_s']:,.1f} samples/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu']:.1%}")
    elif "tflops_per_device" in record:
        parts.append(f"{record['tflops_per_device']:.3f} TFLOP/s")
    parts.append(f"peak {record['peak_mem_gb']:.2f} GB")
    if record.get("warmup"):  # its throughput is not the run's: no average counts it
        parts.append("(warm-up)")
    return "  ".join(parts)


def duration(seconds: float) -> str:
    """A time span as a person reads it: 45 s, 3 min 20 s, 1 h 05 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _is_sized_terminal() -> bool:
    """A terminal wide enough to draw a bar (a pty with no size reports 0 columns)."""
    try:
        return sys.stdout.isatty() and os.get_terminal_size(sys.stdout.fileno()).columns > 0
    except (OSError, ValueError):
        return False


class Progress:
    """Rank 0's console: a live bar on a terminal, a plain line per record otherwise. Both
    say how long is left once a step after the first has been timed.

    `clock`: seconds, for the step times (a test gives its own)."""

    LONG_S = 60  # without a bar, a run with more left than this says so as soon as it knows

    def __init__(self, total_steps: int, live: bool | None = None, done: int = 0,
                 clock: Callable[[], float] = time.perf_counter):
        self.total_steps = total_steps
        self.step = done
        self.clock = clock
        self.step_times: list[float] = []  # this attempt's, each from the end of the step before
        self.last_end: float | None = None
        self.shown: str = ""  # the last record's figures, on the bar
        self.told_time_left = False
        self.bar: Any = None
        if _is_sized_terminal() if live is None else live:
            from tqdm import tqdm

            # tqdm's own estimate of the time left is left out: it counts the first step,
            # which also counts FLOPs (and compiles), so it would say two different things.
            self.bar = tqdm(total=total_steps, initial=done, unit="step", dynamic_ncols=True, file=sys.stdout,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def step_time_s(self) -> float | None:
        """The mean time of this attempt's steps after its first; None until one is timed.
        The first step is left out: it also counts the FLOPs, touches all its memory for the
        first time, and a compiled model compiles in it."""
        timed = self.step_times[1:]
        return sum(timed) / len(timed) if timed else None

    def time_left_s(self) -> float | None:
        step_time = self.step_time_s()
        return None if step_time is None else step_time * (self.total_steps - self.step)

    def left(self) -> str:
        """`"3 min 20 s left"`, or nothing when not known yet or no step is left."""
        left = self.time_left_s()
        return f"{duration(left)} left" if left and self.step < self.total_steps else ""

    def before_step(self, step: int) -> None:
        if self.last_end is None:
            self.last_end = self.clock()

    def after_step(self, step: int) -> None:
        now = self.clock()
        if self.last_end is not None:
            self.step_times.append(now - self.last_end)
        self.last_end, self.step = now, step
        if self.bar is not None:
            self.bar.update(1)
            self._show()
        elif not self.told_time_left and (self.time_left_s() or 0) > self.LONG_S:
            self.told_time_left = True  # records may be many minutes apart (train.log_every)
            log.info("step %d/%d: %s a step, %s", step, self.total_steps, duration(self.step_time_s()), self.left())

    def log(self, record: dict) -> None:
        line = record_line(record, self.total_steps)
        if self.bar is not None:
            self.shown = record_figures(record)  # the bar shows the step
            self._show()
            logging.getLogger("fsdp_exp.rank_file").info(line)
        else:
            left = self.left()
            log.info(f"{line}  {left}" if left else line)

    def _show(self) -> None:
        self.bar.set_postfix_str(", ".join(part for part in (self.left(), self.shown) if part), refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class WandbMode(Choice):
    auto = "auto"
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class WandbSettings:
    """conf/wandb/*: one wandb run per experiment, mirroring metrics.jsonl."""

    mode: WandbMode = WandbMode.auto  # auto: WANDB_MODE, else online with an API key, else offline
    project: str | None = None  # None: WANDB_PROJECT, else fsdp_exp
    entity: str | None = None  # None: WANDB_ENTITY, else the API key's default entity
    group: str | None = None  # None: the multirun sweep's directory, or none for a single run
    tags: list[str] = field(default_factory=list)  # the overrides are added
    id: str | None = None  # None: a new run id, kept by restarts and requeues; or a run to continue (online)
    job_type: str | None = None  # None: the task (train, max_batch, ...); a max_batch probe's runs: probe, verify

    def __post_init__(self) -> None:
        if self.id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(self.id)):
            raise ConfigError(f"wandb.id={self.id}: at most 64 letters, digits, '-' or '_'")

    def resolved(self) -> WandbSettings:
        """What every attempt of one run logs with, fixed once on the driver: ranks restarted
        or requeued from this run log to the same wandb run, in the same place. The id is
        drawn here. Where the config leaves a setting open, wandb's own variables decide,
        as in wandb itself: WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY."""
        return replace(
            self, mode=WandbMode(resolve_wandb_mode(self.mode)), project=self.project or wandb_project(),
            entity=self.entity or os.environ.get("WANDB_ENTITY") or None, id=self.id or uuid.uuid4().hex[:16])

    def for_run(self, overrides: list[str], group: str | None, job_type: str) -> WandbSettings:
        """The run's tags (its overrides), its group (the sweep) and its job type (the task)."""
        return replace(self, tags=[*self.tags, *overrides], group=self.group or group,
                       job_type=self.job_type or job_type)

    def sink(self, config: dict, run_dir: Path) -> Wandb:
        return Wandb(mode=self.mode, project=self.project, entity=self.entity, group=self.group, tags=self.tags,
                     config=config, run_dir=run_dir, job_type=self.job_type or "train", run_id=self.id)


def wandb_project() -> str:
    return os.environ.get("WANDB_PROJECT") or "fsdp_exp"


def resolve_wandb_mode(mode: str) -> str:
    """`auto`: WANDB_MODE when set, else online when an API key is configured (WANDB_API_KEY
    or ~/.netrc), else offline."""
    if mode != "auto":
        return str(WandbMode(mode).value)
    from_env = os.environ.get("WANDB_MODE")
    if from_env:
        env_mode = {"dryrun": "offline", "run": "online"}.get(from_env, from_env)  # wandb's older names
        allowed = [m.value for m in WandbMode if m is not WandbMode.auto]
        if env_mode not in allowed:
            raise ConfigError(f"WANDB_MODE={from_env}: with wandb.mode=auto, choose one of: {', '.join(allowed)}")
        return env_mode
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    return "online" if has_key else "offline"


class Wandb:
    """Mirrors the records to one wandb run. A wandb failure is one warning; training goes on.

    `run_id` is the same for every attempt of a run (restarts, requeues): online, a restarted
    run continues its wandb run; offline (wandb cannot resume there), each attempt is one
    offline run directory under that id.

    wandb's error reporting is off unless WANDB_ERROR_REPORTING says otherwise: with it,
    wandb (0.31, offline runs too) starts two OpenTelemetry export threads at the first
    `log`, mid-run, whose stacks add 16 MB to rank 0's peak as memory.limit_gb counts it,
    memory no other rank and no estimate has.
    """

    def __init__(self, mode: str, project: str, entity: str | None, group: str | None,
                 tags: list[str], config: dict, run_dir: Path, job_type: str, run_id: str | None = None):
        self.run: Any = None
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        try:
            import wandb

            self.run = wandb.init(
                mode=mode, project=project, entity=entity, group=group,
                tags=[t[:64] for t in tags] or None,  # wandb caps a tag at 64 characters
                config=config, dir=str(run_dir), job_type=job_type, name=run_dir.name,
                id=run_id, resume="allow" if run_id and mode == "online" else None,
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as err:  # noqa: BLE001 - any wandb failure must not stop training
            warnings.warn(  # no stacklevel: the caller is wandb setup, not user code
                f"wandb ({mode}) failed, training goes on without it: {one_line(err, named=True)}")

    def log(self, record: dict) -> None:
        if self.run is not None:
            self.run.log(plain(record), step=record["step"])

    def finish(self, summary: dict) -> None:
        if self.run is None:
            return
        self.run.summary.update(plain(summary))
        self.run.finish()


def plain(record: dict) -> dict:
    """A record's single values, without its step and its figures that are None: wandb
    converts any other value the slow way, and to see whether it is a pandas DataFrame it
    imports pandas (about 15 MB and half a second in the process that logs)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (bool, int, float, str))}


def write_json(path: Path, record: dict) -> None:
    """Written whole, then moved into place: a reader never sees half of it."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict | None:
    """A record write_json wrote, or None when there is none (or not a whole one)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
