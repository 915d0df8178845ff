"""MFU means what it says: the model's own FLOPs, attention included and recompute left out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import flop_registry
from torchvision.models.vision_transformer import EncoderBlock

from fsdp_exp.blocks import block_names, checkpoint_blocks
from fsdp_exp.metrics.flops import (
    count_step_flops,
    flops_per_token,
    step_flops_figures,
)
from fsdp_exp.models.gpt import build_gpt
from fsdp_exp.models.vit import build_vit
from tests.conftest import SMALL_VIT, read_json, run_cli

# --- activation checkpointing: model and hardware FLOPs -------------------------------

def vit_flops(activation_checkpointing: bool):
    torch.manual_seed(0)
    model = build_vit(28, 7, 4, 2, 128, 128, 10)
    if activation_checkpointing:
        checkpoint_blocks(model, block_names(model, (EncoderBlock,)))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    return count_step_flops(model, lambda: F.cross_entropy(model(x), y))


def test_the_forward_activation_checkpointing_recomputes_is_hardware_flops_not_model_flops() -> None:
    """The ViT's blocks hold most of its FLOPs, so the recompute is a large share."""
    plain, checkpointed = vit_flops(False), vit_flops(True)
    assert checkpointed.model == plain.model == plain.hardware
    assert checkpointed.hardware > 1.2 * checkpointed.model


@pytest.mark.slow
def test_activation_checkpointing_leaves_flops_per_step_and_mfu_alone_and_raises_hfu(tmp_path: Path) -> None:
    summaries = {}
    for checkpointing in ("false", "true"):
        out = tmp_path / checkpointing
        result = run_cli(*SMALL_VIT, "train.steps=4", "metrics.warmup_steps=1", "metrics.peak_tflops=2.0",
                         f"train.activation_checkpointing={checkpointing}", f"hydra.run.dir={out}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        summaries[checkpointing] = read_json(out / "summary.json")
    plain, checkpointed = summaries["false"], summaries["true"]
    assert checkpointed["flops_per_step"] == plain["flops_per_step"] == plain["hardware_flops_per_step"]
    assert checkpointed["hardware_flops_per_step"] > 1.15 * checkpointed["flops_per_step"]
    assert plain["hfu"] == pytest.approx(plain["mfu"])
    assert checkpointed["hfu"] / checkpointed["mfu"] == pytest.approx(
        checkpointed["hardware_flops_per_step"] / checkpointed["flops_per_step"])
    for summary in (plain, checkpointed):
        assert summary["flops_source"] == "counted"


# --- attention ------------------------------------------------------------------------

def test_attention_is_counted_and_a_kernel_without_a_formula_is_named_and_left_to_the_analytic_count() -> None:
    if torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry:
        pytest.skip("this torch's FlopCounterMode counts the CPU attention kernel itself")
    model = build_gpt("tiny", vocab_size=256, block_size=128)  # 2 layers, width 64
    x = torch.randint(0, 256, (2, 128))

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), x.flatten())

    analytic = flops_per_token(model, 128) * 2 * 128
    counted, bare = count_step_flops(model, loss), count_step_flops(model, loss, formulas={})
    assert counted.uncounted == []
    assert bare.uncounted == ["aten._scaled_dot_product_flash_attention_for_cpu",
                              "aten._scaled_dot_product_flash_attention_for_cpu_backward"]
    # torch's SDPA formulas: 4 x batch x seq^2 x width forward, 10 x in backward, per layer
    assert counted.model - bare.model == 2 * 14 * 2 * 128 * 128 * 64

    assert step_flops_figures(counted, analytic)["flops_source"] == "counted"
    figures = step_flops_figures(bare, analytic, micro_batches=2)
    assert figures["flops_source"] == "analytic" and figures["flops_per_step"] == 2 * analytic
    assert figures["flops_per_step_counted"] == 2 * bare.model
    assert figures["flops_uncounted_ops"] == bare.uncounted
    not_a_language_model = step_flops_figures(bare, None)
    assert not_a_language_model["flops_source"] == "counted"
    assert not_a_language_model["flops_uncounted_ops"] == bare.uncounted
