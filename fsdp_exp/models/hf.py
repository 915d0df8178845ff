"""model=hf: a causal language model from Hugging Face transformers, trained like `gpt`.

The model comes from a config given inline (`model=hf`: `model.config`, with its
`model_type`) or from `model.path`, a local directory holding config.json (`model=hf_dir`;
or a hub name, where the network allows); `model.pretrained=true` also loads the weights
from there. Weights are float32: the precision group decides what the ranks compute in.

transformers is an optional extra (`pip install -e .[hf]`), imported only when a model
is checked or built.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from fsdp_exp.errors import ConfigError, one_line

# What from_pretrained finds in a directory of weights (one file, or an index of shards).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def missing_extra() -> ConfigError:
    return ConfigError("model=hf: needs transformers, which is not installed; "
                       "install the extra: pip install -e .[hf]")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise missing_extra() from None
    return transformers


class CausalLM(nn.Module):
    """A transformers causal LM whose forward takes token ids [batch, seq] and returns
    the logits [batch, seq, vocab] (loss=cross_entropy); or, as transformers' own are
    called, `input_ids`, `attention_mask` and `labels` from a dict batch (data=padded_tokens),
    or a pair's `targets`, and returns the model's output with its loss (loss=model, the
    default of model=hf and hf_dir).

    Its state-dict keys are the transformers model's own with `hf.` in front, in every
    form (plain, sharded, DCP, exported): `transformers_state_dict` removes it.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> Any:
        """The logits; or, given `labels` (a dict batch's, in line with input_ids: the
        model shifts them, and skips -100) or `targets` (an (input, target) pair's, already
        the next token at each position), the model's output with its `loss` (loss=model).
        For `targets` the loss is the cross-entropy the model computes after its shift."""
        output = self.hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        if targets is not None:
            output["loss"] = F.cross_entropy(output.logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        return output.logits if labels is None and targets is None else output

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    @property
    def max_seq_len(self) -> int | None:
        """The longest sequence its position embeddings cover (the model contract's
        optional `max_seq_len`); None when the config names no limit."""
        config = self.hf.config
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return limit if isinstance(limit, int) else None

    def to_empty(self, *, device: Any, recurse: bool = True) -> CausalLM:
        """Storage for a model built on the meta device. Buffers the model computed when
        it was built (the rotary tables) keep their values: they are not in the state
        dict, so nothing would fill them later."""
        computed = {name: b for name, b in self.named_buffers() if b.device.type != "meta"}
        super().to_empty(device=device, recurse=recurse)
        with torch.no_grad():
            for name, buffer in self.named_buffers():
                if name in computed:
                    buffer.copy_(computed[name])
        return self


def transformers_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An exported or plain `CausalLM` state dict under the transformers model's own
    keys, for `load_state_dict` on it or `save_pretrained(..., state_dict=...)`."""
    return {key.removeprefix("hf."): value for key, value in state.items()}


def build_hf(config: Mapping[str, Any] | None = None, path: str | None = None, pretrained: bool = False,
             attn_implementation: str | None = None) -> CausalLM:
    """The model of `config` (inline, with `model_type`) or of `path` (a directory
    holding config.json, or a hub name) with `config`'s keys set over its config.json;
    with `pretrained`, also `path`'s weights.

    Under `torch.device("meta")` the parameters are made without memory, but buffers
    are computed for real (`CausalLM.to_empty` keeps them), and pretrained weights are
    not read: the caller fills the parameters from elsewhere.
    """
    transformers = _transformers()
    hf_config = load_config(config, path, pretrained)
    options: dict[str, Any] = {_dtype_argument(transformers.__version__): torch.float32}
    on_meta = torch.get_default_device().type == "meta"
    if attn_implementation and not (on_meta and needs_gpu(attn_implementation) and not torch.cuda.is_available()):
        # (transformers refuses flash-attn where no GPU is: a driver on a login node
        # checks the model's shapes on the meta device, which any attention gives)
        options["attn_implementation"] = attn_implementation
    auto = transformers.AutoModelForCausalLM
    if on_meta:
        with _parameters_on_meta():
            return CausalLM(auto.from_config(hf_config, **options))
    if pretrained:
        return CausalLM(auto.from_pretrained(_source(path), config=hf_config, **options))
    return CausalLM(auto.from_config(hf_config, **options))


def needs_gpu(attn_implementation: str | None) -> bool:
    """flash-attn's kernels (flash_attention_2, _3) run on CUDA only, in fp16 or bf16."""
    return str(attn_implementation or "").startswith("flash_attention")


def load_config(config: Mapping[str, Any] | None, path: str | None, pretrained: bool = False) -> Any:
    """The transformers config, or a ConfigError naming the key that is wrong: `config`
    alone (with its `model_type`), or `path`'s config.json with `config`'s keys set over it."""
    transformers = _transformers()
    settings = dict(_plain(config) or {})
    if path is None:
        if pretrained:
            raise ConfigError("model.pretrained=true: needs model.path, a directory holding the weights "
                              "(or a hub name)")
        if not settings:
            raise ConfigError("model.path: missing; set it to a directory holding config.json "
                              "(or give model.config, with its model_type)")
        model_type = settings.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.config.model_type: missing; name the architecture, for example llama or gpt2")
        if model_type not in transformers.CONFIG_MAPPING:
            raise ConfigError(f"model.config.model_type={model_type}: not a model type of transformers "
                              f"{transformers.__version__} (for example llama, gpt2, qwen2, mistral)")
        try:
            return transformers.AutoConfig.for_model(model_type, **settings)
        except Exception as err:  # noqa: BLE001 - the config class's own checks
            raise ConfigError(f"model.config: {one_line(err, last=True, limit=300)}") from None
    if "model_type" in settings:
        raise ConfigError(f"model.config.model_type={settings['model_type']}: model.path={path} gives the config "
                          "(its config.json); use model=hf_dir, whose model.config holds only changes to it")
    source = _source(path)
    if Path(source).is_dir():
        if not (Path(source) / "config.json").is_file():
            raise ConfigError(f"model.path={path}: no config.json in that directory")
        if pretrained and not any((Path(source) / name).is_file() for name in WEIGHT_FILES):
            raise ConfigError(f"model.pretrained=true: no weights in model.path={path} "
                              f"(looked for {', '.join(WEIGHT_FILES)})")
    elif path.startswith(("/", ".", "~")):
        raise ConfigError(f"model.path={path}: no such directory")
    try:
        hf_config, unused = transformers.AutoConfig.from_pretrained(source, return_unused_kwargs=True, **settings)
    except Exception as err:  # noqa: BLE001 - not found, offline, not a config
        raise ConfigError(f"model.path={path}: could not read a config there: {one_line(err, last=True, limit=300)}") from None
    if unused:
        name = min(unused)
        raise ConfigError(f"model.config.{name}: not a setting of {type(hf_config).__name__} "
                          f"(model.path={path})")
    return hf_config


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters go to the meta device as they are made; buffers stay real, on the CPU.

    What accelerate's `init_empty_weights(include_buffers=False)` does: a buffer such as
    a rotary table is computed in the module's constructor and is in no state dict, so
    it must be real from the start. A parameter takes real memory only until it is
    registered, one at a time.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            on_meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            # the attributes set on it (transformers' flags), not a tensor subclass's own
            # state: a fake tensor's (task=estimate) names its device, and copying it made the
            # meta parameter claim the CPU, so tying it (lm_head to the embedding) copied it apart
            for key, value in param.__dict__.items():
                on_meta.__dict__.setdefault(key, value)
            module._parameters[name] = on_meta

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _source(path: str | None) -> str:
    """A local directory as an absolute path; anything else as given (a hub name)."""
    assert path is not None
    local = Path(path).expanduser()
    return str(local.resolve()) if local.is_dir() else path


def _dtype_argument(version: str) -> str:
    """transformers 4.56 renamed `torch_dtype` to `dtype` (the old name warns)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _plain(config: Any) -> Any:
    """An OmegaConf node (as Hydra's instantiate passes it) as plain dicts and lists."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(config, (DictConfig, ListConfig)):
        return OmegaConf.to_container(config, resolve=True)
    return config
