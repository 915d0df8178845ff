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

from fsdp_exp.driver.check import composed, refuse_a_sweep
from fsdp_exp.driver.conf_dir import CONF_DIR
from fsdp_exp.errors import ConfigError


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The config for these overrides, with the hydra node, composed with Hydra's compose
    API; its errors as one-line ConfigErrors (an external torchrun's ranks and the tests)."""
    check_search_path(overrides)
    refuse_a_sweep(overrides)

    def compose_it() -> DictConfig:
        if GlobalHydra.instance().is_initialized():  # inside a command: its config folder and search path
            return compose(config_name, overrides=overrides, return_hydra_config=True)
        with initialize_config_dir(CONF_DIR, version_base="1.3", job_name="fsdp_exp"):
            return compose(config_name, overrides=overrides, return_hydra_config=True)

    return composed(compose_it, overrides)


def check_search_path(overrides: list[str]) -> None:
    """Each folder or package of `hydra.searchpath=[...]` is there: Hydra only warns of one
    that is not, and then reports the options it holds as missing. And none of the options
    the run picks is one of the user's named like one of fsdp_exp's (`clashing_option`)."""
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
            folder = Path(where).expanduser() if scheme == "file" else _folder_of(where) if scheme == "pkg" else None
            if folder is not None:
                clashing_option(folder, overrides)


def clashing_option(folder: Path, overrides: list[str]) -> None:
    """Hydra finds fsdp_exp's own options before those of the search path, so a user's
    `conf/model/resnet.yaml` would silently lose to fsdp_exp's `model=resnet`: refused, naming
    both files, for each option the run picks (on the command line, or by default)."""
    picked = dict(_defaults())
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if "." not in key and "/" not in key and key != "hydra" and value and "," not in value:
            picked[key] = value
    for group, name in picked.items():
        theirs, ours = folder / group / f"{name}.yaml", Path(CONF_DIR) / group / f"{name}.yaml"
        if theirs.is_file() and ours.is_file() and theirs.resolve() != ours.resolve():
            raise ConfigError(f"{group}={name}: fsdp_exp has an option of that name ({ours}), which Hydra finds before "
                              f"yours ({theirs}); rename yours, for example to {group}/my_{name}.yaml, and pick "
                              f"{group}=my_{name}")


def _defaults() -> list[tuple[str, str]]:
    """The groups' default options in fsdp_exp's conf/config.yaml."""
    import yaml

    listed = yaml.safe_load((Path(CONF_DIR) / "config.yaml").read_text()).get("defaults", [])
    return [next(iter(d.items())) for d in listed if isinstance(d, dict) and len(d) == 1
            and not next(iter(d)).startswith("override ")]


def _folder_of(dotted: str) -> Path | None:
    """The folder of a package named in a pkg:// search path entry."""
    spec = importlib.util.find_spec(dotted)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _package_folder(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False
