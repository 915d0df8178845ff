"""Which modules become FSDP units under each `sharding.wrap` policy."""

from __future__ import annotations

from torch import nn
from torchvision.models.vision_transformer import EncoderBlock

from fsdp_exp.models.gpt import Block, build_gpt
from fsdp_exp.models.vit import build_vit
from fsdp_exp.sharding.wrap import select_units, unit_sizes


def vit() -> nn.Module:
    return build_vit(28, 7, 2, 2, 128, 128, 10)


def test_blocks_are_the_encoder_layers() -> None:
    assert select_units(vit(), (EncoderBlock,), "blocks", 1) == [
        "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]


def test_root_wraps_nothing_below_the_root() -> None:
    model = vit()
    assert select_units(model, (EncoderBlock,), "root", 1) == []
    (row,) = unit_sizes(model, [])
    assert row == {"module": "(root)", "params": sum(p.numel() for p in model.parameters())}


def test_size_takes_large_modules_innermost_first_and_units_cover_every_param() -> None:
    model = vit()
    units = select_units(model, (), "size", 40_000)
    assert "encoder.layers.encoder_layer_0.self_attention" in units  # 66k parameters
    assert all("mlp" not in u for u in units)                        # 33k: too small
    depths = [u.count(".") for u in units]
    assert depths == sorted(depths, reverse=True), "inner units must be sharded first"
    rows = unit_sizes(model, units)
    assert sum(r["params"] for r in rows) == sum(p.numel() for p in model.parameters())


def test_blocks_plus_size_adds_large_modules_outside_the_blocks() -> None:
    model = build_gpt("tiny", vocab_size=4096, block_size=64)
    units = select_units(model, (Block,), "blocks+size", 10_000)
    assert "blocks.0" in units and "blocks.1" in units
    assert "wpe" not in units  # 64 x 64 = 4k parameters: too small
    # wte (262k) shares its weight with lm_head: it must stay in the root's unit.
    assert "wte" not in units and "lm_head" not in units
