"""The config of one command line, composed with Hydra's compose API: in a test, a notebook
or an external torchrun's rank, and inside a running command for the runs a task makes of
its own (task=tune's setups), with the same search path.

conf/ is inside an installed package (setup.py ships it as fsdp_exp/conf), or at the top of
the checkout (a source tree, or an editable install).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from fsdp_exp.driver.check import composed
from fsdp_exp.errors import ConfigError


def find_conf_dir() -> str:
    """conf/: inside an installed package (setup.py ships it as fsdp_exp/conf), or at the
    top of the checkout (a source tree, or an editable install)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"fsdp_exp's conf/ is in neither {package} nor {package.parent}; reinstall fsdp_exp")


CONF_DIR = find_conf_dir()


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The config for these overrides, with the hydra node, composed with Hydra's compose
    API; its errors as one-line ConfigErrors (an external torchrun's ranks and the tests)."""
    check_search_path(overrides)

    def compose_it() -> DictConfig:
        if GlobalHydra.instance().is_initialized():  # inside a command: its config folder and search path
            return compose(config_name, overrides=overrides, return_hydra_config=True)
        with initialize_config_dir(CONF_DIR, version_base="1.3", job_name="fsdp_exp"):
            return compose(config_name, overrides=overrides, return_hydra_config=True)

    return composed(compose_it)


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
