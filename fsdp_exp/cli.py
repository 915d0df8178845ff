"""`python -m fsdp_exp`: the command line. Compose and check every run, then hand each
run's plan to Hydra's run (or sweep), which makes its output directory and runs it.

Every override (each combination of a -m sweep) is composed and checked before Hydra makes
an output directory, so bad input leaves nothing behind; the plan made by that check is
the one the run uses. A process that already has RANK and WORLD_SIZE (started by an
external torchrun) acts as one worker instead.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_exp import config, options
from fsdp_exp.driver.plan import RunPlan, prepare
from fsdp_exp.driver.run import run_experiment
from fsdp_exp.driver.sweep import SideBySide
from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.launch.core import stop_on_signals, stop_signal
from fsdp_exp.metrics.sinks import write_summary
from fsdp_exp.metrics.startup import process_started


def find_conf_dir() -> str:
    """conf/: inside an installed package (setup.py ships it as fsdp_exp/conf), or at the
    top of the checkout (a source tree, or an editable install)."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"fsdp_exp's conf/ is in neither {package} nor {package.parent}; reinstall fsdp_exp")


CONF_DIR = find_conf_dir()
IMPORTED = time.time()  # the start-up's first mark after the command's (fsdp_exp.metrics.startup)
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 128  # + the signal, as a shell reports a process a signal ended: 130 for SIGINT, 143 for SIGTERM

options.register()


def main() -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from fsdp_exp.launch.external import run_as_worker

        sys.exit(run_as_worker(sys.argv[1:], compose_config))
    stop_on_signals()
    side_by_side = SideBySide()
    try:
        plans = precheck(sys.argv[1:])
        # RunOutcomes (conf/config.yaml) ends the process with EXIT_RUN_FAILED when a run failed
        hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(run_function(plans, side_by_side))()
    except ConfigError as err:  # from precheck: nothing has run yet
        print(f"fsdp_exp: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (kill, SLURM)
        if not getattr(err, "run_reported", False):  # the run in flight has logged where it stopped
            print("fsdp_exp: interrupted; each run's summary.json says where it stopped", file=sys.stderr)
        sys.exit(EXIT_STOPPED + stop_signal(err))
    finally:
        side_by_side.close()  # runs still in flight (Ctrl-C) stop their jobs before the command ends


def run_function(plans: dict[tuple[str, ...], RunPlan | Refused], side_by_side: SideBySide) -> Callable[[DictConfig], Any]:
    """Hydra's task function: one run, from the plan the check made of it (`plans`, by its
    overrides); composed and checked again only where the check did not see the run (a run
    that Hydra's launcher plugin starts in another process). A sweep's run on a launcher
    with `max_parallel` > 1 starts beside the others (fsdp_exp.driver.sweep): its future
    summary is what it returns."""
    swept = swept_keys(list(plans))

    def run(cfg: DictConfig) -> dict | Future:
        import torch
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        sweep = hc.mode == RunMode.MULTIRUN
        choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/")}
        group = Path(hc.sweep.dir).as_posix().replace("/", "_") if sweep else None
        overrides = list(hc.overrides.task)
        plan = plans.pop(run_key(overrides), None) or prepare(cfg, torch.cuda.device_count())
        run_dir = Path(hc.runtime.output_dir)
        if isinstance(plan, Refused):  # one bad combination of a sweep: a row of its own, the others run
            summary = {"status": "refused", "error": plan.reason, "overrides": overrides, "choices": choices}
            write_summary(run_dir, summary)
            return summary
        startup = {"command": process_started(), "imported": IMPORTED, "composed": time.time()}
        launcher = plan.launcher
        if plan.task.runs_in_driver or not (sweep and launcher.max_parallel > 1
                                            and str(hc.launcher._target_).endswith(".BasicLauncher")):
            return run_experiment(plan, run_dir, overrides, choices, group, startup=startup)
        launcher.connect(plan.nproc, launcher.max_parallel)
        shown = [o for o in overrides if o.partition("=")[0] in swept]
        name = f"run {hc.job.num} ({' '.join(shown)})" if shown else f"run {hc.job.num}"
        return side_by_side.start(name, run_dir, launcher.max_parallel,
                                  lambda: run_experiment(plan, run_dir, overrides, choices, group, startup=startup))

    return run


def swept_keys(runs: list[tuple[str, ...]]) -> set[str]:
    """The keys whose values differ between the runs: what names a run of a sweep."""
    values: dict[str, set[str]] = {}
    for run in runs:
        for override in run:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    return {key for key, seen in values.items() if len(seen) > 1}


def run_key(overrides: list[str]) -> tuple[str, ...]:
    """A run's overrides less Hydra's own (`hydra.*`, `hydra/...`), which Hydra keeps apart."""
    return tuple(o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/")))


@dataclass(frozen=True)
class Refused:
    """A run of a sweep that its check refused: the sweep runs the others."""

    reason: str


def precheck(argv: list[str]) -> dict[tuple[str, ...], RunPlan | Refused]:
    """Compose and check every run the command line asks for. The plan of each run, by its
    overrides (`run_key`). A single run, or a sweep whose every run is refused, raises the
    first run's ConfigError; a sweep's refused runs are named on stderr and the rest run."""
    args = get_args_parser().parse_args(argv)  # Hydra's own parser: no public API gives it
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return {}
    import torch

    config_name = args.config_name or "config"
    parsed = [parse_override(text) for text in args.overrides]
    runs = sweep_runs(parsed) if args.multirun else [args.overrides]
    plans: dict[tuple[str, ...], RunPlan | Refused] = {}
    refused: list[tuple[list[str], ConfigError]] = []
    for overrides in runs:
        try:
            cfg = compose_config(list(overrides), config_name)
            plans[run_key(list(overrides))] = prepare(cfg, torch.cuda.device_count())
            check_launcher_plugin(cfg)
        except ConfigError as err:
            if not args.multirun:
                raise
            plans[run_key(list(overrides))] = Refused(str(err))
            refused.append((list(overrides), err))
    if refused and len(refused) == len(runs):
        raise refused[0][1]
    swept = swept_keys(list(plans))
    for overrides, err in refused:
        shown = " ".join(o for o in overrides if o.partition("=")[0] in swept)
        print(f"fsdp_exp: refused {shown}: {err}; the sweep runs the other {len(runs) - len(refused)}",
              file=sys.stderr)
    return plans


def check_launcher_plugin(cfg: DictConfig) -> None:
    """Hydra's submitit plugins run each run as one task, which starts the run's ranks itself."""
    plugin = str(OmegaConf.select(cfg, "hydra.launcher._target_", default=""))
    if not plugin.startswith("hydra_plugins.hydra_submitit_launcher."):
        return
    for key in ("nodes", "tasks_per_node"):
        if cfg.hydra.launcher[key] != 1:
            raise ConfigError(f"hydra.launcher.{key}={cfg.hydra.launcher[key]}: must be 1 (each run is one task that "
                              "starts its ranks on one node); for a run across nodes, use launcher=slurm")
    if plugin.endswith(".SlurmLauncher") and shutil.which("srun") is None:  # else a traceback from submitit
        raise ConfigError("hydra/launcher=submitit_slurm: no SLURM here (srun not found); "
                          "use hydra/launcher=submitit_local to try it on this machine")


def sweep_runs(overrides: list[Override]) -> list[list[str]]:
    """The runs of a -m sweep, in the order Hydra's basic sweeper runs them: every
    combination of the listed values, a later override of a key in place of an earlier one."""
    values: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override() and not override.is_discrete_sweep():
            raise ConfigError(f"{override.input_line}: a range sweep needs a sweeper plugin; list the values "
                              "instead (key=a,b,c)")
        if override.is_sweep_override():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(run) for run in itertools.product(*values.values())]


def parse_override(text: str) -> Override:
    try:
        return OverridesParser.create().parse_override(text)
    except HydraException as err:
        raise ConfigError(f"{text}: not a valid override ({one_line(err)})") from None


def compose_checked(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The composed config for these overrides, with the hydra node, after every check."""
    import torch

    cfg = compose_config(overrides, config_name)
    prepare(cfg, torch.cuda.device_count())
    return cfg


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The composed config with the hydra node; composition errors as one-line ConfigErrors."""
    check_search_path(overrides)
    with warnings.catch_warnings():
        # Hydra warns of a pkg:// folder without an __init__.py that it then finds all the same
        warnings.filterwarnings("ignore", message="provider=hydra.searchpath in command-line")
        try:
            with initialize_config_dir(CONF_DIR, version_base="1.3", job_name="fsdp_exp"):
                cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(explain(err)) from None
    return cfg


def check_search_path(overrides: list[str]) -> None:
    """Each folder or package of `hydra.searchpath=[...]` is there: Hydra only warns of one
    that is not, and then reports the options it holds as missing."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") != "hydra.searchpath":
            continue
        for entry in value.strip("[]").split(","):
            scheme, _, where = entry.strip().strip("'\"").partition("://")
            if scheme == "file" and not Path(where).expanduser().is_dir():
                raise ConfigError(f"hydra.searchpath: {entry.strip()}: no such folder")
            if scheme == "pkg" and importlib.util.find_spec(where.split(".")[0]) is None:
                raise ConfigError(f"hydra.searchpath: {entry.strip()}: no such package here")
            if scheme == "pkg" and not _package_folder(where):
                top, _, rest = where.partition(".")
                raise ConfigError(f"hydra.searchpath: {entry.strip()}: package {top} has no {rest.replace('.', '/')}/ "
                                  "folder, so the search path adds no configs")


def _package_folder(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False


def explain(err: Exception) -> str:
    """One line from a Hydra or OmegaConf composition error: the key, and what is allowed."""
    if isinstance(err, MissingConfigException) and err.options is not None:
        group, _, name = (err.missing_cfg_file or "").rpartition("/")
        options = [o for o in err.options if not o.startswith("schema_")]  # schemas, not options
        return f"{group}={name}: no such option; choose one of: {', '.join(options)}"
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    key = getattr(cause, "full_key", None)
    first_line = str(getattr(cause, "msg", None) or cause).strip().split("\n")[0]
    if key is None:
        match = re.search(r"argument '([^']+)'", first_line)
        if "Ambiguous value" in first_line and match:
            return f"{match.group(1)}: a list of values is a sweep; add -m (--multirun)"
        return first_line
    if "Could not override" in first_line or "Key '" in first_line:
        return str(config.unknown_key(key, getattr(cause, "object_type", None)))
    value = getattr(cause, "value", None)
    return f"{key}={'' if value is None else value}: {reason(first_line)}"


def reason(omegaconf_message: str) -> str:
    for pattern, text in [
        (r"converted to Integer", "must be an integer"),
        (r"converted to Float", "must be a number"),
        (r"not a valid bool", "must be true or false"),
        (r"is not Optional", "must have a value (null is not allowed)"),
        (r"is not a subclass of", "is a group of settings; set one of its keys instead"),
    ]:
        if re.search(pattern, omegaconf_message):
            return text
    match = re.search(r"expected one of \[([^\]]*)\]", omegaconf_message)
    if match:
        return f"choose one of: {match.group(1)}"
    return omegaconf_message


if __name__ == "__main__":
    main()
