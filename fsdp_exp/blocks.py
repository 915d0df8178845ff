"""Per-block transforms applied before sharding: activation checkpointing and compile."""

from __future__ import annotations

import shutil

from torch import nn
from fsdp_exp.errors import ConfigError
from fsdp_exp.torch_private import CheckpointImpl, checkpoint_wrapper, is_dynamo_supported


def block_names(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[str]:
    return [name for name, m in model.named_modules() if name and blocks and isinstance(m, blocks)]


def checkpoint_blocks(model: nn.Module, names: list[str]) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    The wrapper takes the block's place, so sharding it shards the block; its state-dict
    keys are those of the plain model.
    """
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.register_module(child, checkpoint_wrapper(parent.get_submodule(child),
                                                         checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def compile_blocks(model: nn.Module, names: list[str]) -> None:
    """torch.compile each block (the whole model when it names no blocks)."""
    for name in names or [""]:
        model.get_submodule(name).compile()


def warmup_steps_to_skip(compile: bool) -> int:
    """The fewest warm-up steps that keep one-time costs out of the measured steps: the
    first step, whose first micro-batch is counted (FlopCounterMode: fsdp_exp.rank.build.
    CountedFirstMicroBatch), and with train.compile also the second, which compiles: Dynamo
    skips frames while a dispatch mode is active, so the counted step runs eagerly."""
    return 2 if compile else 1


def check_compile(device_type: str) -> None:
    """Refuse train.compile=true where torch.compile cannot run."""
    problem = None
    if not is_dynamo_supported():
        problem = "torch.compile does not support this Python or platform"
    elif device_type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        problem = "torch.compile on CPU needs a C++ compiler (g++ or clang++) on PATH"
    if problem:
        raise ConfigError(f"train.compile=true: {problem}; set train.compile=false")
