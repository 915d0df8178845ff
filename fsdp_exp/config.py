"""Typed schemas for every config group, and the value checks Hydra cannot express.

Each YAML option in conf/<group>/ extends one schema here (``/schema/<group>/<name>``),
so OmegaConf refuses unknown keys and wrong types while composing. `check` then refuses
values that are well-typed but impossible, before any process starts.
"""

from __future__ import annotations

import re
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


class InitDevice(Enum):
    cpu = "cpu"
    meta = "meta"


class GptSize(Enum):
    tiny = "tiny"
    small = "small"
    medium = "medium"
    large = "large"
    xl = "xl"


class LrSchedule(Enum):
    constant = "constant"
    cosine = "cosine"


class WandbMode(Enum):
    auto = "auto"
    online = "online"
    offline = "offline"
    disabled = "disabled"


# ---- model ---------------------------------------------------------------------------
@dataclass
class ModelSchema:
    _target_: str = MISSING
    blocks: list[str] = field(default_factory=list)  # class names, each instance one FSDP unit
    init_device: InitDevice = InitDevice.cpu


@dataclass
class VitSchema(ModelSchema):
    num_classes: int = MISSING
    image_size: int = MISSING
    patch_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    hidden_dim: int = MISSING
    mlp_dim: int = MISSING


@dataclass
class CnnSchema(ModelSchema):
    num_classes: int = MISSING
    dropout1: float = MISSING
    dropout2: float = MISSING


@dataclass
class GptSchema(ModelSchema):
    size: GptSize = MISSING
    vocab_size: int = MISSING
    block_size: int = MISSING
    dropout: float = MISSING


@dataclass
class HfSchema(ModelSchema):  # model=hf: a transformers causal LM (fsdp_exp.models.hf)
    config: dict[str, Any] = field(default_factory=dict)  # the transformers config, with model_type
    path: str | None = None  # or: a directory holding config.json (or a hub name)
    pretrained: bool = False  # also load path's weights
    attn_implementation: str | None = None  # null: transformers' default (sdpa)


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
class SyntheticTokensSchema(DataSchema):
    num_samples: int = MISSING
    seq_len: int = MISSING
    vocab_size: int = MISSING
    seed: int = MISSING


@dataclass
class TextSchema(DataSchema):
    path: str | None = None
    eval_path: str | None = None
    seq_len: int = MISSING


@dataclass
class TorchvisionSchema(DataSchema):
    name: str = MISSING
    root: str = MISSING
    download: bool = MISSING


# ---- sharding, precision, checkpoint, launcher, task -----------------------------------
@dataclass
class FullyShardSchema:
    _target_: str = MISSING
    reshard_after_forward: Any = MISSING  # true, false, or a group size
    wrap: str = MISSING  # blocks | size | blocks+size | root
    min_params: int = MISSING


@dataclass
class HybridShardSchema(FullyShardSchema):
    replicate: int = MISSING


@dataclass
class ReplicateSchema:  # ddp and none
    _target_: str = MISSING


@dataclass
class PrecisionSchema:
    _target_: str = MISSING
    param_dtype: DType = MISSING
    reduce_dtype: DType = MISSING
    output_dtype: DType = MISSING
    loss_scaling: bool = MISSING
    initial_scale: float = 2.0**16


@dataclass
class CheckpointSchema:
    _target_: str = MISSING
    export_full: bool = MISSING


@dataclass
class DCPCheckpointSchema(CheckpointSchema):
    mode: str = MISSING  # sync | async | async_pinned ("async" cannot be an Enum name)
    every: int = MISSING
    keep: int | None = None
    dir: str | None = None
    overwrite: bool = False


@dataclass
class LauncherSchema:
    _target_: str = MISSING
    nproc_per_node: Any = MISSING  # "auto" or an int >= 1
    max_restarts: int = 0


@dataclass
class TorchrunSchema(LauncherSchema):
    nnodes: Any = MISSING  # an int, or "min:max"
    rdzv_endpoint: str = MISSING
    rdzv_id: str = MISSING
    rdzv_timeout: int = MISSING


@dataclass
class SlurmSchema(LauncherSchema):
    cluster: str = MISSING  # slurm | local (submitit's local executor)
    partition: str | None = None
    nodes: int = MISSING
    gpus_per_node: int = MISSING
    cpus_per_task: int = MISSING
    mem_gb: float | None = None
    timeout_min: int = MISSING
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: list[str] = field(default_factory=list)
    folder: str | None = None


@dataclass
class RaySchema:
    _target_: str = MISSING
    num_workers: int = MISSING
    use_gpu: bool = MISSING
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    address: str | None = None
    storage_path: str | None = None
    max_failures: int = 0
    start_timeout: int = MISSING


@dataclass
class TaskSchema:
    _target_: str = MISSING


@dataclass
class ExportSchema(TaskSchema):
    checkpoint: str | None = None
    format: str = MISSING  # safetensors | pt


@dataclass
class EvalSchema(TaskSchema):
    weights: str | None = None
    batch_size: int = MISSING
    show: int = MISSING


# ---- top level -------------------------------------------------------------------------
@dataclass
class TrainSchema:
    steps: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    log_every: int = MISSING
    grad_accum: int = MISSING
    activation_checkpointing: bool = MISSING
    compile: bool = MISSING
    lr_schedule: LrSchedule = MISSING
    lr_warmup_steps: int = MISSING


@dataclass
class MetricsSchema:
    warmup_steps: int = MISSING
    peak_tflops: float | None = None


@dataclass
class ProfileSchema:
    _target_: str = MISSING


@dataclass
class MemoryProfileSchema(ProfileSchema):
    start_step: int = MISSING
    steps: int = MISSING


@dataclass
class MemorySchema:
    limit_gb: float | None = None


@dataclass
class MaxBatchSchema:
    steps_per_probe: int = MISSING
    probe_timeout: float = MISSING
    resolution: int = MISSING
    margin: float = MISSING
    search_up_to: int = MISSING


@dataclass
class WandbSchema:
    mode: WandbMode = MISSING
    project: str = MISSING
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    id: str | None = None


@dataclass
class ExperimentSchema:
    model: ModelSchema = MISSING
    data: DataSchema = MISSING
    sharding: Any = MISSING
    precision: PrecisionSchema = MISSING
    checkpoint: CheckpointSchema = MISSING
    launcher: Any = MISSING  # LauncherSchema or RaySchema
    task: TaskSchema = MISSING
    seed: int = MISSING
    offload: bool = MISSING
    device: Device = MISSING
    train: TrainSchema = MISSING
    optimizer: Any = MISSING
    metrics: MetricsSchema = MISSING
    memory: MemorySchema = MISSING
    max_batch: MaxBatchSchema = MISSING
    profile: ProfileSchema = MISSING
    wandb: WandbSchema = MISSING
    resume: str | None = None


def register() -> None:
    """Put the schemas in Hydra's ConfigStore, under schema/<group>/<name>."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=ExperimentSchema)
    for group, name, node in [
        ("model", "vit", VitSchema),
        ("model", "cnn", CnnSchema),
        ("model", "gpt", GptSchema),
        ("model", "hf", HfSchema),
        ("data", "synthetic", SyntheticSchema),
        ("data", "synthetic_tokens", SyntheticTokensSchema),
        ("data", "text", TextSchema),
        ("data", "torchvision", TorchvisionSchema),
        ("sharding", "fully_shard", FullyShardSchema),
        ("sharding", "hybrid", HybridShardSchema),
        ("sharding", "replicate", ReplicateSchema),
        ("precision", "precision", PrecisionSchema),
        ("checkpoint", "checkpoint", CheckpointSchema),
        ("checkpoint", "dcp", DCPCheckpointSchema),
        ("launcher", "local", LauncherSchema),
        ("launcher", "torchrun", TorchrunSchema),
        ("launcher", "slurm", SlurmSchema),
        ("launcher", "ray", RaySchema),
        ("task", "task", TaskSchema),
        ("task", "export", ExportSchema),
        ("task", "eval", EvalSchema),
        ("profile", "none", ProfileSchema),
        ("profile", "memory", MemoryProfileSchema),
        ("wandb", "wandb", WandbSchema),
    ]:
        cs.store(group=f"schema/{group}", name=name, node=node)


# ---- value checks ------------------------------------------------------------------------
class ConfigError(Exception):
    """A bad value a user can set: one line naming the key and what is allowed."""


def _at_least(cfg: DictConfig, key: str, low: int) -> None:
    value = OmegaConf.select(cfg, key)
    if value < low:
        raise ConfigError(f"{key}={value}: must be at least {low}")


def unknown_key(key: str, schema: Any) -> ConfigError:
    """The error for `key`, which the node's schema does not have: it lists the keys it does."""
    parent = key.rpartition(".")[0] or "the top level"
    if not is_dataclass(schema):  # a free-form node, such as optimizer
        return ConfigError(f"{key}: not in {parent}; add a new key with +{key}=...")
    allowed = sorted(f.name for f in fields(schema) if not f.name.startswith("_"))
    return ConfigError(f"{key}: unknown key; {parent} has: {', '.join(allowed)}")


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


def check(cfg: DictConfig, gpu_count: int) -> None:
    """Refuse values that type-check but cannot run. `gpu_count`: GPUs on this machine.

    Checks that need the world size or the sharding plan live in `fsdp_exp.run.prepare`.
    """
    _refuse_unknown_keys(cfg)
    for key in ("train.steps", "train.batch_size", "train.log_every", "train.grad_accum"):
        _at_least(cfg, key, 1)
    for key in ("data.num_samples", "data.seq_len", "model.block_size", "model.vocab_size"):
        if OmegaConf.select(cfg, key) is not None:
            _at_least(cfg, key, 1)
    _at_least(cfg, "metrics.warmup_steps", 0)
    _at_least(cfg, "train.lr_warmup_steps", 0)
    for key in ("launcher.max_restarts", "launcher.max_failures"):
        if OmegaConf.select(cfg, key) is not None:
            _at_least(cfg, key, 0)
    if "every" in cfg.checkpoint:
        modes = ("sync", "async", "async_pinned")
        if cfg.checkpoint.mode not in modes:
            raise ConfigError(f"checkpoint.mode={cfg.checkpoint.mode}: choose one of: {', '.join(modes)}")
        _at_least(cfg, "checkpoint.every", 1)
        if cfg.checkpoint.keep is not None:
            _at_least(cfg, "checkpoint.keep", 1)
    for key in ("task.batch_size", "task.show"):
        if OmegaConf.select(cfg, key) is not None:
            _at_least(cfg, key, 1 if key == "task.batch_size" else 0)
    if cfg.metrics.peak_tflops is not None and cfg.metrics.peak_tflops <= 0:
        raise ConfigError(f"metrics.peak_tflops={cfg.metrics.peak_tflops}: must be greater than 0")
    if "start_step" in cfg.profile:
        _at_least(cfg, "profile.start_step", 1)
        _at_least(cfg, "profile.steps", 1)
        if cfg.profile.start_step + cfg.profile.steps - 1 > cfg.train.steps:
            raise ConfigError(
                f"profile.start_step={cfg.profile.start_step}: the window of {cfg.profile.steps} "
                f"step(s) must end by train.steps={cfg.train.steps}"
            )
    _at_least(cfg, "data.num_workers", 0)
    if cfg.wandb.id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(cfg.wandb.id)):
        raise ConfigError(f"wandb.id={cfg.wandb.id}: at most 64 letters, digits, '-' or '_'")
    _check_max_batch(cfg.max_batch)
    if cfg.train.lr <= 0:
        raise ConfigError(f"train.lr={cfg.train.lr}: must be greater than 0")
    if cfg.train.batch_size % cfg.train.grad_accum:
        raise ConfigError(
            f"train.grad_accum={cfg.train.grad_accum}: must divide train.batch_size="
            f"{cfg.train.batch_size} (each step is grad_accum micro-batches of equal size)"
        )

    device = cfg.device.value if isinstance(cfg.device, Enum) else str(cfg.device)
    if device == "cuda" and gpu_count == 0:
        raise ConfigError("device=cuda: this machine has no GPU; use device=auto or device=cpu")
    on_gpu = device == "cuda" or (device == "auto" and gpu_count > 0)
    if "nproc_per_node" in cfg.launcher:
        nproc = cfg.launcher.nproc_per_node
        if nproc != "auto" and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
            raise ConfigError(f"launcher.nproc_per_node={nproc}: must be auto or an integer >= 1")
        if on_gpu and isinstance(nproc, int) and nproc > gpu_count:
            raise ConfigError(
                f"launcher.nproc_per_node={nproc}: only {gpu_count} GPU(s) here, one rank per GPU"
            )
    _check_model_fits_data(cfg)


def _check_max_batch(settings: DictConfig) -> None:
    if settings.steps_per_probe < 2:
        raise ConfigError(f"max_batch.steps_per_probe={settings.steps_per_probe}: must be at least 2 "
                          "(the second step holds the optimizer state the first one made)")
    if settings.probe_timeout <= 0:
        raise ConfigError(f"max_batch.probe_timeout={settings.probe_timeout}: must be greater than 0 (seconds)")
    if settings.resolution < 1:
        raise ConfigError(f"max_batch.resolution={settings.resolution}: must be at least 1")
    if not 0 <= settings.margin < 1:
        raise ConfigError(f"max_batch.margin={settings.margin}: must be at least 0 and below 1")
    if settings.search_up_to < settings.resolution:
        raise ConfigError(f"max_batch.search_up_to={settings.search_up_to}: must be at least "
                          f"max_batch.resolution={settings.resolution}")


def _check_model_fits_data(cfg: DictConfig) -> None:
    if OmegaConf.get_type(cfg.model) is HfSchema:  # its sizes are in a transformers config
        from fsdp_exp.models import hf

        hf.check(OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True),
                 OmegaConf.to_container(cfg.data, resolve=True))
        return
    language_model = "vocab_size" in cfg.model
    token_data = "seq_len" in cfg.data
    if language_model and not token_data:
        raise ConfigError("data: this model reads tokens; use data=synthetic_tokens or data=text")
    if token_data and not language_model:
        raise ConfigError("data: this model reads images; use data=synthetic, mnist or fashion_mnist")
    if language_model:
        if cfg.data.seq_len > cfg.model.block_size:
            raise ConfigError(
                f"data.seq_len={cfg.data.seq_len}: longer than model.block_size={cfg.model.block_size}"
            )
        data_vocab = cfg.data.get("vocab_size", 256)  # text: byte-level tokens
        if data_vocab > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size}: smaller than the data's {data_vocab} tokens"
            )
