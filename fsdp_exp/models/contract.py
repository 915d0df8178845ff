"""The model contract, checked before any rank starts (by the driver, in a fork of the rank
server when `python -m fsdp_exp` started one): the builder takes the option's keys and
builds, the option's blocks are in the model, and one forward on the meta device (no
memory) takes the data's inputs and returns what the run's loss reads for its targets
(`check_output` of the loss option, fsdp_exp.loss). The ranks check the output once more on
the first real batch.

A model may also state `max_seq_len` (the longest sequence it reads) and, where its
forward cannot run on the meta device, `vocab_size` (its logits per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from fsdp_exp.batch import describe as describe_batch, forward_keys, required_keys, stacked, to_device
from fsdp_exp.data import TrainData
from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.groups import LossOption
from fsdp_exp.loss import CrossEntropy
from fsdp_exp.models import ModelSpec
from fsdp_exp.torch_private import TorchDispatchMode


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
        reason = one_line(err, named=not isinstance(err, TypeError))
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


@dataclass(frozen=True)
class DataShare:
    """A run's batch against each process's share of the data: `batch_size` as typed
    (train.batch_size), `micro_batch` the samples each process reads at once, on
    `processes` processes."""

    batch_size: int
    micro_batch: int
    processes: int

    def check(self, data: TrainData) -> None:
        """Refuse a micro-batch larger than each process's share of the data, as the ranks
        would at their first batch."""
        share = data.share_per_rank(self.processes)
        if share is None or self.micro_batch <= share:
            return
        what = "larger" if self.micro_batch == self.batch_size else f"micro-batches of {self.micro_batch} are larger"
        more = "data.num_samples" if data.generated else "more data"
        raise ConfigError(f"train.batch_size={self.batch_size}: {what} than each rank's share of the data "
                          f"({share} samples on each of {self.processes} rank(s)); lower it or use {more}")


def check_model_and_data(spec: ModelSpec, data: TrainData | None, share: DataShare | None = None,
                         loss: LossOption | None = None, shards_params: bool = False) -> bool:
    """`check_model`, then, given the `data`, `check_model_reads_data` and the batch against
    each rank's `share` of it: whether the model has blocks to shard one by one.
    `shards_params`: the sharding option shards the parameters (fully_shard refuses a scalar)."""
    model = check_model(spec)
    if shards_params and model.module is not None:
        scalars = [name for name, p in model.module.named_parameters() if p.dim() == 0]
        if scalars:
            more = f" and {len(scalars) - 3} more" if len(scalars) > 3 else ""
            raise ConfigError(f"model: {spec.name} has scalar parameters ({', '.join(scalars[:3])}{more}); "
                              "sharding=full, grad_op and hybrid shard each parameter along its first dimension, "
                              "and fully_shard refuses a scalar: make each 1-D (nn.Parameter(torch.ones(1))), or "
                              "use sharding=ddp")
    if data is not None:
        try:
            check_model_reads_data(spec, model.module, data, loss)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - the data's or the model's own code: one line, not a traceback
            raise ConfigError(f"data: checking the model against the data's first item failed: "
                              f"{type(err).__name__}: {one_line(err)}") from None
        if share is not None:
            share.check(data)
    return bool(model.blocks)


def check_model_reads_data(spec: ModelSpec, model: nn.Module | None, data: TrainData,
                           loss: LossOption | None = None) -> None:
    """One forward on the meta device, with a batch shaped like the data's: the model must
    take the data's inputs and return what the `loss` (cross-entropy by default) reads for
    its targets. `model`: built on the meta device, or None for a builder that cannot (the
    data's files are checked all the same)."""
    loss = loss if loss is not None else CrossEntropy()
    item = data.first_item()
    if isinstance(item, dict):
        check_model_reads_dicts(spec, model, data, loss, item)
        return
    inputs, targets = item
    language = data.tokens_per_sample > 0
    key = f"data.seq_len={inputs.shape[-1]}" if language else "data"
    kind = data_kind(inputs, targets, language, loss, builtin=spec.target.startswith("fsdp_exp."))
    if model is None:
        return
    check_channels(spec, inputs, language)
    ids = inputs.unsqueeze(0).expand(2, *inputs.shape).to("meta")
    batch = data.batch_keys.read((ids, targets.expand(2, *targets.shape).to("meta")), forward_keys(model),
                                 loss.reads_targets)
    lookups = Lookups(ids)
    try:
        with torch.no_grad(), lookups:
            output = batch.forward(model)
    except Exception as err:  # noqa: BLE001 - the model's own error, shown in one line
        reason = one_line(err)
        if not cannot_run_on_meta(err):
            if language:
                lookups.check(spec, data, inputs, key)  # a table looked up past its end, before the error
            hint = "" if "longer than" in reason else f"; {kind}"
            raise ConfigError(f"{key}: model {spec.name} cannot read this data's inputs "
                              f"({describe(inputs)}): {reason}{hint}") from None
        output = None  # a forward that needs real values (Hugging Face's masks): the ranks check it
    if output is not None:
        loss.check_output(output, batch, spec.name, f"; {kind}")
    if isinstance(loss, CrossEntropy) and output is not None:
        classes = loss.classes(output)
    elif isinstance(loss, CrossEntropy) or language:  # the model's own word for them (model=hf's vocab_size)
        classes = getattr(model, "vocab_size", None)
    else:
        classes = None
    needed = data.num_classes
    if needed is not None and classes is not None and classes < needed:
        setting = setting_of(spec.kwargs, classes, ("vocab", "class"))
        raise ConfigError(f"{setting}: smaller than the data's {needed} {'tokens' if language else 'classes'} "
                          f"({spec.name} returns {classes} logits per {'token' if language else 'sample'})")
    # Classes both ways: logits past the data's classes are never a target, yet take their share
    # of the softmax. (A vocabulary may be larger than the tokens a data set uses: GPT-2's 50257.)
    if needed is not None and classes is not None and classes > needed and not language:
        setting = setting_of(spec.kwargs, classes, ("class", "label"))
        fix = f"set {setting.split('=')[0]}={needed}" if "=" in setting else f"make it return {needed}"
        raise ConfigError(f"{setting}: more than the data's {needed} classes ({spec.name} returns {classes} "
                          f"logits per sample); {fix}")
    longest = getattr(model, "max_seq_len", None)  # the contract's optional limit
    if language and longest is not None and inputs.shape[-1] > longest:
        setting = setting_of(spec.kwargs, longest, ("position", "block", "seq"))
        raise ConfigError(f"{key}: longer than the {longest} positions {spec.name} reads"
                          + (f" ({setting})" if setting != "model" else ""))
    if language:
        lookups.check(spec, data, inputs, key)


def check_model_reads_dicts(spec: ModelSpec, model: nn.Module | None, data: TrainData, loss: LossOption,
                            item: dict) -> None:
    """A data set of dicts: a batch of two like its first item, on the meta device, passed
    to the model as keyword arguments (fsdp_exp.batch); the model's output must suit the
    loss. Refused in one line naming the model, the batch's keys and the loss."""
    if loss.reads_targets and data.labels_in_line:
        raise ConfigError(f"loss={loss.name}: this data's {data.target_key} are in line with its input_ids, as "
                          "Hugging Face causal LMs take them (the model shifts them by one); use loss=model")
    if model is None:
        return
    raw = to_device(stacked(item, 2), "meta")
    takes = forward_keys(model)
    batch = data.batch_keys.read(raw, takes, loss.reads_targets)
    keys = ", ".join(raw)
    needed = required_keys(model)
    missing = [k for k in needed if k not in batch.kwargs]
    if missing:
        chosen = data.batch_keys.inputs
        key = "data" if chosen is None else f"data.input_keys=[{', '.join(chosen)}]"
        raise ConfigError(f"{key}: model {spec.name}'s forward needs {', '.join(missing)}, which the batch does not "
                          f"give it (the batch's keys: {keys}; loss={loss.name}); rename the data's keys, or "
                          "set data.input_keys")
    if not batch.kwargs:
        raise ConfigError(f"data: model {spec.name}'s forward takes none of the batch's keys ({keys}); it takes "
                          f"{', '.join(sorted(takes or ()))}: rename the data's keys, or set data.input_keys")
    try:
        with torch.no_grad():
            output = batch.forward(model)
    except Exception as err:  # noqa: BLE001 - the model's own error, shown in one line
        if cannot_run_on_meta(err):
            return  # a forward that needs real values: the ranks check it
        raise ConfigError(f"data: model {spec.name} cannot read this data's batches ({describe_batch(raw)}, "
                          f"loss={loss.name}): {one_line(err)}") from None
    loss.check_output(output, batch, spec.name, f"; the batch's keys: {keys}")


class Lookups(TorchDispatchMode):
    """The embedding tables a forward on the meta device looks up, and with what: the
    batch's token ids (a table of the vocabulary), or positions, one per token (a table of
    positions). On the meta device no index is checked; on a rank one past a table's end
    is an IndexError in every rank."""

    def __init__(self, batch: torch.Tensor) -> None:
        super().__init__()
        self.batch = batch
        self.vocabulary: int | None = None  # the first table looked up with the batch's ids
        self.positions: int | None = None  # the smallest table looked up with one index per position

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.embedding.default:
            weight, indices = args[0], args[1]
            seq = self.batch.shape[-1]
            if tuple(indices.shape) in (tuple(self.batch.shape), (self.batch.numel(),)):
                self.vocabulary = self.vocabulary or weight.shape[0]
            elif indices.numel() == seq and indices.shape[-1] == seq:
                self.positions = min(self.positions or weight.shape[0], weight.shape[0])
        return func(*args, **(kwargs or {}))

    def check(self, spec: ModelSpec, data: TrainData, inputs: torch.Tensor, key: str) -> None:
        """Refuse token ids past the vocabulary's table (the data's vocabulary when it says
        one, else the first item's largest id) and sequences past the positions' table."""
        if self.vocabulary is not None:
            largest = data.num_classes - 1 if data.num_classes else int(inputs.max())
            if largest >= self.vocabulary:
                source = f"its {data.num_classes} tokens" if data.num_classes else "its first item's largest"
                raise ConfigError(f"data: token ids up to {largest} ({source}), past the {self.vocabulary} rows "
                                  f"of model {spec.name}'s token embedding"
                                  + about(setting_of(spec.kwargs, self.vocabulary, ("vocab", "token"))))
        seq = inputs.shape[-1]
        if self.positions is not None and seq > self.positions:
            raise ConfigError(f"{key}: longer than the {self.positions} positions of model {spec.name}'s position "
                              "embedding" + about(setting_of(spec.kwargs, self.positions, ("position", "block", "seq"))))


def about(setting: str) -> str:
    return f" ({setting})" if setting != "model" else ""


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


CHANNEL_KEYS = ("channels", "in_channels", "num_channels", "in_chans")


def check_channels(spec: ModelSpec, inputs: torch.Tensor, language: bool) -> None:
    """A model option that states its input channels (model=resnet's `channels`) against the
    data's images, (channels, height, width): the key to set, not the stem's own error."""
    if language or inputs.dim() != 3:
        return
    for key in CHANNEL_KEYS:
        stated = spec.kwargs.get(key)
        if isinstance(stated, int) and stated != inputs.shape[0]:
            raise ConfigError(f"model.{key}={stated}: the data's images have {inputs.shape[0]} channels "
                              f"({describe(inputs)}); set model.{key}={inputs.shape[0]}")


def data_kind(inputs: torch.Tensor, targets: torch.Tensor, language: bool, loss: LossOption,
              builtin: bool = True) -> str:
    """What the data gives, and which models read it with the run's loss: cross-entropy
    trains classifiers (of images or other samples) and next-token language models. The
    built-in models are named only to a run of one (`builtin`): a user's own model is theirs
    to fit to the data."""
    if not isinstance(loss, CrossEntropy):
        return f"this data's targets are of shape {list(targets.shape)}"
    if language:
        return ("this data gives token sequences: use a language model (model=gpt or model=hf)" if builtin
                else "this data gives token sequences: a language model returns logits of shape [batch, tokens, vocab]")
    if targets.is_floating_point():
        return (f"this data's targets are {str(targets.dtype).removeprefix('torch.')} values of shape "
                f"{list(targets.shape)}: loss=cross_entropy reads class logits (classifiers and next-token "
                "language models); for a regression use loss=mse")
    if inputs.dim() == 3 and builtin:
        return ("this data gives images (model=vit, cnn or resnet reads them); a language model reads "
                "data=synthetic_tokens, text, token_file or padded_tokens")
    return (f"this data gives samples of shape {list(inputs.shape)} and class targets: a classifier of them returns "
            "logits of shape [batch, classes]")


def describe(tensor: torch.Tensor) -> str:
    what = "token ids" if not tensor.is_floating_point() else "samples"
    return f"{what} of shape {list(tensor.shape)}, {str(tensor.dtype).removeprefix('torch.')}"


