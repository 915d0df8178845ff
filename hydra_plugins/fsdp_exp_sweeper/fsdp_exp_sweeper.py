"""hydra/sweeper=fsdp_exp: a -m sweep whose every run is composed and checked before the
first starts (fsdp_exp.driver.check), then handed to Hydra's launcher as one batch; the
plans the check made go to the task function (fsdp_exp.commands.experiment's `RunTask`), which runs them,
and what the launcher returned for each run goes to it after the launch (the command's exit code).

Hydra finds sweepers in the hydra_plugins namespace package (and loads this module
outside sys.modules, so its annotations are not postponed); this one is the default of
fsdp_exp's config. It runs every combination of the listed values, in the order of
Hydra's basic sweeper. Each run is composed once: the launcher is handed the config the
check composed (`ComposedOnce`), not a second composing of the same overrides.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_loader import ConfigLoader
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigSource
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, OmegaConf

from fsdp_exp.driver.check import TakesPlans, check_sweep, combinations, parse_overrides


@dataclass
class CheckingSweeperConf:
    _target_: str = "hydra_plugins.fsdp_exp_sweeper.fsdp_exp_sweeper.CheckingSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="fsdp_exp", node=CheckingSweeperConf, provider="fsdp_exp")


class ComposedOnce(ConfigLoader):
    """Hydra's config loader, as the sweeper hands it to the launcher: a run's config that
    the check has composed is given out once more as it is, in place of composing its
    overrides again. Every other method of Hydra's ConfigLoader interface is the loader's own."""

    def __init__(self, loader: ConfigLoader) -> None:
        self.loader = loader
        self.composed: Dict[Tuple[str, ...], DictConfig] = {}

    def compose(self, master: DictConfig, overrides: List[str]) -> DictConfig:
        """A run's config, composed, and kept for the launcher."""
        cfg = self.loader.load_sweep_config(master, list(overrides))
        self.composed[tuple(overrides)] = cfg
        return cfg

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig:
        kept = self.composed.pop(tuple(sweep_overrides), None)
        return kept if kept is not None else self.loader.load_sweep_config(master_config, sweep_overrides)

    def load_configuration(self, config_name: Optional[str], overrides: List[str], run_mode: RunMode,
                           from_shell: bool = True, validate_sweep_overrides: bool = True) -> DictConfig:
        return self.loader.load_configuration(config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    def get_search_path(self) -> ConfigSearchPath:
        return self.loader.get_search_path()

    def get_sources(self) -> List[ConfigSource]:
        return self.loader.get_sources()

    def list_groups(self, parent_name: str) -> List[str]:
        return self.loader.list_groups(parent_name)

    def get_group_options(self, group_name: str, results_filter: Optional[ObjectType] = ObjectType.CONFIG,
                          config_name: Optional[str] = None, overrides: Optional[List[str]] = None) -> List[str]:
        return self.loader.get_group_options(group_name, results_filter, config_name, overrides)

    def compute_defaults_list(self, config_name: Optional[str], overrides: List[str], run_mode: RunMode) -> Any:
        return self.loader.compute_defaults_list(config_name, overrides, run_mode)


class CheckingSweeper(Sweeper):
    def __init__(self) -> None:
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Any = None
        self.loader: Optional[ComposedOnce] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        self.loader = ComposedOnce(hydra_context.config_loader)
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=HydraContext(config_loader=self.loader, callbacks=hydra_context.callbacks),
            task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        assert self.config is not None and self.loader is not None
        runs = combinations(parse_overrides(arguments, self.loader.loader))
        checked = check_sweep(runs, lambda overrides: self.loader.compose(self.config, overrides))
        if isinstance(self.task_function, TakesPlans):
            self.task_function.take_plans(checked.plans, checked.swept)
        sweep_dir = Path(self.config.hydra.sweep.dir)  # as Hydra's basic sweeper keeps it, once checked
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        results = self.launcher.launch(checked.launch, initial_job_idx=0)
        for result in results:
            _ = result.return_value  # raises a run's exception, as Hydra's basic sweeper does
        if isinstance(self.task_function, TakesPlans):  # how each run ended, wherever the launcher ran it
            self.task_function.take_outcomes(results)
        return [results]
