"""model=hf: Hugging Face transformers causal LMs, trained as fsdp_exp's own models are.

The distributed runs go through the real driver (`run_experiment`, as `python -m fsdp_exp`
calls it) on real gloo ranks, as tests/test_parity.py does: 2 sharded ranks against one
unsharded process on the same global batch, with SGD and momentum, so a mis-reduced
gradient shows at once. Every model here is tiny and built offline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_exp.checkpoint.export import load_weights
from fsdp_exp.commands.experiment import compose_checked, compose_config
from tests.conftest import names, precheck, read_json, read_jsonl, refused_here
from fsdp_exp.config import ConfigError
from fsdp_exp.data.tokens import SyntheticTokens
from fsdp_exp.driver.plan import prepare
from fsdp_exp.driver.run import run_experiment
from fsdp_exp.loss import ModelLoss
from fsdp_exp.metrics.flops import flops_per_token
from fsdp_exp.models import ModelSpec, build_model
from fsdp_exp.models.hf import build_hf, transformers_state_dict
from fsdp_exp.sharding.wrap import select_units
from fsdp_exp.tasks.export import plain_model
from tests.counting import count_step_flops

TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 172,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "tie_word_embeddings": True}
# Dropout off: each process would draw its own masks, and parity compares processes.
TINY_GPT2 = {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}

STEPS, SAVE_AT = 6, 3
COMMON = ["wandb.mode=disabled", "data=synthetic_tokens", "data.seq_len=32", "data.num_samples=512",
          "train.batch_size=8", f"train.steps={STEPS}", "train.log_every=1", "train.lr=0.3",
          "optimizer._target_=torch.optim.SGD", "+optimizer.momentum=0.9", "checkpoint.export_full=true"]
TOLERANCE = 1e-5


def train(out: Path, *overrides: str) -> list[float]:
    """One run through the driver; its loss at every step (a resumed run: the steps it trained)."""
    args = [*COMMON, *overrides]
    summary = run_experiment(prepare(compose_config(args), torch.cuda.device_count()), out, args, {})
    assert summary.ok, summary.error
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def assert_same(losses: list[float], reference: list[float], tolerance: float = TOLERANCE) -> None:
    assert len(losses) == len(reference) == STEPS
    for step, (got, want) in enumerate(zip(losses, reference), start=1):
        assert abs(got - want) / want < tolerance, f"step {step}: loss {got} vs {want}"


def assert_same_weights(run: Path, reference: Path) -> None:
    got, want = load_file(run / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    for name, ref in want.items():
        diff = ((got[name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert diff < TOLERANCE, f"{name}: relative difference {diff:.2e}"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory as save_pretrained writes it: config.json and the weights of a GPT-2
    initialised with another seed than the runs use."""
    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **TINY_GPT2)).save_pretrained(path)
    return path


# ---- the model, in this process -----------------------------------------------------------------
def test_forward_gives_float32_logits_and_the_state_dict_is_the_models_own_under_hf() -> None:
    torch.manual_seed(0)
    model = build_hf(TINY_LLAMA)
    x = torch.randint(0, 256, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32
    assert torch.equal(logits, model.hf(x).logits)
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    keys = list(model.state_dict())
    assert keys == ["hf." + k for k in model.hf.state_dict()]
    assert transformers_state_dict(model.state_dict()).keys() == model.hf.state_dict().keys()
    torch.manual_seed(0)
    again = build_hf(TINY_LLAMA)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_fsdp_units_are_the_models_no_split_modules(gpt2_dir: Path) -> None:
    llama = compose_checked(["model=hf", "data=synthetic_tokens"]).model
    model, blocks = build_model(llama)
    assert [b.__name__ for b in blocks] == ["LlamaDecoderLayer"]
    assert select_units(model, blocks, "blocks", 0) == ["hf.model.layers.0", "hf.model.layers.1"]
    gpt2 = compose_checked(["model=hf_dir", f"model.path={gpt2_dir}", "data=synthetic_tokens", "data.seq_len=64"])
    model, blocks = build_model(gpt2.model)
    assert [b.__name__ for b in blocks] == ["GPT2Block"]
    assert select_units(model, blocks, "blocks", 0) == ["hf.transformer.h.0", "hf.transformer.h.1"]
    named = compose_checked(["model=hf", "data=synthetic_tokens", "model.blocks=[torch.nn.Linear]"]).model
    assert build_model(named)[1] == (torch.nn.Linear,)


def test_a_meta_build_keeps_the_rotary_tables_through_to_empty() -> None:
    """The rotary tables are in no state dict: a meta build must compute them, and
    `to_empty` keep them, or nothing would ever fill them."""
    torch.manual_seed(0)
    plain = build_hf(TINY_LLAMA)
    with torch.device("meta"):
        model = build_hf(TINY_LLAMA)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    buffers = dict(plain.named_buffers())
    assert "hf.model.rotary_emb.inv_freq" in buffers
    assert all(name not in plain.state_dict() for name in buffers)
    model.to_empty(device="cpu")
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    model.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(x), plain(x))


def test_a_directory_gives_the_config_and_with_pretrained_the_weights(gpt2_dir: Path) -> None:
    saved = load_file(gpt2_dir / "model.safetensors")
    fresh = build_hf(path=str(gpt2_dir))
    assert type(fresh.hf).__name__ == "GPT2LMHeadModel" and fresh.hf.config.n_embd == 64
    assert not torch.equal(fresh.hf.transformer.wte.weight, saved["transformer.wte.weight"])
    loaded = build_hf(path=str(gpt2_dir), pretrained=True)
    state = transformers_state_dict(loaded.state_dict())
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert loaded.hf.dtype == torch.float32
    deeper = build_hf({"n_layer": 3}, path=str(gpt2_dir))
    assert len(deeper.hf.transformer.h) == 3


def test_analytic_flops_per_token_of_an_hf_model_come_from_its_config_and_weights() -> None:
    llama = build_hf(TINY_LLAMA)
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 172 + 2 * 64  # q, o; k, v (2 of 4 heads); MLP; norms
    weights = 2 * layer + 64 + 256 * 64  # the final norm, and the head (tied: a matmul all the same)
    assert flops_per_token(llama, 128) == 6 * weights + 12 * 2 * 64 * 128


def test_counted_flops_match_the_analytic_count_for_the_default_hf_model() -> None:
    """FlopCounterMode does not count the CPU attention kernel by itself (torch 2.14):
    without fsdp_exp's formula for it, this ratio is about 0.76."""
    model, _ = build_model(compose_checked(["model=hf", "data=synthetic_tokens"]).model)
    x = torch.randint(0, 256, (2, 128))
    counted = count_step_flops(model, lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
    analytic = flops_per_token(model, 128) * 2 * 128
    assert counted.uncounted == []
    assert counted.model / analytic == pytest.approx(1, abs=0.1)


@pytest.mark.parametrize("overrides, expected", [
    (["model.config.model_type=nope"], "model.config.model_type=nope: not a model type of transformers"),
    (["model.config.hidden_size=65"], "ValueError: The hidden size (65) is not a multiple"),
    (["model.config.vocab_size=100"], "model.config.vocab_size=100: smaller than the data's 256 tokens"),
    (["model.config.max_position_embeddings=64"],
     ("data.seq_len=128: longer than the 64 positions fsdp_exp.models.hf.build_hf reads "
      "(model.config.max_position_embeddings=64)")),
    (["model.pretrained=true"], "model.pretrained=true: needs model.path"),
    (["model.path={dir}"], "model.config.model_type=llama: model.path={dir} gives the config"),
    (["model=hf_dir"], "model.path: missing; set it to a directory holding config.json"),
    (["model=hf_dir", "model.path={dir}/nowhere"], "model.path={dir}/nowhere: no such directory"),
    (["model=hf_dir", "model.path={dir}/.."], "model.path={dir}/..: no config.json in that directory"),
    (["model=hf_dir", "model.path={dir}", "+model.config.n_lyr=3"],
     "model.config.n_lyr: not a setting of GPT2Config"),
    (["model=hf_dir", "model.path={dir}", "data.seq_len=128"],
     "data.seq_len=128: longer than the 64 positions fsdp_exp.models.hf.build_hf reads"),
    (["data=synthetic"], "data: model fsdp_exp.models.hf.build_hf cannot read this data's inputs (samples of shape"),
])
def test_bad_hf_input_is_one_line_naming_the_key(gpt2_dir: Path, overrides: list[str], expected: str) -> None:
    args = ["model=hf", "data=synthetic_tokens", *[o.format(dir=gpt2_dir) for o in overrides]]
    with pytest.raises(ConfigError) as refused:
        precheck(args)
    assert expected.format(dir=gpt2_dir) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_without_transformers_model_hf_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    result = refused_here("model=hf", "data=synthetic_tokens", "wandb.mode=disabled", cwd=tmp_path,
                          missing=("transformers",))
    assert result.returncode == 2, result.stderr
    names(result.stderr, "model=hf", "transformers", "pip install -e .[hf]")
    assert not (tmp_path / "outputs").exists()


# ---- on ranks -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default model=hf (a tiny Llama: rotary tables, grouped-query attention, tied
    head): one unsharded process, and 2 ranks built on the meta device, sharded, saving
    a DCP checkpoint at step 3."""
    root = tmp_path_factory.mktemp("llama")
    runs = {"none": root / "none", "meta": root / "meta"}
    train(runs["none"], "model=hf", "sharding=none")
    train(runs["meta"], "model=hf", "sharding=full", "model.init_device=meta", "checkpoint=dcp",
          f"checkpoint.every={SAVE_AT}", "metrics.peak_tflops=2.0")
    return runs


def losses_of(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_llama_sharded_and_built_on_meta_trains_as_one_unsharded_process(llama: dict[str, Path]) -> None:
    reference = losses_of(llama["none"])
    assert reference[-1] < reference[0] - 0.1, "the reference run must actually learn"
    assert_same(losses_of(llama["meta"]), reference)
    assert_same_weights(llama["meta"], llama["none"])


@pytest.mark.slow
def test_the_models_own_loss_on_pairs_trains_as_cross_entropy_on_its_logits(llama: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """model=hf trains through loss=model by default: on (input, target) pairs the model gets
    the targets (already the next tokens) and computes the loss cross_entropy computes."""
    (plan,) = precheck(["model=hf", "wandb.mode=disabled"]).values()
    assert isinstance(plan.exp.loss, ModelLoss)
    assert_same(train(tmp_path / "cross_entropy", "model=hf", "sharding=none", "loss=cross_entropy"),
                losses_of(llama["none"]), tolerance=1e-6)
    assert_same_weights(tmp_path / "cross_entropy", llama["none"])


def test_llama_runs_report_units_tokens_flops_and_mfu(llama: dict[str, Path]) -> None:
    summary = read_json(llama["meta"] / "summary.json")
    assert [u["module"] for u in summary["fsdp_units"]] == ["hf.model.layers.0", "hf.model.layers.1", "(root)"]
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32)
    assert summary["flops_per_step"] == pytest.approx(summary["flops_per_step_analytic"], rel=0.1)
    assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] / 2.0)


def test_llama_resumed_from_dcp_ends_with_the_uninterrupted_runs_loss(
        llama: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = llama["meta"] / "checkpoints" / f"step_{SAVE_AT:08d}"
    resumed = train(tmp_path / "resumed", "model=hf", "sharding=full", "model.init_device=meta",
                    "checkpoint=dcp", f"resume={checkpoint}")
    uninterrupted = losses_of(llama["meta"])
    assert len(resumed) == STEPS - SAVE_AT
    for got, want in zip(resumed, uninterrupted[SAVE_AT:]):
        assert abs(got - want) <= 1e-6, (resumed, uninterrupted)


def test_the_exported_llama_loads_into_fsdp_exp_and_into_transformers(llama: dict[str, Path]) -> None:
    exported = llama["meta"] / "model.safetensors"
    ours = plain_model(ModelSpec.from_config(compose_checked(["model=hf", "data=synthetic_tokens"]).model))
    load_weights(ours, exported, "task.weights")
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA | {"bos_token_id": 1,
                                                                                     "eos_token_id": 2}))
    theirs.load_state_dict(transformers_state_dict(load_file(exported)))
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x).logits)


@pytest.mark.slow
def test_pretrained_gpt2_from_a_directory_sharded_trains_as_one_unsharded_process(
        gpt2_dir: Path, tmp_path: Path) -> None:
    gpt2 = ["model=hf_dir", f"model.path={gpt2_dir}", "model.pretrained=true"]
    reference = train(tmp_path / "none", *gpt2, "sharding=none")
    # The first step's loss is the saved model's on the first global batch.
    batch_inputs, batch_targets = next(iter(SyntheticTokens(num_samples=512, seq_len=32).batches(16, 0, 1, seed=0)))
    saved = AutoModelForCausalLM.from_pretrained(gpt2_dir)
    with torch.no_grad():
        first = F.cross_entropy(saved(batch_inputs).logits.flatten(0, 1), batch_targets.flatten()).item()
    assert reference[0] == pytest.approx(first, rel=1e-5)
    assert reference[-1] < reference[0] - 0.1
    assert_same(train(tmp_path / "full", *gpt2, "sharding=full"), reference)
    assert_same_weights(tmp_path / "full", tmp_path / "none")


@pytest.mark.slow
@pytest.mark.parametrize("setup", [
    ["model=hf", "sharding=full"],
    ["model=hf", "sharding=grad_op", "train.activation_checkpointing=true"],
    ["model=hf", "sharding=hybrid", "sharding.replicate=2"],
    ["model=hf", "sharding=ddp"],
])
def test_more_llama_setups_train_as_one_unsharded_process(
        llama: dict[str, Path], tmp_path: Path, setup: list[str]) -> None:
    assert_same(train(tmp_path / "run", *setup), losses_of(llama["none"]))


@pytest.mark.slow
def test_pretrained_gpt2_built_on_meta_takes_rank0s_weights(gpt2_dir: Path, tmp_path: Path) -> None:
    gpt2 = ["model=hf_dir", f"model.path={gpt2_dir}", "model.pretrained=true"]
    assert_same(train(tmp_path / "meta", *gpt2, "sharding=full", "model.init_device=meta"),
                train(tmp_path / "none", *gpt2, "sharding=none"))


GPU_CLUSTER = ["launcher=ray", "launcher.use_gpu=true", "launcher.address=ray://head:10001"]


def test_flash_attention_is_checked_on_a_driver_without_a_gpu() -> None:
    """Typed on a login node: the driver checks the model's shapes on the meta device, where
    transformers refuses flash-attn without a GPU; the ranks, on GPUs, build with it."""
    base = ["model=hf", "data=synthetic_tokens", "model.attn_implementation=flash_attention_2"]
    plan = prepare(compose_config([*base, *GPU_CLUSTER, "precision=bf16"]), local_gpus=0)
    assert str(plan.exp.device) == "cuda" and plan.exp.model.kwargs["attn_implementation"] == "flash_attention_2"


@pytest.mark.parametrize(("overrides", "error"), [
    (["precision=fp32", *GPU_CLUSTER],
     "model.attn_implementation=flash_attention_2: flash-attn computes in fp16 or bf16 only; use precision=bf16"),
    (["precision=bf16", "device=cpu"],
     "model.attn_implementation=flash_attention_2: flash-attn runs on CUDA GPUs only; this run's device is cpu"),
])
def test_flash_attention_where_it_cannot_run_is_one_line(overrides: list[str], error: str) -> None:
    cfg = compose_config(["model=hf", "data=synthetic_tokens", "model.attn_implementation=flash_attention_2",
                          *overrides])
    with pytest.raises(ConfigError, match=error):
        prepare(cfg, local_gpus=0)


def test_the_trace_makes_causal_masks_as_a_run_does() -> None:
    """Given no position ids, a run's Llama finds its rows unpacked and lets SDPA mask
    causally (no mask tensor). On fake tensors transformers cannot read the ids and builds a
    batch x tokens x tokens mask; the trace's `unpacked_sequences` makes it decide as the run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_exp.estimate.trace import unpacked_sequences

    class Masks(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.masks: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if "scaled_dot_product" in str(func):
                self.masks.append((kwargs or {}).get("attn_mask"))
            return func(*args, **(kwargs or {}))

    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 172,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}
    with Masks() as real:
        build_hf(config)(torch.randint(0, 256, (2, 16)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_hf(config)
        with Masks() as fake:
            model(torch.randint(0, 256, (2, 16)))
        with unpacked_sequences(), Masks() as traced:
            model(torch.randint(0, 256, (2, 16)))
    assert real.masks == [None] and traced.masks == [None]
    assert fake.masks[0] is not None and tuple(fake.masks[0].shape) == (2, 1, 16, 16)  # what it corrects
