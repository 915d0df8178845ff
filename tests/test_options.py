"""Every option of every group composes and builds into its component (one declaration each)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from fsdp_exp import config, options
from fsdp_exp.commands.experiment import CONF_DIR, compose_config
from fsdp_exp.driver.plan import prepare

OPTIONS = sorted((group.name, option.stem) for group in __import__("pathlib").Path(CONF_DIR).iterdir()
                 if group.is_dir() for option in group.glob("*.yaml"))
NEEDS = {("model", "custom"): ["model._target_=torch.nn.Linear"], ("data", "custom"): ["data._target_=x.y"],
         ("loss", "custom"): ["loss._target_=x.y"]}


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_builds_into_its_component(group: str, option: str) -> None:
    cfg = compose_config([f"{group}={option}", *NEEDS.get((group, option), [])])
    built = getattr(config.build(cfg), group)
    schemas = options.SCHEMAS.get(group)
    if schemas and option != "custom":  # a typed group: the option is one of its schemas
        assert type(built) in schemas.values(), type(built)
        assert OmegaConf.get_type(cfg[group]) is type(built)


def test_every_schema_is_some_options_schema() -> None:
    used = {(g, type(getattr(config.build(compose_config([f"{g}={o}", *NEEDS.get((g, o), [])])), g)))
            for g, o in OPTIONS}
    for group, schemas in options.SCHEMAS.items():
        for schema in schemas.values():
            assert (group, schema) in used, f"{group}: {schema.__name__} is no option's schema"


def test_the_defaults_of_a_dataclass_are_the_options_defaults() -> None:
    """dcp_async is dcp plus mode: async, with every other value the dataclass's own."""
    from fsdp_exp.checkpoint import DCPCheckpoint

    built = config.build(compose_config(["checkpoint=dcp_async"])).checkpoint
    assert built == DCPCheckpoint(mode="async")


def test_the_default_experiment_plans_on_this_machine() -> None:
    plan = prepare(compose_config([]), 0)
    assert plan.nproc == 2 and plan.exp.device == "cpu"
