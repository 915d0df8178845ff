"""`python -m fsdp_exp`: the command line, through Hydra's own `@hydra.main`.

Hydra composes each run once, and the run is checked on that config (fsdp_exp.driver.check):
a -m sweep by fsdp_exp's sweeper, which checks every run before the first starts and hands
the plans it made to the task function; a single run by the task function, which takes back
what Hydra wrote for it when its check refuses it. Bad input ends in one line and exit 2,
and leaves nothing behind. A process that already has RANK and WORLD_SIZE (started by an
external torchrun) acts as one worker instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import Future
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from fsdp_exp import config, options
from fsdp_exp.driver.check import (
    Plans,
    Refused,
    check_run,
    check_sweeper,
    config_error,
    parse_overrides,
    refuse_a_sweep,
    run_key,
    swept_values,
)
from fsdp_exp.driver.compose import CONF_DIR, check_search_path, compose_config
from fsdp_exp.driver.external_torchrun import run_as_worker
from fsdp_exp.driver.outcomes import RunOutcomes
from fsdp_exp.driver.plan import RunPlan
from fsdp_exp.driver.run import run_experiment
from fsdp_exp.driver.sweep import SideBySide
from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.core import stop_on_signals, stop_signal
from fsdp_exp.metrics.summary import Summary
from fsdp_exp.linux import process_started


IMPORTED = time.time()  # the start-up's first mark after the command's (fsdp_exp.metrics.startup)
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 128  # + the signal, as a shell reports a process a signal ended: 130 for SIGINT, 143 for SIGTERM

options.register()
# Hydra warns of a pkg:// folder without an __init__.py that it then finds all the same
warnings.filterwarnings("ignore", message="provider=hydra.searchpath in command-line")


def main() -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        sys.exit(run_as_worker(sys.argv[1:], compose_config))
    stop_on_signals()
    side_by_side = SideBySide()
    task = RunTask(side_by_side)
    try:
        check_search_path(sys.argv[1:])
        if multirun(sys.argv[1:]):
            check_another_sweeper(overrides_of(sys.argv[1:]))
        else:
            refuse_a_sweep(overrides_of(sys.argv[1:]))
        shown = shown_config(sys.argv[1:])
        with hydra_raises():  # the sweeper (conf/config.yaml) or the task function checks each run
            hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(task)()
        if task.refused is not None:
            raise task.refused
        if shown:  # Hydra printed it without the checks a run makes: a refused one ends in its line
            check_run(compose_config(overrides_of(sys.argv[1:])))
        code = task.outcomes.exit_code()  # EXIT_RUN_FAILED when a run failed; EXIT_NONE_FITS: a search found that nothing fits
        if code:
            sys.exit(code)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:  # nothing has run yet
        error = err if isinstance(err, ConfigError) else config_error(err, overrides_of(sys.argv[1:]))
        error = builder_key_error(error, sys.argv[1:])
        print(f"fsdp_exp: {error}{swept_group_hint(error, sys.argv[1:])}{search_path_hint(error, sys.argv[1:])}",
              file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (kill, SLURM)
        if not getattr(err, "run_reported", False):  # the run in flight has logged where it stopped
            print("fsdp_exp: interrupted; each run's summary.json says where it stopped", file=sys.stderr)
        sys.exit(EXIT_STOPPED + stop_signal(err))
    finally:
        side_by_side.close()  # runs still in flight (Ctrl-C) stop their jobs before the command ends


def command() -> int:
    """`python -m fsdp_exp` and `fsdp-exp` (fsdp_exp.commands.experiment): main(), as the
    process's exit code. A message SystemExit carries is printed; an exception main() does
    not turn into an exit code is raised, with its traceback."""
    try:
        main()
        return 0
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)


@contextmanager
def hydra_raises() -> Iterator[None]:
    """Hydra's own switch (HYDRA_FULL_ERROR, as Hydra documents it) while the command runs:
    what composing a run found, and a check's refusal, reach `main` as the typed exceptions
    they are (read by their fields: fsdp_exp.driver.check's `config_error`), where Hydra
    would print them and exit 1. The user's own setting is back when the command ends."""
    users = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if users is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = users


def check_another_sweeper(overrides: list[str]) -> None:
    """`-m hydra/sweeper=<another>`: that sweeper launches the runs, so fsdp_exp's does not
    check them; what it cannot do with a launcher plugin (fsdp_exp.driver.check's
    `check_sweeper`) is refused here, on the sweep's config without its swept values."""
    chosen = {o.partition("=")[0].lstrip("+"): o.partition("=")[2] for o in overrides}
    if chosen.get("hydra/sweeper", "fsdp_exp") == "fsdp_exp":
        return
    fixed = [o.input_line for o in parse_overrides(overrides) if not o.is_sweep_override()]
    check_sweeper(compose_config(fixed).hydra)


# Hydra's flags that take a value, and those that do not: what is left are the overrides
FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                    "--config-dir", "-cd", "--experimental-rerun")
FLAGS = ("--resolve", "-m", "--multirun")


def shown_config(argv: list[str]) -> bool:
    """Whether the command is `--cfg job` (or `all`): Hydra prints the config and runs
    nothing, so the checks a run makes are made after it (`main`). With -m, one line:
    Hydra's own refusal is a traceback."""
    shown = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--cfg", "-c")), None)
    if shown not in ("job", "all"):
        return False
    if multirun(argv):
        raise ConfigError(f"--cfg {shown}: shows one run's config, not a -m sweep's; drop -m and give one value "
                          "of each key")
    return True


def multirun(argv: list[str]) -> bool:
    """Whether the command is a -m sweep (-m, --multirun, or hydra.mode=MULTIRUN)."""
    return any(a in ("-m", "--multirun") or a.partition("=")[::2] == ("hydra.mode", "MULTIRUN") for a in argv)


def overrides_of(argv: list[str]) -> list[str]:
    """The command line's overrides, without Hydra's flags and their values."""
    overrides, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif arg not in FLAGS and not arg.startswith("--"):
            overrides.append(arg)
    return overrides


def builder_key_error(error: ConfigError, argv: list[str]) -> ConfigError:
    """`model.n_head=8` on a model option without that key (or `data.num_sample=10` on a data
    set of the user's): Hydra's answer is to add it with `+model.n_head=8`, which is right
    only when the builder takes it. So the `+` is tried here, and when the builder does not
    take the key, the error says what it does take."""
    group = (error.key or "").partition(".")[0]
    if error.refusal != ConfigError.NEW_KEY or group not in ("model", "data") \
            or multirun(argv):
        return error
    given = next((a for a in argv if a.partition("=")[0] == error.key), None)
    if given is None:
        return error
    added = [f"+{a}" if a == given else a for a in overrides_of(argv)]
    try:
        option = getattr(config.build(compose_config(added)), group)
        if hasattr(option, "check_arguments"):
            option.check_arguments()
    except ConfigError as refused:
        if refused.refusal == ConfigError.UNKNOWN_KEY and refused.key == error.key:
            return refused
    except (HydraException, OmegaConfBaseException):
        pass
    return error


def search_path_hint(error: ConfigError, argv: list[str]) -> str:
    """For `model=mynet` without `hydra.searchpath`: an option of the user's own lives in
    their config folder, which Hydra reads only from its search path."""
    if error.refusal != ConfigError.NO_SUCH_OPTION or any(a.lstrip("+").startswith("hydra.searchpath") for a in argv):
        return ""
    group, name = error.key, error.value
    here = next((folder for folder in ("conf", "configs", "config")
                 if (Path.cwd() / folder / group / f"{name}.yaml").is_file()), None)
    if here:
        return f"; ./{here}/{group}/{name}.yaml is here: add 'hydra.searchpath=[file://./{here}]'"
    return (f"; an option of your own is read from your config folder: add 'hydra.searchpath=[file://./conf]' "
            f"(the folder that holds {group}/{name}.yaml)")


def swept_group_hint(error: ConfigError, argv: list[str]) -> str:
    """For `-m checkpoint=dcp,dcp_async checkpoint.every=1`: Hydra composes a sweep's base
    config with each swept group's default first (checkpoint=none has no `every`), so a key
    of the group is refused there; `++` sets it all the same (hydra#2888)."""
    if error.refusal != ConfigError.UNKNOWN_KEY or not multirun(argv):
        return ""
    group = (error.key or "").partition(".")[0]
    swept = any(a.startswith(f"{group}=") and "," in a for a in argv)
    given = next((a for a in argv if a.partition("=")[0] == error.key), None)
    if not swept or given is None:
        return ""
    return (f" (a -m sweep over {group} is first composed with {group}'s default; "
            f"write ++{given} to set it in every run of the sweep)")


class RunTask:
    """Hydra's task function: one run, from the plan the sweeper's check made and handed
    over (a -m sweep), or checked here: a single run, and a sweep's run that Hydra's launcher
    plugin starts in another process. A single run its check refuses is not run: what Hydra
    wrote for it is taken back (`unwrite`), and its ConfigError kept in `refused`, which
    `main` prints as the command's one line. A sweep's run on a launcher with `max_parallel` > 1
    starts beside the others (fsdp_exp.driver.sweep): its future summary is what it returns.
    How each run ended is kept in `outcomes`, which the command's exit code is made of."""

    def __init__(self, side_by_side: SideBySide) -> None:
        self.side_by_side = side_by_side
        self.plans: dict[tuple[str, ...], RunPlan | Refused] = {}
        self.swept: set[str] = set()  # the keys a sweep varies, which name its runs
        self.outcomes = RunOutcomes()
        self.refused: ConfigError | None = None  # the single run's check refused it: the command's one line

    def take_plans(self, plans: Plans, swept: set[str]) -> None:
        self.plans.update(plans)
        self.swept = swept or self.swept

    def take_outcomes(self, results: Sequence[JobReturn]) -> None:
        self.outcomes.launched(results)

    def __getstate__(self) -> dict:
        """To a launcher plugin's process, which checks its run there again: without the plans
        and the outcomes, which are the driver's."""
        return {**self.__dict__, "plans": {}, "outcomes": RunOutcomes()}

    def __call__(self, cfg: DictConfig) -> Summary | Future | None:
        run_dir, summary = self.run(cfg)
        if summary is not None:
            self.outcomes.ran(str(run_dir), summary, in_sweep=HydraConfig.get().mode == RunMode.MULTIRUN)
        return summary

    def run(self, cfg: DictConfig) -> tuple[Path, Summary | Future | None]:
        hc = HydraConfig.get()
        sweep = hc.mode == RunMode.MULTIRUN
        choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/")}
        group = Path(hc.sweep.dir).as_posix().replace("/", "_") if sweep else None
        overrides = list(hc.overrides.task)
        run_dir = Path(hc.runtime.output_dir)
        try:
            plan = self.plans.pop(run_key(overrides), None) or check_run(cfg, hydra=hc)
        except ConfigError as err:
            if not sweep:  # the command's one run: refused in one line (main), with nothing left of it
                unwrite(run_dir, hc)
                self.refused = err
                return run_dir, None
            plan = Refused(str(err))
        if isinstance(plan, Refused):  # one bad combination of a sweep: a row of its own, the others run
            summary = Summary(status="refused", error=plan.reason, overrides=overrides, choices=choices)
            summary.write(run_dir)
            return run_dir, summary
        startup = {"command": process_started(), "imported": IMPORTED, "composed": time.time()}
        launcher = plan.launcher
        if plan.task.runs_in_driver or not (sweep and launcher.max_parallel > 1
                                            and str(hc.launcher._target_).endswith(".BasicLauncher")):
            return run_dir, run_experiment(plan, run_dir, overrides, choices, group, startup=startup)
        launcher.connect(plan.nproc, launcher.max_parallel)
        shown = swept_values(overrides, self.swept)
        name = f"run {hc.job.num} ({' '.join(shown)})" if shown else f"run {hc.job.num}"
        return run_dir, self.side_by_side.start(name, run_dir, launcher.max_parallel,
                                                lambda: run_experiment(plan, run_dir, overrides, choices, group,
                                                                       startup=startup))


def unwrite(run_dir: Path, hydra: DictConfig) -> None:
    """Takes back what Hydra wrote for a run before the task function began: its log file
    while empty (Hydra appends to one that is there), its config under `hydra.output_subdir`,
    and the folders it made, each while empty, up to the folder the command started in. A
    file of anyone else's stays. In the folder of an earlier run (its summary.json, or a log
    with lines in it) the config Hydra wrote over the earlier one's stays too, as after any
    run there: the earlier one's is gone once Hydra has written."""
    logs = [handler for handler in logging.getLogger().handlers
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir]
    earlier = (run_dir / "summary.json").exists()
    for handler in logs:
        logging.getLogger().removeHandler(handler)
        handler.close()
        log = Path(handler.baseFilename)
        if log.exists() and log.stat().st_size > 0:
            earlier = True
        else:
            log.unlink(missing_ok=True)
    folders = [run_dir, *run_dir.parents]
    if hydra.output_subdir is not None and not earlier:
        saved = run_dir / str(hydra.output_subdir)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (saved / name).unlink(missing_ok=True)
        folders.insert(0, saved)
    started_in = Path(hydra.runtime.cwd)
    for folder in folders:
        mine = folder == run_dir or run_dir in folder.parents or started_in in folder.parents
        if folder == started_in or not mine:
            break
        try:
            folder.rmdir()  # only when empty
        except OSError:
            break


def compose_checked(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The composed config for these overrides, with the hydra node, after every check
    (Python's way to the command line's check, for tests and notebooks)."""
    cfg = compose_config(overrides, config_name)
    check_run(cfg)
    return cfg

