"""The loss group (fsdp_exp.loss): each option on 2 real gloo ranks against one unsharded
process, the options' arithmetic against torch's own, and the one-line refusals of a model
whose output the loss cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file

from fsdp_exp.batch import Batch, BatchKeys
from fsdp_exp.errors import ConfigError
from fsdp_exp.loss import CrossEntropy, MeanSquaredError
from tests.conftest import PARITY_RUN, PARITY_STEPS, RESIDUAL_BLOCK, user_package, SMALL_VIT, names, precheck, read_json, read_jsonl, run_cli

# A user's regression: 8 features, 4 targets, a small MLP whose blocks are FSDP units.
PACKAGE = '''
import torch
from torch import nn

''' + RESIDUAL_BLOCK + '''

class Net(nn.Module):
    def __init__(self, width=32, layers=2):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sums(train=True, n=256):
    g = torch.Generator().manual_seed(0 if train else 1)
    x = torch.randn(n, 8, generator=g)
    y = torch.stack([x[:, :2].sum(1), x[:, 2:4].prod(1), x[:, 4:].mean(1), x[:, 0] - x[:, 7]], dim=1)
    return list(zip(x, y))
'''
REGRESSION = ["model=custom", "model._target_=regress.Net", "model.blocks=[regress.Block]",
              "data=custom", "data._target_=regress.sums", "loss=mse"]
STEPS, COMMON = PARITY_STEPS, PARITY_RUN


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    return user_package(tmp_path, monkeypatch, "regress", PACKAGE)


def sweep(tmp_path: Path, env: dict | None, *overrides: str, smoothing: tuple[str, ...] = ()) -> dict[tuple, Path]:
    """One -m sweep of sharding=none (the reference) and full (and of the loss's label
    smoothing, when given): each run's directory, by its sharding and smoothing."""
    out = tmp_path / "sweep"
    swept = [f"loss.label_smoothing={','.join(smoothing)}"] if smoothing else []
    result = run_cli("-m", *COMMON, *overrides, "sharding=none,full", *swept, f"hydra.sweep.dir={out}", cwd=tmp_path,
                     extra_env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {}
    for run in out.glob("[0-9]"):
        summary = read_json(run / "summary.json")
        smoothed = next((o.partition("=")[2] for o in summary["overrides"] if o.startswith("loss.label_smoothing=")), "")
        runs[(summary["choices"]["sharding"], smoothed)] = run
    return runs


def assert_same_training(reference: Path, sharded: Path) -> list[float]:
    """The sharded run's losses and final weights are the reference's; the reference's losses."""
    losses = [[r["loss"] for r in read_jsonl(run / "metrics.jsonl")] for run in (reference, sharded)]
    assert len(losses[0]) == STEPS
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    weights = [load_file(run / "model.safetensors") for run in (reference, sharded)]
    for key, ref in weights[0].items():
        torch.testing.assert_close(weights[1][key], ref, rtol=1e-5, atol=1e-6)
    return losses[0]


def test_mse_on_two_ranks_matches_one_process_and_eval_reports_its_loss(package: dict, tmp_path: Path) -> None:
    """loss=mse trains a user's regression, sharded as unsharded; task=eval of its weights
    reports the loss and no accuracy."""
    runs = sweep(tmp_path, package, *REGRESSION)
    losses = assert_same_training(runs[("none", "")], runs[("full", "")])
    assert losses[-1] < losses[0]
    weights = runs[("full", "")] / "model.safetensors"
    result = run_cli(*REGRESSION, "task=eval", f"task.weights={weights}", "wandb.mode=disabled",
                     f"hydra.run.dir={tmp_path / 'eval'}", cwd=tmp_path, extra_env=package)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(tmp_path / "eval" / "summary.json")
    assert 0 < summary["eval_loss"] and "eval_accuracy" not in summary
    # the held-out split, by hand: the same mean squared error
    from regress import Net, sums

    model = Net()
    model.load_state_dict(load_file(weights))
    x, y = map(torch.stack, zip(*sums(train=False)))
    with torch.no_grad():
        assert summary["eval_loss"] == pytest.approx(float(F.mse_loss(model(x), y)), rel=1e-4)


@pytest.mark.slow  # 4 runs; the mse test shows a loss option reaching every rank in the fast suite
def test_label_smoothing_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    """A loss option's setting reaches every rank: the smoothed loss, sharded as unsharded,
    and not the plain one (the ViT's head starts at zero, so both start at ln 10: they part
    from the first update on)."""
    runs = sweep(tmp_path, None, *SMALL_VIT, smoothing=("0.0", "0.2"))
    smoothed = assert_same_training(runs[("none", "0.2")], runs[("full", "0.2")])
    plain = assert_same_training(runs[("none", "0.0")], runs[("full", "0.0")])
    assert abs(smoothed[1] - plain[1]) > 1e-3, (smoothed, plain)


def test_cross_entropy_is_torchs_over_the_class_dimension_it_is_given() -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 7, 5), torch.randint(0, 5, (4, 7))
    targets[0, :3] = -100  # ignored: padding, prompt tokens
    ce = CrossEntropy(label_smoothing=0.1)
    want = F.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1), ignore_index=-100, label_smoothing=0.1)
    torch.testing.assert_close(ce(logits, pair(targets)), want)
    assert ce.counted(pair(targets)) == 4 * 7 - 3
    # segmentation: (batch, classes, H, W) against (batch, H, W)
    maps, pixels = torch.randn(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3))
    seg = CrossEntropy(class_dim=1)
    torch.testing.assert_close(seg(maps, pair(pixels)), F.cross_entropy(maps, pixels))
    assert seg.predictions(maps).shape == pixels.shape and seg.classes(maps) == 5
    seg.check_output(maps, pair(pixels), "unet")
    with pytest.raises(ConfigError, match=r"expected logits of shape \[2, 'classes', 3, 3\]"):
        seg.check_output(maps.permute(0, 2, 3, 1), pair(pixels), "unet")
    mse = MeanSquaredError()
    out, want_y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(mse(out, pair(want_y), reduction="sum"), F.mse_loss(out, want_y, reduction="sum"))
    # a dict batch's targets are at data.target_key
    batch = BatchKeys(target="y").read({"x": torch.zeros(3, 8), "y": want_y}, {"x"}, loss_reads_targets=True)
    assert list(batch.kwargs) == ["x"]
    torch.testing.assert_close(mse(out, batch), F.mse_loss(out, want_y))


def pair(targets: torch.Tensor) -> Batch:
    """A batch of (input, target) pairs with these targets."""
    return BatchKeys().read((torch.zeros(len(targets)), targets), None, loss_reads_targets=True)


@pytest.mark.parametrize("overrides, key, allowed", [
    (["loss=mse"], "loss=mse", ("fsdp_exp.models.vit.build_vit", "[2, 10]", "[2]")),
    (["loss=huber"], "loss=huber", ("cross_entropy", "mse")),
    (["loss.class_dim=2"], "loss.class_dim=2", ("-1", "1")),
    (["loss.label_smoothing=1.5"], "loss.label_smoothing=1.5", ("below 1",)),
    (["loss=mse", "loss.ignore_index=0"], "loss.ignore_index", ("unknown key",)),
])
def test_a_loss_the_model_or_the_data_cannot_meet_is_refused_in_one_line(overrides: list[str], key: str,
                                                                          allowed: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        precheck([*SMALL_VIT, *overrides])
    names(str(err.value), key, *allowed)


def test_cross_entropy_on_a_regressions_targets_names_loss_mse(package: dict) -> None:
    with pytest.raises(ConfigError) as err:
        precheck([*REGRESSION[:-1], "wandb.mode=disabled"])
    names(str(err.value), "model", "regress.Net", "float32", "loss=mse")
