"""Every run is checked before the first starts, on the config Hydra composed for it.

Hydra composes each run once; the check builds its plan (fsdp_exp.driver.plan) from that
config. A -m sweep is checked by its sweeper (hydra_plugins/fsdp_exp_sweeper), which
composes every combination, checks it before it hands any to the launcher, and hands the
plans to the task function it was given, which runs them. A single run is checked by the
task function (fsdp_exp.commands.experiment's `RunTask`), which takes back what Hydra wrote
for it when the check refuses it. Bad input ends the command with one line and exit 2
(fsdp_exp.commands.experiment), and nothing is left of it.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
import shutil
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from fsdp_exp import config
from fsdp_exp.driver.conf_dir import CONF_DIR
from fsdp_exp.driver.plan import RunPlan, prepare
from fsdp_exp.errors import ConfigError

T = TypeVar("T")

@dataclass(frozen=True)
class Refused:
    """A run of a sweep that its check refused: the sweep runs the others."""

    reason: str


Plans = Mapping[tuple[str, ...], RunPlan | Refused]


@dataclass
class CheckedSweep:
    """What checking a sweep found: the runs to launch, the plan of each by run (`run_key`),
    and the keys the sweep varies, which name its runs."""

    launch: list[list[str]] = field(default_factory=list)
    plans: dict[tuple[str, ...], RunPlan | Refused] = field(default_factory=dict)
    swept: set[str] = field(default_factory=set)


@runtime_checkable
class TakesPlans(Protocol):
    """A task function that runs the plans the check made (fsdp_exp.commands.experiment's `RunTask`); a run
    whose plan it was not handed (a launcher plugin's, in another process) it checks itself.
    After a sweep it is handed what the launcher returned for each run (`take_outcomes`)."""

    def take_plans(self, plans: Plans, swept: set[str]) -> None: ...

    def take_outcomes(self, results: Sequence[Any]) -> None: ...


def run_key(overrides: Sequence[str]) -> tuple[str, ...]:
    """A run's overrides less Hydra's own (`hydra.*`, `hydra/...`), which Hydra keeps apart."""
    return tuple(o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/")))


def swept_values(overrides: Sequence[str], swept: set[str]) -> list[str]:
    """A run's overrides of the keys its sweep varies (`swept`): its name among the sweep's runs."""
    return [o for o in overrides if o.partition("=")[0] in swept]


def swept_keys(runs: Sequence[Sequence[str]]) -> set[str]:
    """The keys whose values differ between the runs: what names a run of a sweep."""
    values: dict[str, set[str]] = {}
    for run in runs:
        for override in run:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    return {key for key, seen in values.items() if len(seen) > 1}


def check_run(cfg: DictConfig, hydra: DictConfig | None = None) -> RunPlan:
    """The plan of one composed run, after every check; a ConfigError says what is wrong.
    `hydra`: the run's hydra node, when `cfg` is the task function's (which has none)."""
    import torch

    plan = prepare(cfg, torch.cuda.device_count())
    check_launcher_plugin(hydra if hydra is not None else cfg.hydra)
    return plan


def check_sweep(runs: Sequence[Sequence[str]], compose: Callable[[list[str]], DictConfig]) -> CheckedSweep:
    """Compose (`compose`) and check every run of a sweep. A run whose check refused it is
    launched too, as a row of its own (`Refused`); one that does not compose is named here
    and left out. When every run is refused: the first one's ConfigError."""
    refused: list[tuple[Sequence[str], ConfigError]] = []
    checked = CheckedSweep(swept=swept_keys(runs))
    for overrides in runs:
        try:
            cfg = composed(lambda: compose(list(overrides)), overrides)
        except ConfigError as err:
            refused.append((overrides, err))
            continue
        checked.launch.append(list(overrides))
        try:
            checked.plans[run_key(overrides)] = check_run(cfg)
        except ConfigError as err:
            checked.plans[run_key(overrides)] = Refused(str(err))
            refused.append((overrides, err))
    if len(refused) == len(runs):
        raise refused[0][1]
    for overrides, err in refused:
        shown = " ".join(swept_values(overrides, checked.swept))
        print(f"fsdp_exp: refused {shown}: {err}; the sweep runs the other {len(runs) - len(refused)}",
              file=sys.stderr)
    return checked


def parse_overrides(texts: Sequence[str], config_loader: Any = None) -> list[Override]:
    """The command line's overrides, parsed by Hydra; a bad one as a one-line ConfigError."""
    return composed(lambda: OverridesParser.create(config_loader=config_loader).parse_overrides(list(texts)), texts)


def combinations(overrides: Sequence[Override]) -> list[list[str]]:
    """The runs of a -m sweep: every combination of the listed values, the first key
    varying slowest, as Hydra's basic sweeper orders them; a later override of a key
    replaces an earlier one."""
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


def check_launcher_plugin(hydra: DictConfig) -> None:
    """Hydra's submitit plugins run each run as one task, which starts the run's ranks itself."""
    plugin = str(OmegaConf.select(hydra, "launcher._target_", default=""))
    if not plugin.startswith("hydra_plugins.hydra_submitit_launcher."):
        return
    for key in ("nodes", "tasks_per_node"):
        if hydra.launcher[key] != 1:
            raise ConfigError(f"hydra.launcher.{key}={hydra.launcher[key]}: must be 1 (each run is one task that "
                              "starts its ranks on one node); for a run across nodes, use launcher=slurm")
    if plugin.endswith(".SlurmLauncher") and shutil.which("srun") is None:  # else a traceback from submitit
        raise ConfigError("hydra/launcher=submitit_slurm: no SLURM here (srun not found); "
                          "use hydra/launcher=submitit_local to try it on this machine")


def check_sweeper(hydra: DictConfig) -> None:
    """A -m sweep whose runs a launcher plugin runs in other processes: how each ended comes
    back to the command through fsdp_exp's sweeper (hydra/sweeper=fsdp_exp, the default), so
    under another sweeper those runs would end unseen by the command's exit code."""
    sweeper = str(OmegaConf.select(hydra, "sweeper._target_", default=""))
    launcher = str(OmegaConf.select(hydra, "launcher._target_", default=""))
    if sweeper.startswith("hydra_plugins.fsdp_exp_sweeper.") or launcher.endswith(".BasicLauncher"):
        return
    choices = hydra.runtime.choices
    raise ConfigError(f"hydra/sweeper={choices.get('hydra/sweeper')}: with hydra/launcher={choices.get('hydra/launcher')} "
                      "the runs end in other processes, and only fsdp_exp's sweeper (the default) hands back how "
                      "they ended; drop hydra/sweeper and list the values (key=a,b,c)")


# ---- composition errors as one line ---------------------------------------------------------
def composed(compose: Callable[[], T], overrides: Sequence[str] = ()) -> T:
    """`compose()` of `overrides`, its Hydra and OmegaConf errors as one-line ConfigErrors."""
    try:
        return compose()
    except (HydraException, OmegaConfBaseException) as err:
        raise config_error(err, overrides) from None


def refuse_a_sweep(overrides: Sequence[str]) -> None:
    """A list of values (`sharding=ddp,full`) is a sweep, which one run cannot take: refused
    in one line, by Hydra's own parse of the overrides."""
    for override in parse_overrides(overrides):
        if override.is_sweep_override():
            raise ConfigError(f"{override.input_line}: a list of values is a sweep; add -m (--multirun)",
                              key=override.get_key_element().lstrip("+~"))


def typed_key(key: str, overrides: Sequence[str]) -> str:
    """The key as the command line typed it, where it names `key` or a key below it."""
    for override in overrides:
        typed = override.lstrip("+~").partition("=")[0]
        if typed == key or typed.startswith(f"{key}."):
            return typed
    return key


def config_error(err: Exception, overrides: Sequence[str] = ()) -> ConfigError:
    """A Hydra or OmegaConf composition error as one line: the key, and what is allowed
    (`overrides`: the command line's, where a key it typed is below the one missing)."""
    if isinstance(err, OverrideParseException):
        return ConfigError(f"{err.override}: not a valid override ({err.message.strip().splitlines()[0]})")
    if isinstance(err, MissingConfigException) and "/" in (err.missing_cfg_file or ""):
        group, _, name = err.missing_cfg_file.rpartition("/")
        if err.options is not None:
            options, one_of = [o for o in err.options if not o.startswith("schema_")], "one"  # schemas, not options
        else:  # one of a list (logger=[a,b])
            options, one_of = sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")), "one or more"
        if options:
            return ConfigError(f"{group}={name}: no such option; choose {one_of} of: {', '.join(options)}",
                               key=group, value=name, refusal=ConfigError.NO_SUCH_OPTION)
    missing = err.__context__  # a key that an option's file sets: Hydra chains no cause, and names the file only
    in_option = re.match(r"In '([^']+)': ", str(err))  # in its message
    if in_option and isinstance(missing, (ConfigAttributeError, ConfigKeyError)) and missing.full_key:
        return config.unknown_key_in_option(in_option.group(1), missing.full_key, missing.object_type)
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    key = getattr(cause, "full_key", None)
    first_line = str(getattr(cause, "msg", None) or cause).strip().split("\n")[0]
    if key is None:
        return ConfigError(first_line)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):  # a key the node does not have
        return config.unknown_key(key, getattr(cause, "object_type", None), typed_key(key, overrides))
    value = getattr(cause, "value", None)
    allowed = what_is_allowed(getattr(cause, "object_type", None), getattr(cause, "key", None), value)
    return ConfigError(f"{key}={'null' if value is None else value}: {allowed or first_line}")


def what_is_allowed(settings: Any, key: Any, value: Any) -> str | None:
    """What the settings class `settings` (the dataclass of the node OmegaConf refused a value
    for) allows at `key`, from the field's declared type; None where it does not say."""
    if not (dataclasses.is_dataclass(settings) and isinstance(key, str)):
        return None
    try:
        declared = typing.get_type_hints(settings).get(key)
    except (NameError, TypeError):  # a name only imported for type checking
        return None
    if declared is None:
        return None
    union = typing.get_origin(declared) in (typing.Union, types.UnionType)
    kinds = [k for k in typing.get_args(declared) if k is not type(None)] if union else [declared]
    if value is None and not (union and type(None) in typing.get_args(declared)):
        return "must have a value (null is not allowed)"
    words = []
    for kind in kinds:
        if dataclasses.is_dataclass(kind):
            return "is a group of settings; set one of its keys instead"
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return f"choose one of: {', '.join(str(member.value) for member in kind)}"
        words.append({bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind))
    if None in words or not words:
        return None
    return f"must be {' or '.join(words)}"
