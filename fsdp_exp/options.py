"""Every option of every config group, registered in Hydra's ConfigStore as the schema its
YAML file extends: conf/<group>/<option>.yaml names `schema_<name>` in its defaults.

This module sits above the rest: it imports every option (the launchers, the tasks), and
nothing but the command line imports it.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra_plugins.fsdp_exp_sweeper.fsdp_exp_sweeper import CheckingSweeper

from fsdp_exp.checkpoint import DCPCheckpoint, NoCheckpoint
from fsdp_exp.config import Experiment
from fsdp_exp.data.images import SyntheticImages, TorchvisionImages
from fsdp_exp.data.padded import PaddedTokens
from fsdp_exp.data.token_file import TokenFile
from fsdp_exp.data.tokens import SyntheticTokens, TextBytes
from fsdp_exp.launcher.local import LocalLauncher
from fsdp_exp.launcher.ray import RayLauncher
from fsdp_exp.launcher.slurm import SlurmLauncher
from fsdp_exp.launcher.torchrun import TorchrunLauncher
from fsdp_exp.loss import CrossEntropy, CustomLoss, MeanSquaredError, ModelLoss
from fsdp_exp.metrics.wandb_sink import WandbSettings
from fsdp_exp.precision import Precision
from fsdp_exp.profile import MemoryProfile, NoProfile
from fsdp_exp.sharding import DDP, FullyShard, HybridShard, NoSharding
from fsdp_exp.tasks.estimate import Estimate
from fsdp_exp.tasks.eval import Eval
from fsdp_exp.tasks.export import Export
from fsdp_exp.tasks.max_batch.task import MaxBatch
from fsdp_exp.tasks.train import Train
from fsdp_exp.tasks.tune.task import Tune

# Each group's options, by schema name: conf/<group>/<option>.yaml extends one of these.
SCHEMAS: dict[str, dict[str, type]] = {
    "data": {"synthetic": SyntheticImages, "torchvision": TorchvisionImages,
             "synthetic_tokens": SyntheticTokens, "text": TextBytes, "token_file": TokenFile,
             "padded_tokens": PaddedTokens},
    "sharding": {"fully_shard": FullyShard, "hybrid": HybridShard, "ddp": DDP, "none": NoSharding},
    "precision": {"precision": Precision},
    "loss": {"cross_entropy": CrossEntropy, "mse": MeanSquaredError, "model": ModelLoss, "custom": CustomLoss},
    "checkpoint": {"none": NoCheckpoint, "dcp": DCPCheckpoint},
    "launcher": {"local": LocalLauncher, "torchrun": TorchrunLauncher, "slurm": SlurmLauncher,
                 "ray": RayLauncher},
    "task": {"train": Train, "max_batch": MaxBatch, "eval": Eval, "export": Export, "estimate": Estimate,
             "tune": Tune},
    "profile": {"none": NoProfile, "memory": MemoryProfile},
    "wandb": {"wandb": WandbSettings},
}


def register() -> None:
    """Put the schemas in Hydra's ConfigStore: `schema` (the top level) and
    `<group>/schema_<name>` for each option to extend; and fsdp_exp's sweeper in Hydra's
    plugins. Hydra finds plugins by walking the hydra_plugins folders, which an editable
    install (pip install -e) hides behind an import hook; registered by name, the sweeper
    is found however fsdp_exp was installed."""
    Plugins.instance().register(CheckingSweeper)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Experiment)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=group, name=f"schema_{name}", node=node)
