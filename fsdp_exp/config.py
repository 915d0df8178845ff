"""Typed schemas for every config group, and the value checks Hydra cannot express.

Each YAML option in conf/<group>/ extends one schema here (``/schema/<group>/<name>``),
so OmegaConf refuses unknown keys and wrong types while composing. `check` then refuses
values that are well-typed but impossible, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class WandbMode(Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


# ---- model ---------------------------------------------------------------------------
@dataclass
class ModelSchema:
    _target_: str = MISSING
    blocks: list[str] = field(default_factory=list)  # class names, each instance one FSDP unit
    num_classes: int = MISSING


@dataclass
class VitSchema(ModelSchema):
    image_size: int = MISSING
    patch_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    hidden_dim: int = MISSING
    mlp_dim: int = MISSING


@dataclass
class CnnSchema(ModelSchema):
    dropout1: float = MISSING
    dropout2: float = MISSING


# ---- data ----------------------------------------------------------------------------
@dataclass
class DataSchema:
    _target_: str = MISSING
    num_workers: int = MISSING


@dataclass
class SyntheticSchema(DataSchema):
    num_samples: int = MISSING
    image_size: int = MISSING
    num_classes: int = MISSING
    noise: float = MISSING
    seed: int = MISSING


@dataclass
class TorchvisionSchema(DataSchema):
    name: str = MISSING
    root: str = MISSING
    download: bool = MISSING


# ---- sharding, precision, checkpoint, launcher, task -----------------------------------
@dataclass
class FullyShardSchema:
    _target_: str = MISSING
    reshard_after_forward: bool = MISSING


@dataclass
class NoShardingSchema:
    _target_: str = MISSING


@dataclass
class PrecisionSchema:
    _target_: str = MISSING
    param_dtype: DType = MISSING
    reduce_dtype: DType = MISSING
    output_dtype: DType = MISSING


@dataclass
class CheckpointSchema:
    _target_: str = MISSING
    export_full: bool = MISSING


@dataclass
class LauncherSchema:
    _target_: str = MISSING
    nproc_per_node: Any = MISSING  # "auto" or an int >= 1


@dataclass
class TaskSchema:
    _target_: str = MISSING


# ---- top level -------------------------------------------------------------------------
@dataclass
class TrainSchema:
    steps: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    log_every: int = MISSING


@dataclass
class MetricsSchema:
    warmup_steps: int = MISSING


@dataclass
class WandbSchema:
    mode: WandbMode = MISSING
    project: str = MISSING
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class ExperimentSchema:
    model: ModelSchema = MISSING
    data: DataSchema = MISSING
    sharding: Any = MISSING
    precision: PrecisionSchema = MISSING
    checkpoint: CheckpointSchema = MISSING
    launcher: LauncherSchema = MISSING
    task: TaskSchema = MISSING
    seed: int = MISSING
    offload: bool = MISSING
    device: Device = MISSING
    train: TrainSchema = MISSING
    optimizer: Any = MISSING
    metrics: MetricsSchema = MISSING
    wandb: WandbSchema = MISSING


def register() -> None:
    """Put the schemas in Hydra's ConfigStore, under schema/<group>/<name>."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=ExperimentSchema)
    for group, name, node in [
        ("model", "vit", VitSchema),
        ("model", "cnn", CnnSchema),
        ("data", "synthetic", SyntheticSchema),
        ("data", "torchvision", TorchvisionSchema),
        ("sharding", "fully_shard", FullyShardSchema),
        ("sharding", "none", NoShardingSchema),
        ("precision", "precision", PrecisionSchema),
        ("checkpoint", "checkpoint", CheckpointSchema),
        ("launcher", "local", LauncherSchema),
        ("task", "task", TaskSchema),
    ]:
        cs.store(group=f"schema/{group}", name=name, node=node)


# ---- value checks ------------------------------------------------------------------------
class ConfigError(Exception):
    """A bad value a user can set: one line naming the key and what is allowed."""


def _at_least(cfg: DictConfig, key: str, low: int) -> None:
    value = _get(cfg, key)
    if value < low:
        raise ConfigError(f"{key}={value}: must be at least {low}")


def _get(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _refuse_unknown_keys(node: DictConfig, path: str = "") -> None:
    """Schemas refuse new keys, except those added with `+key=`: refuse those too."""
    schema = OmegaConf.get_type(node)
    if is_dataclass(schema):
        allowed = {f.name for f in fields(schema)}
        for key in node.keys():
            if key not in allowed and not (path == "" and key == "hydra"):
                where = path or "the top level"
                raise ConfigError(
                    f"{path + '.' if path else ''}{key}: unknown key; {where} has: "
                    + ", ".join(sorted(k for k in allowed if not k.startswith("_")))
                )
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and key != "hydra":
            _refuse_unknown_keys(child, f"{path}.{key}" if path else str(key))


def check(cfg: DictConfig, gpu_count: int) -> None:
    """Refuse values that type-check but cannot run. `gpu_count`: GPUs on this machine."""
    _refuse_unknown_keys(cfg)
    for key in ("train.steps", "train.batch_size", "train.log_every", "data.num_samples"):
        if key != "data.num_samples" or "num_samples" in cfg.data:
            _at_least(cfg, key, 1)
    _at_least(cfg, "metrics.warmup_steps", 0)
    _at_least(cfg, "data.num_workers", 0)
    if cfg.train.lr <= 0:
        raise ConfigError(f"train.lr={cfg.train.lr}: must be greater than 0")

    device = cfg.device.value if isinstance(cfg.device, Enum) else str(cfg.device)
    if device == "cuda" and gpu_count == 0:
        raise ConfigError("device=cuda: this machine has no GPU; use device=auto or device=cpu")
    on_gpu = device == "cuda" or (device == "auto" and gpu_count > 0)

    nproc = cfg.launcher.nproc_per_node
    if nproc != "auto" and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise ConfigError(f"launcher.nproc_per_node={nproc}: must be auto or an integer >= 1")
    if on_gpu and isinstance(nproc, int) and nproc > gpu_count:
        raise ConfigError(
            f"launcher.nproc_per_node={nproc}: only {gpu_count} GPU(s) here, one rank per GPU"
        )

    unsharded = cfg.sharding._target_.endswith(".NoSharding")
    if unsharded and cfg.offload:
        raise ConfigError(
            "offload=true: needs a sharded model (sharding=full or grad_op), not sharding=none"
        )
    if unsharded and isinstance(nproc, int) and nproc > 1:
        raise ConfigError(
            f"launcher.nproc_per_node={nproc}: sharding=none trains one unsharded replica; "
            "use 1 (or auto)"
        )
