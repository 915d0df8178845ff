"""The models are what the config says they are."""

from __future__ import annotations

import torch
from torchvision.models.vision_transformer import EncoderBlock

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.models import build_model, own_blocks


def test_default_vit_matches_the_spec() -> None:
    model, blocks = build_model(compose_checked([]).model)
    assert blocks == (EncoderBlock,)
    assert sum(isinstance(m, EncoderBlock) for m in model.modules()) == 10
    assert model.conv_proj.in_channels == 1 and model.conv_proj.kernel_size == (7, 7)
    assert model.hidden_dim == 128 and model.mlp_dim == 128
    assert model.encoder.layers[0].self_attention.num_heads == 2
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_cnn_shards_layer_by_layer_and_gives_logits() -> None:
    model, blocks = build_model(compose_checked(["model=cnn"]).model)
    assert blocks == (torch.nn.Conv2d, torch.nn.Linear)
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_same_seed_same_weights() -> None:
    cfg = compose_checked([]).model
    torch.manual_seed(0)
    a, _ = build_model(cfg)
    torch.manual_seed(0)
    b, _ = build_model(cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_with_no_blocks_named_the_units_are_the_models_no_split_modules() -> None:
    """The Hugging Face convention: a model names the classes to keep whole, by name."""

    class Layer(torch.nn.Linear):
        pass

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Sequential(Layer(2, 2), torch.nn.ReLU(), Layer(2, 2))
            self.inner._no_split_modules = ["Layer", "Missing"]

    assert own_blocks(Model()) == (Layer,)
    assert own_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == ()
