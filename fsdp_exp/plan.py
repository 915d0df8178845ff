"""The driver's plan for one run: the experiment built from the composed config, and every
check that spans groups, made before any rank starts.

Each component checks its own values as it is built (`__post_init__`); what needs two
groups at once is here: the world size and the GPUs (launcher, device, sharding), the
model against its blocks and the data, offload and meta-device init against the
sharding, the memory limit against the machine, and what the task needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from fsdp_exp import config
from fsdp_exp.blocks import check_compile
from fsdp_exp.config import Device, Experiment
from fsdp_exp.errors import ConfigError
from fsdp_exp.memory import check_limit
from fsdp_exp.models import ModelSpec, check_logits


@dataclass
class RunPlan:
    """What the driver starts: the built experiment the ranks receive, and how many ranks."""

    exp: Experiment
    nproc: int

    @property
    def launcher(self) -> Any:
        return self.exp.launcher

    @property
    def task(self) -> Any:
        return self.exp.task


def prepare(cfg: DictConfig, local_gpus: int, overrides: list[str], group: str | None = None,
            world_size: int | None = None, job_type: str = "train") -> RunPlan:
    """Build the experiment and check everything that can be checked before a rank starts.

    `sharding=none` runs one process on the global batch of the ranks it stands in for,
    so its losses are the reference the sharded runs must match. `world_size`: given by
    an external torchrun; otherwise the launcher decides.
    """
    exp = config.build(cfg)
    gpus = exp.launcher.gpus(local_gpus)
    if exp.device == Device.cuda and gpus == 0:
        raise ConfigError("device=cuda: this machine has no GPU; use device=auto or device=cpu")
    on_gpu = exp.device == Device.cuda or (exp.device == Device.auto and gpus > 0)
    exp.device = Device.cuda if on_gpu else Device.cpu
    world = world_size or exp.launcher.world_size(gpus if on_gpu else 0)

    model = check_model(exp.model)
    exp.sharding.check(world, has_blocks=bool(model.blocks), offload=exp.offload)
    if exp.model.init_device == "meta" and not exp.sharding.shards_params:
        raise ConfigError("model.init_device=meta: needs sharding=full, grad_op or hybrid to shard the model")
    if exp.train.compile:
        check_compile(exp.device)
    if exp.launcher.runs_here:  # on a cluster, the data's files may be there only
        check_model_reads_data(exp, model.module)
    exp.profile.check(exp.train.steps)
    nproc = world if exp.sharding.distributed else 1
    if exp.launcher.runs_here:
        check_limit(exp.memory.limit_gb, exp.device, 1 if on_gpu else nproc)
    exp.checkpoint.check()
    exp.task.check(exp)
    if not exp.sharding.distributed:
        exp.train = replace(exp.train, batch_size=exp.train.batch_size * world)
    exp.wandb = exp.wandb.for_run(overrides, group, job_type)
    return RunPlan(exp, nproc)


@dataclass
class BuiltOnMeta:
    module: nn.Module | None  # None: the builder does not build on the meta device
    blocks: tuple[type[nn.Module], ...]


def check_model(spec: ModelSpec) -> BuiltOnMeta:
    """The builder takes the option's keys, builds (on the meta device, without memory),
    and holds the block classes the option names."""
    spec.check_arguments()
    try:
        with torch.device("meta"):
            model, blocks = spec.build()
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, AssertionError, ImportError) as err:  # the builder's own checks
        reason = first_line(err) if isinstance(err, TypeError) else f"{type(err).__name__}: {first_line(err)}"
        raise ConfigError(f"model: {spec.name}: {reason}") from None
    except Exception:  # noqa: BLE001 - builders that cannot build on the meta device: checked on the ranks
        return BuiltOnMeta(None, spec.block_classes())
    present = {type(m) for m in model.modules()}
    for cls in blocks:
        if not any(issubclass(t, cls) for t in present):
            found = sorted({t.__name__ for t in present})
            raise ConfigError(f"model.blocks: {cls.__module__}.{cls.__qualname__} is not in the model "
                              f"{spec.name} builds (its modules are: {', '.join(found)})")
    return BuiltOnMeta(model, blocks)


def check_model_reads_data(exp: Experiment, model: nn.Module | None) -> None:
    """One forward on the meta device, with a batch shaped like the data's: the model must
    take the data's inputs and return logits for its targets (see the README's contract)."""
    inputs, targets = exp.data.dataset()[0]
    language = exp.data.tokens_per_sample > 0
    key = f"data.seq_len={inputs.shape[-1]}" if language else "data"
    kind = ("this data gives token sequences: use a language model (model=gpt or model=hf)" if language
            else "this data gives images (model=vit or cnn reads them); a language model reads "
                 "data=synthetic_tokens, text or token_file")
    if model is None:
        return
    batch = inputs.unsqueeze(0).expand(2, *inputs.shape).to("meta")
    try:
        with torch.no_grad():
            logits = model(batch)
    except Exception as err:  # noqa: BLE001 - the model's own error, shown in one line
        reason = first_line(err)
        if not cannot_run_on_meta(err):
            hint = "" if "longer than" in reason else f"; {kind}"
            raise ConfigError(f"{key}: model {exp.model.name} cannot read this data's inputs "
                              f"({describe(inputs)}): {reason}{hint}") from None
        logits = None  # a forward that needs real values (Hugging Face's masks): the ranks check it
    if logits is not None:
        check_logits(logits, targets.expand(2, *targets.shape), exp.model.name, f"; {kind}")
    classes, needed = logits.shape[-1] if logits is not None else getattr(model, "vocab_size", None), exp.data.num_classes
    if needed is not None and classes is not None and classes < needed:
        what = "tokens" if language else "classes"
        raise ConfigError(f"{setting_of(exp.model.kwargs, classes, ('vocab', 'class'))}: smaller than the data's {needed} {what} "
                          f"({exp.model.name} returns {classes} logits per {'token' if language else 'sample'})")
    longest = getattr(model, "max_seq_len", None)  # the contract's optional limit
    if language and longest is not None and inputs.shape[-1] > longest:
        setting = setting_of(exp.model.kwargs, longest, ("position", "block", "seq"))
        raise ConfigError(f"{key}: longer than the {longest} positions {exp.model.name} reads"
                          + (f" ({setting})" if setting != "model" else ""))


def setting_of(kwargs: dict, value: int, words: tuple[str, ...]) -> str:
    """The builder's argument that sets `value` (vocab_size, num_classes, block_size, a
    transformers config's entry) as `model.<key>=<value>`: the one argument of that value,
    else the one whose name holds one of `words`; "model" when that is not one."""
    found = list(leaves(kwargs, value, "model"))
    if len(found) > 1:
        found = [f for f in found if any(w in f.split("=")[0].rsplit(".", 1)[-1] for w in words)]
    return found[0] if len(found) == 1 else "model"


def leaves(node: dict, value: int, prefix: str) -> Iterator[str]:
    for key, given in node.items():
        if isinstance(given, dict):
            yield from leaves(given, value, f"{prefix}.{key}")
        elif given == value and not isinstance(given, bool):
            yield f"{prefix}.{key}={given}"


def cannot_run_on_meta(err: Exception) -> bool:
    """An error of the meta device itself (data-dependent control flow, a value read
    from a tensor), not of the model's input."""
    return isinstance(err, NotImplementedError) or "meta" in str(err).lower()


def describe(tensor: torch.Tensor) -> str:
    what = "token ids" if not tensor.is_floating_point() else "samples"
    return f"{what} of shape {list(tensor.shape)}, {str(tensor.dtype).removeprefix('torch.')}"


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
