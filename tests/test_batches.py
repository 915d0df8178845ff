"""Batches as the data gives them (fsdp_exp.batch): a data set of dicts, passed to the model
as keyword arguments, with the user's own loss (loss=custom) and a model that returns its
own (loss=model), on 2 real gloo ranks against one unsharded process; and the one-line
refusals of a batch, a model and a loss that do not meet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file

from fsdp_exp.batch import BatchKeys, describe, stacked, to_device
from fsdp_exp.errors import ConfigError
from fsdp_exp.loss import ModelLoss, returned_loss
from tests.conftest import PARITY_RUN, PARITY_STEPS, RESIDUAL_BLOCK, user_package, names, precheck, read_json, read_jsonl, run_cli

# A user's two-input model: a 4 x 4 image and 6 tokens in, 4 values out; its blocks are
# FSDP units. Items are dicts, with an id string the model never reads.
PACKAGE = '''
import torch
import torch.nn.functional as F
from torch import nn

''' + RESIDUAL_BLOCK + '''

class TwoInputs(nn.Module):
    def __init__(self, width=32, layers=2):
        super().__init__()
        self.image = nn.Linear(16, width)
        self.text = nn.Embedding(20, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, image, tokens):
        x = self.image(image.flatten(1)) + self.text(tokens).mean(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ScoresItself(TwoInputs):
    """The same model, returning its loss as a Hugging Face model does when given labels."""

    def forward(self, image, tokens, target=None):
        out = super().forward(image, tokens)
        return {"loss": None if target is None else F.mse_loss(out, target), "logits": out}


def items(train=True, n=256):
    g = torch.Generator().manual_seed(0 if train else 1)
    image, tokens = torch.randn(n, 4, 4, generator=g), torch.randint(0, 20, (n, 6), generator=g)
    target = torch.stack([image[:, 0].sum(1), image[:, 1].mean(1), (tokens % 3).float().mean(1), image[:, 3, 3]], 1)
    return [{"image": image[i], "tokens": tokens[i], "target": target[i], "id": f"item {i}"} for i in range(n)]


def my_loss(output, batch):
    assert batch["id"][0].startswith("item ")  # the fields the model does not read reach the loss
    return F.mse_loss(output, batch["target"])


def no_loss(output, batch):
    return output.sum(1)


class Scaled(TwoInputs):
    """With a scalar parameter, as CLIP's logit scale is."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))


class TinyLM(nn.Module):
    """A next-token model that reads Hugging Face's names: input_ids and attention_mask."""

    def __init__(self, vocab=32, width=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def ragged(train=True, n=128):
    """Sequences of 8 positions, each 2 to 8 of them tokens (each token a function of the one
    before it, so the loss can fall) and the rest padding."""
    g = torch.Generator().manual_seed(2 if train else 3)
    ids = torch.randint(1, 32, (n, 8), generator=g)
    for t in range(1, 8):
        ids[:, t] = (ids[:, t - 1] * 5 + 3) % 31 + 1
    mask = (torch.arange(8) < torch.randint(2, 9, (n, 1), generator=g)).long()
    ids = ids * mask
    labels = torch.where(mask.bool() & mask.roll(-1, 1).bool(), ids.roll(-1, 1), -100)
    labels[:, -1] = -100
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def padded(train=True, n=128):
    """Sequences of 8 positions whose last 2 are padding: masked, and labelled -100."""
    g = torch.Generator().manual_seed(0 if train else 1)
    ids = torch.randint(1, 32, (n, 8), generator=g)
    mask = torch.ones(n, 8, dtype=torch.int64)
    ids[:, 6:], mask[:, 6:] = 0, 0
    labels = torch.where(mask.bool(), ids.roll(-1, 1), -100)
    labels[:, 5] = -100
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]
'''
DICTS = ["model=custom", "model._target_=pairs.TwoInputs", "model.blocks=[pairs.Block]", "data=custom",
         "data._target_=pairs.items"]
CUSTOM = [*DICTS, "loss=custom", "loss._target_=pairs.my_loss"]
STEPS, COMMON = PARITY_STEPS, PARITY_RUN


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    return user_package(tmp_path, monkeypatch, "pairs", PACKAGE)


def losses_and_weights(run: Path) -> tuple[list[float], dict]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")], load_file(run / "model.safetensors")


def trained_alike_sharded_and_not(setup: list[str], package: dict, tmp_path: Path) -> dict[str, Path]:
    """`setup` under sharding=none and full: the 2 sharded ranks' losses and weights match the
    one unsharded process's, step by step, and it learnt. Both runs, by sharding."""
    out = tmp_path / "sweep"
    result = run_cli("-m", *COMMON, *setup, "sharding=none,full", f"hydra.sweep.dir={out}", cwd=tmp_path,
                     extra_env=package)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {read_json(run / "summary.json")["choices"]["sharding"]: run for run in out.glob("[0-9]")}
    (reference, weights), (sharded, sharded_weights) = losses_and_weights(runs["none"]), losses_and_weights(runs["full"])
    assert len(reference) == STEPS and reference[-1] < reference[0]
    assert sharded == pytest.approx(reference, rel=1e-5, abs=1e-6)
    for key, ref in weights.items():
        torch.testing.assert_close(sharded_weights[key], ref, rtol=1e-5, atol=1e-6)
    return runs


def test_dict_batches_with_the_users_loss_train_alike_sharded_and_not(package: dict, tmp_path: Path) -> None:
    """loss=custom on dict batches: 2 ranks under sharding=full match one unsharded process,
    step by step."""
    trained_alike_sharded_and_not(CUSTOM, package, tmp_path)


@pytest.mark.slow  # the fast suite has the parity above
def test_dict_batches_with_the_models_own_loss_train_the_same_and_eval_reports_the_users_loss(
        package: dict, tmp_path: Path) -> None:
    """The same model returning its own loss (loss=model, the batch's `target` given to its
    forward) trains as loss=custom does, sharded; task=eval reports the user's loss."""
    runs = trained_alike_sharded_and_not(CUSTOM, package, tmp_path)
    sharded, sharded_weights = losses_and_weights(runs["full"])

    own = tmp_path / "own"
    result = run_cli(*COMMON, *DICTS, "model._target_=pairs.ScoresItself", "loss=model", f"hydra.run.dir={own}",
                     cwd=tmp_path, extra_env=package)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses_and_weights(own)[0] == pytest.approx(sharded, rel=1e-5, abs=1e-6)

    result = run_cli(*CUSTOM, "task=eval", f"task.weights={runs['full'] / 'model.safetensors'}", "task.batch_size=50",
                     "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'eval'}", cwd=tmp_path, extra_env=package)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(tmp_path / "eval" / "summary.json")
    from pairs import TwoInputs, items

    model = TwoInputs()
    model.load_state_dict(sharded_weights)
    held_out = items(train=False)
    batch = {k: torch.stack([i[k] for i in held_out]) for k in ("image", "tokens", "target")}
    with torch.no_grad():
        by_hand = F.mse_loss(model(batch["image"], batch["tokens"]), batch["target"])
    assert summary["eval_loss"] == pytest.approx(float(by_hand), rel=1e-4) and "eval_accuracy" not in summary


@pytest.mark.parametrize("overrides, key, allowed", [
    (["loss=model"], "loss=model", ("pairs.TwoInputs", "Tensor[2, 4]", "scalar", "loss=cross_entropy")),
    (["loss=model", "model._target_=pairs.ScoresItself", "data.input_keys=[image,tokens]"], "loss=model",
     ("None", "labels", "image, tokens, target, id")),
    (["loss=mse"], "data.target_key=labels", ("image, tokens, target, id", "loss=model", "loss=custom")),
    (["loss=custom"], "loss._target_", ("my_loss",)),
    (["loss=custom", "loss._target_=pairs.no_loss"], "loss._target_=pairs.no_loss", ("Tensor[2]", "scalar")),
    (["loss=custom", "loss._target_=pairs.missing"], "loss._target_=pairs.missing", ("pairs has no 'missing'",)),
    (["loss=custom", "loss._target_=pairs.my_loss", "data.input_keys=[image]"], "data.input_keys=[image]",
     ("needs tokens", "image, tokens, target, id")),
    (["loss=custom", "loss._target_=pairs.my_loss", "data.input_keys=[image,text]"], "data.input_keys=[image, text]",
     ("no text", "image, tokens, target, id")),
    (["loss=custom", "loss._target_=pairs.my_loss", "model._target_=pairs.Scaled"], "model",
     ("pairs.Scaled", "scale", "1-D", "sharding=ddp")),
])
def test_a_batch_a_model_and_a_loss_that_do_not_meet_are_refused_in_one_line(
        package: dict, overrides: list[str], key: str, allowed: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        precheck([*DICTS, "wandb.mode=disabled", *overrides])
    names(str(err.value), key, *allowed)


def test_a_batch_goes_to_the_device_whole_and_the_model_gets_the_keys_its_forward_takes() -> None:
    item = {"input_ids": torch.arange(4), "mask": {"a": torch.ones(4)}, "lengths": [torch.tensor(1)], "n": 3,
            "name": "x"}
    raw = to_device(stacked(item, 2), "meta")
    assert raw["input_ids"].shape == (2, 4) and raw["input_ids"].device.type == "meta"
    assert raw["mask"]["a"].device.type == "meta" and raw["lengths"][0].device.type == "meta"
    assert raw["n"].dtype == torch.int64 and raw["name"] == ["x", "x"]
    batch = BatchKeys().read(raw, {"input_ids", "mask"}, loss_reads_targets=True)
    assert list(batch.kwargs) == ["input_ids", "mask"] and batch.targets is None and batch.size == 2
    assert describe(raw).startswith("a dict (input_ids: Tensor[2, 4], mask: dict")


def test_a_pairs_target_goes_to_a_model_that_computes_its_own_loss_and_a_tuples_one_scalar_is_it() -> None:
    """nanoGPT's `GPT.forward(idx, targets=None)` returns (logits, loss): with loss=model (or
    custom) a pair's target is given to it as `targets`; a loss that reads them keeps them."""
    pair = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    given = BatchKeys().read(pair, {"idx", "targets"}, loss_reads_targets=False)
    assert given.args == (pair[0],) and list(given.kwargs) == ["targets"] and given.kwargs["targets"] is pair[1]
    assert BatchKeys().read(pair, {"idx", "targets"}, loss_reads_targets=True).kwargs == {}
    assert BatchKeys().read(pair, None, loss_reads_targets=False).kwargs == {}  # **kwargs: not guessed
    logits, loss = torch.zeros(2, 4, 8), torch.tensor(1.5)
    assert returned_loss((logits, loss)) is loss and returned_loss((loss, logits)) is loss
    assert returned_loss((loss, loss.clone())) is None
    with pytest.raises(ConfigError) as err:
        ModelLoss().check_output((logits, loss, loss.clone()), given, "nano.GPT")
    names(str(err.value), "loss=model", "nano.GPT", "(logits, loss)", "2")


def test_ragged_token_batches_train_alike_sharded_and_not_each_token_weighing_alike(package: dict,
                                                                                  tmp_path: Path) -> None:
    """Cross-entropy over sequences padded by different amounts: 2 ranks under sharding=full
    match one unsharded process on the global batch, step by step, however the tokens fall
    between the ranks (each rank's mean weighed by its tokens, fsdp_exp.rank.trainer.weighed)."""
    trained_alike_sharded_and_not(["model=custom", "model._target_=pairs.TinyLM", "model.blocks=[pairs.Block]",
                                   "data=custom", "data._target_=pairs.ragged"], package, tmp_path)


def test_a_ranks_loss_weighs_by_its_share_of_the_counted_targets_and_nothing_counted_adds_nothing() -> None:
    from fsdp_exp.distributed import Ranks
    from fsdp_exp.rank.trainer import OptimizerStep, Trainer, TrainerSettings

    model = torch.nn.Linear(2, 2)
    ranks = Ranks(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    trainer = Trainer(TrainerSettings(steps=1, batch_size=2), ranks, model,
                      OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1)))
    assert float(trainer.weighed(torch.tensor(2.0), (torch.tensor(3), lambda: torch.tensor(12.0)))) == 1.0
    empty = torch.tensor(float("nan"), requires_grad=True)
    weighed = trainer.weighed(empty, (torch.tensor(0), lambda: torch.tensor(12.0)))
    weighed.backward()
    assert float(weighed) == 0.0 and float(empty.grad) == 0.0
    assert trainer.weighed(empty, None) is empty


def test_padded_token_batches_count_the_tokens_the_loss_sees_with_the_padded_count_beside(package: dict,
                                                                                         tmp_path: Path) -> None:
    """Dict batches of token ids, a quarter of each sequence padding (attention_mask): tokens/s
    counts the rest, padded tokens/s every position, the summary says the share of padding, and
    the model FLOPs per second (MFU's) count the tokens the loss sees."""
    run = tmp_path / "run"
    result = run_cli("model=custom", "model._target_=pairs.TinyLM", "model.blocks=[pairs.Block]", "data=custom",
                     "data._target_=pairs.padded", "wandb.mode=disabled", "memory.estimate=false",
                     "train.batch_size=8", "train.steps=6", "train.log_every=2", f"hydra.run.dir={run}",
                     cwd=tmp_path, extra_env=package)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(run / "summary.json")
    assert summary["padding_share"] == pytest.approx(0.25)
    assert summary["tokens_per_s"] == pytest.approx(0.75 * summary["padded_tokens_per_s"])
    assert summary["padded_tokens_per_s"] == pytest.approx(8 * summary["samples_per_s"])
    assert summary["tflops_per_device"] == pytest.approx(
        0.75 * summary["flops_per_step"] / summary["step_time_s"] / 1e12, rel=1e-6)
    for record in read_jsonl(run / "metrics.jsonl"):
        assert record["padding_share"] == pytest.approx(0.25), record
