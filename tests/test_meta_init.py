"""model.init_device=meta: a model built without memory, sharded, then given storage, holds
what a plain build holds: parameters, persistent buffers and buffers in no state dict, each
where it belongs (parameters on the offload device, buffers where the forward runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.launcher.local import LocalLauncher
from tests import rank_tasks

MODEL = ["model=custom", "model._target_=tests.rank_tasks.BufferedNet", "model.blocks=[torch.nn.BatchNorm2d]", "wandb.mode=disabled", "device=cpu"]


@pytest.mark.parametrize("options", [["offload=true"], ["offload=false", "train.activation_checkpointing=true"]])
def test_a_meta_build_holds_every_buffer_of_a_plain_build_on_every_rank(tmp_path: Path, options: list[str]) -> None:
    plan = prepare(compose_checked([*MODEL, "sharding=full", "model.init_device=meta", *options]), 0)
    LocalLauncher().launch(rank_tasks.state_after_build, plan.exp, tmp_path, nproc=2)
    torch.manual_seed(plan.exp.seed)
    plain = rank_tasks.BufferedNet()
    for rank in (0, 1):
        built = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(built["buffers"]) == {n for n, _ in plain.named_buffers()}
        for name, expected in plain.named_buffers():
            assert torch.equal(built["buffers"][name], expected), f"rank {rank}: buffer {name}"
        assert set(built["buffer_devices"].values()) == {"cpu"}
    weights = torch.load(tmp_path / "rank0.pt")["weights"]
    for name, expected in plain.state_dict().items():
        assert torch.equal(weights[name], expected), name


def meta_net() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.ones(4, device="meta"), persistent=False)
    return model


def test_rank0s_weights_cannot_be_loaded_into_parameters_and_buffers_on_two_devices() -> None:
    """Why the buffers wait: under offload on a GPU, parameters on the CPU and buffers on
    `cuda` (fake tensors here, in a fake world of 2 ranks), torch's loader refuses the model
    on every rank. The build's order before this fix, on a BatchNorm model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from fsdp_exp.estimate.trace import fake_world
    from fsdp_exp.rank.build import move_buffers

    model, plain = meta_net(), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with fake_world(2), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        move_buffers(model, torch.device("cuda"))
        with pytest.raises(ValueError, match="Multiple devices found"):
            set_model_state_dict(model, plain.state_dict(),
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def test_under_offload_buffers_go_where_the_forward_runs_once_the_weights_are_in() -> None:
    """The step after the load, on fake tensors: offloaded parameters stay on the CPU, the
    buffers go to the GPU (FSDP2 moves buffers only inside fully_shard, which ran before)."""
    from fsdp_exp.rank.build import move_buffers

    model = meta_net()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        move_buffers(model, torch.device("cuda"))
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert {n: b.device.type for n, b in model.named_buffers()} == {
            "1.running_mean": "cuda", "1.running_var": "cuda", "1.num_batches_tracked": "cuda", "mask": "cuda"}
        assert "mask" in model._non_persistent_buffers_set  # still out of the state dict


def test_rank0s_weights_fill_a_meta_model_with_parameters_and_buffers_on_one_device() -> None:
    """Rank 0 of a fake world of 2: its plain build's weights and buffers, in no state dict
    too, fill the meta model (the other ranks get them by broadcast: the gloo test above)."""
    from fsdp_exp.estimate.trace import fake_world
    from fsdp_exp.rank.build import fill_from_rank0

    model, plain = meta_net(), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain.register_buffer("mask", torch.full((4,), 2.0), persistent=False)
    plain[1].running_mean.fill_(0.5)
    with fake_world(2):
        fill_from_rank0(model, plain, params_on=torch.device("cpu"), buffers_on=torch.device("cpu"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}
    for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(mine, theirs), name
    assert torch.equal(model.mask, plain.mask)  # in no state dict: copied from rank 0's build


def test_the_model_eval_and_export_load_into_computes_buffers_in_no_state_dict() -> None:
    from fsdp_exp.models import ModelSpec
    from fsdp_exp.tasks.export import plain_model

    model = plain_model(ModelSpec("tests.rank_tasks.BufferedNet", {}, [], "cpu"))
    assert torch.equal(model.scale, torch.arange(1.0, 9.0))
