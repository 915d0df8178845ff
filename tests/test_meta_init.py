"""model.init_device=meta: a model built without memory, sharded, then given storage, holds
what a plain build holds: parameters, persistent buffers and buffers in no state dict, each
where it belongs (parameters on the offload device, buffers where the forward runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_exp.cli import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.launch.local import LocalLauncher
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


def test_under_offload_parameters_go_to_the_offload_device_and_buffers_to_the_ranks() -> None:
    """The GPU case, on fake tensors: offloaded parameters on the CPU, buffers on the GPU.
    `to_empty` alone puts both on one device, which FSDP2 does not mend after fully_shard."""
    from fsdp_exp.rank.build import give_storage

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.ones(4, device="meta"), persistent=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        give_storage(model, params_on=torch.device("cpu"), buffers_on=torch.device("cuda"))
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert {n: b.device.type for n, b in model.named_buffers()} == {
            "1.running_mean": "cuda", "1.running_var": "cuda", "1.num_batches_tracked": "cuda", "mask": "cuda"}
        assert "mask" in model._non_persistent_buffers_set  # still out of the state dict


def test_without_offload_parameters_and_buffers_share_the_ranks_device() -> None:
    from fsdp_exp.rank.build import give_storage

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    give_storage(model, params_on=torch.device("cpu"), buffers_on=torch.device("cpu"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_the_model_eval_and_export_load_into_computes_buffers_in_no_state_dict() -> None:
    from fsdp_exp.models import ModelSpec
    from fsdp_exp.tasks.export import plain_model

    model = plain_model(ModelSpec("tests.rank_tasks.BufferedNet", {}, [], "cpu"))
    assert torch.equal(model.scale, torch.arange(1.0, 9.0))
