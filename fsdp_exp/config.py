"""conf/config.yaml as one typed object, `Experiment`.

Every option's schema is its component's own dataclass (`FullyShard`, `Precision`,
`DCPCheckpoint`, `SlurmLauncher`, ...), registered in Hydra's ConfigStore as
`<group>/schema_<name>` by `fsdp_exp.options`; a YAML option extends it with only what
differs from its defaults. OmegaConf refuses unknown keys and wrong types while composing, and
`OmegaConf.to_object` builds the dataclasses, whose `__post_init__` checks their own
values. Checks that span groups live in `fsdp_exp.driver.plan`.

Each closed group is typed by its base (fsdp_exp.groups): an option of the group must
extend one of its schemas. The model group is open: its own keys are typed by
`fsdp_exp.models.ModelSpec`, the rest go to the user's builder; so is the data group (a
user's own `_target_`, fsdp_exp.data.custom) and the optimizer (a `_target_`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from fsdp_exp.data.custom import CustomData
from fsdp_exp.errors import Choice, ConfigError, at_least
from fsdp_exp.groups import (
    CheckpointOption,
    LauncherOption,
    LossOption,
    ProfileOption,
    ShardingOption,
    TaskOption,
)
from fsdp_exp.memory import MemorySettings
from fsdp_exp.logger import SETTINGS as TRACKER_SETTINGS
from fsdp_exp.logger import Loggers
from fsdp_exp.metrics.wandb_sink import WandbMode, WandbSettings
from fsdp_exp.models import NO_BUILDER, ModelSpec
from fsdp_exp.precision import Precision
from fsdp_exp.schedule import LrSchedule

__all__ = ["ConfigError", "Experiment"]


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class TrainSettings:
    steps: int = 50
    batch_size: int = 32  # per rank
    lr: float = 1.0e-3
    log_every: int = 10
    grad_accum: int = 1  # micro-batches per optimizer step; must divide batch_size
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile each block
    lr_schedule: LrSchedule = LrSchedule.constant  # constant | cosine (decays to 0 at train.steps)
    lr_warmup_steps: int = 0  # linear warm-up from 0 over this many steps

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "log_every", "grad_accum"):
            at_least(f"train.{key}", getattr(self, key), 1)
        at_least("train.lr_warmup_steps", self.lr_warmup_steps, 0)
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr}: must be greater than 0")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.grad_accum={self.grad_accum}: must divide train.batch_size="
                f"{self.batch_size} (each step is grad_accum micro-batches of equal size)"
            )


@dataclass
class MetricsSettings:
    warmup_steps: int = 3  # left out of the steady-state averages in summary.json
    peak_tflops: float | None = None  # the device's peak for MFU; None: from the table of known GPUs
    phase_peaks: bool = True  # each phase's peak (peak_forward_gb, ...), read in the warm-up steps (at least two)

    def __post_init__(self) -> None:
        at_least("metrics.warmup_steps", self.warmup_steps, 0)
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"metrics.peak_tflops={self.peak_tflops}: must be greater than 0")


@dataclass
class Experiment:
    """One experiment: an option of every group, built, and the settings every run has."""

    model: Any = MISSING  # a ModelSpec once built: the group is open (see fsdp_exp.models)
    data: Any = MISSING  # open too: one of fsdp_exp.data's, or a user's own `_target_`
    sharding: ShardingOption = MISSING
    precision: Precision = MISSING
    loss: LossOption = MISSING
    checkpoint: CheckpointOption = MISSING
    launcher: LauncherOption = MISSING
    task: TaskOption = MISSING
    profile: ProfileOption = MISSING
    wandb: WandbSettings = MISSING
    seed: int = 0
    offload: bool = False  # CPU offload of sharded params, grads and optimizer state
    device: Device = Device.auto  # auto (cuda when there is a GPU, else cpu) | cpu | cuda
    resume: str | None = None  # None | auto (the latest in checkpoint.dir) | <path of a checkpoint>
    train: TrainSettings = field(default_factory=TrainSettings)
    optimizer: Any = MISSING  # open: a `_target_` with `_partial_: true`, given the parameters on each rank
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    logger: Any = field(default_factory=dict)  # the trackers, conf/logger (fsdp_exp.logger.Loggers once built)

    def __post_init__(self) -> None:
        # From the composed config, the model and the user's own data (`_target_`, fsdp_exp.data.custom)
        # are open nodes; an Experiment derived with `replace` keeps the objects it is given.
        if isinstance(self.model, Mapping):
            self.model = ModelSpec.from_config(self.model)
        if isinstance(self.data, Mapping):
            self.data = CustomData.from_config(self.data)
        if isinstance(self.logger, Mapping):
            self.logger = Loggers.from_config(self.logger)
            if not self.logger.wandb:  # wandb not among the trackers: no run, as wandb.mode=disabled
                self.wandb = replace(self.wandb, mode=WandbMode.disabled)


def build(cfg: DictConfig) -> Experiment:
    """The composed config as objects; each component checks its own values as it is built."""
    _refuse_unknown_keys(cfg)
    experiment = cfg.copy()
    with open_dict(experiment):
        experiment.pop("hydra", None)  # it only resolves inside Hydra's own runtime
    try:
        built = OmegaConf.to_object(experiment)
    except MissingMandatoryValue as err:
        if err.full_key == "model._target_":
            raise ConfigError(NO_BUILDER) from None
        raise ConfigError(f"{err.full_key}: must be set (it has no default); set {err.full_key}=...") from None
    assert isinstance(built, Experiment)
    for f in fields(built):
        option = getattr(built, f.name)
        if type(option) in GROUP_BASES:  # an option's file that extends no schema, and sets nothing
            raise extends_no_schema(f.name)
    return built


GROUP_BASES = (CheckpointOption, LauncherOption, LossOption, ProfileOption, ShardingOption, TaskOption)


def extends_no_schema(group: str, key: str | None = None) -> ConfigError:
    """An option of a closed group whose file does not extend one of the group's schemas."""
    schemas = sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)
                     if name.startswith("schema_"))
    names = ", ".join(name.removeprefix("schema_") for name in schemas)
    return ConfigError(f"{key or group}: the option extends none of the {group} group's schemas, which give an "
                       f"option its keys; begin its file with `defaults: [schema_<name>]`, <name> one of: {names}")


def as_dict(exp: Experiment) -> dict:
    """The experiment as plain JSON-ready values (wandb's config, fingerprints)."""
    values = asdict(exp)
    values["model"] = exp.model.as_dict()
    return json.loads(json.dumps(values, default=str))


def unknown_key(key: str, schema: Any, typed: str | None = None) -> ConfigError:
    """The error for `key`, which the node's schema does not have: it lists the keys it does.
    `typed`: the key as the command line gave it (`key` or a key below it)."""
    parent = key.rpartition(".")[0] or "the top level"
    typed = typed or key
    if typed.split(".")[0] == "max_batch":  # where task=max_batch's settings were before 0.1.0
        moved = typed.replace("max_batch", "task", 1)
        return ConfigError(f"{typed}: task=max_batch's settings are task.*: write task=max_batch {moved}=...")
    if isinstance(schema, type) and schema in GROUP_BASES:
        return extends_no_schema(schema.group, key)
    tracker = key.split(".")
    if len(tracker) == 3 and tracker[:2] == ["logger", "wandb"]:
        return ConfigError(f"{key}: wandb's settings are the wandb group's (wandb.mode, wandb.project, ...)")
    if len(tracker) == 3 and tracker[0] == "logger" and tracker[1] in TRACKER_SETTINGS:  # open nodes, typed when built
        allowed = [f.name for f in fields(TRACKER_SETTINGS[tracker[1]])]
        return ConfigError(f"{key}: not a setting of logger={tracker[1]}; it takes {', '.join(allowed) or 'none'}")
    if not is_dataclass(schema):  # a free-form node, such as optimizer
        return ConfigError(f"{key}: not in {parent}; add a new key with +{key}=...", key=key,
                           refusal=ConfigError.NEW_KEY)
    allowed = sorted(f.name for f in fields(schema) if not f.name.startswith("_"))
    return ConfigError(f"{key}: unknown key; {parent} has: {', '.join(allowed)}", key=key,
                       refusal=ConfigError.UNKNOWN_KEY)


def unknown_key_in_option(option: str, key: str, schema: Any) -> ConfigError:
    """A key that an option's file (`option`: sharding/mine) sets and its schema (the
    settings class OmegaConf refused it for) does not have."""
    if schema in GROUP_BASES:
        return extends_no_schema(option.partition("/")[0], f"{option}.yaml: {key}")
    refused = unknown_key(key, schema)
    return ConfigError(f"{option}.yaml: {refused}", key=refused.key, refusal=refused.refusal)


def _refuse_unknown_keys(node: DictConfig, path: str = "") -> None:
    """Schemas refuse new keys, except those added with `+key=`: refuse those too."""
    schema = OmegaConf.get_type(node)
    if is_dataclass(schema):
        allowed = {f.name for f in fields(schema)}
        for key in node.keys():
            if key not in allowed and not (path == "" and key == "hydra"):
                raise unknown_key(f"{path}.{key}" if path else str(key), schema)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and key != "hydra":
            _refuse_unknown_keys(child, f"{path}.{key}" if path else str(key))
