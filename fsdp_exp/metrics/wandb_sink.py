"""conf/wandb: where a run's records go besides metrics.jsonl and the console: one wandb
run per experiment, mirroring metrics.jsonl."""

from __future__ import annotations

import logging
import os
import re
import uuid
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsdp_exp.errors import Choice, ConfigError, one_line

log = logging.getLogger("fsdp_exp")


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

    A measured CPU run has wandb's error reporting off (fsdp_exp.memory.MEASURING_ENVIRONMENT).
    """

    def __init__(self, mode: str, project: str, entity: str | None, group: str | None,
                 tags: list[str], config: dict, run_dir: Path, job_type: str, run_id: str | None = None):
        self.run: Any = None
        self.mode = str(mode)
        if mode == "disabled":
            return
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

    def where(self) -> str:
        """Where the run logs, in words: online at its page, offline in its folder (and how to
        upload it), or nowhere."""
        if self.run is None:
            return "disabled (wandb.mode=online or offline turns it on)" if self.mode == "disabled" else \
                "not logging: its start failed (the warning above says why)"
        if self.mode == "offline":
            folder = Path(self.run.dir).parent  # the offline run's folder; its files/ is run.dir
            return f"offline, in {folder} (wandb sync {folder} uploads it)"
        return f"online, at {self.run.url}" if getattr(self.run, "url", None) else "online"

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
