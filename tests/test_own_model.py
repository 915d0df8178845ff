"""A user's own model, data and config folder (examples/my_project), with no change to fsdp_exp."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, names, precheck, read_json, read_jsonl, refused_here, run_cli, user_package
from fsdp_exp.driver.plan import prepare
from fsdp_exp.errors import ConfigError

EXAMPLE = REPO / "examples" / "my_project"
SEARCHPATH = "hydra.searchpath=[file://conf]"  # as the example's README shows it
SMALL = ["train.steps=4", "train.log_every=2", "train.batch_size=16", "wandb.mode=disabled"]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the example project, as the working directory and on the import path."""
    copy = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(copy)
    monkeypatch.syspath_prepend(str(copy))
    yield copy
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


def test_the_example_project_trains_as_its_readme_shows(project: Path) -> None:
    assert f"'{SEARCHPATH}'" in (EXAMPLE / "README.md").read_text()
    out = project / "run"
    result = run_cli("model=mynet", "data=squares", SEARCHPATH, *SMALL, "train.lr=3e-3",
                     f"hydra.run.dir={out}", cwd=project)
    assert result.returncode == 0, result.stderr
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2
    assert [u["module"] for u in summary["fsdp_units"]] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "(root)"]
    records = read_jsonl(out / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"], "the user's model must learn the user's data"


@pytest.mark.parametrize("options", [
    ["sharding=full", "offload=true", "model.init_device=meta", "train.activation_checkpointing=true"],
    ["sharding=grad_op", "precision=bf16", "train.compile=true"],
    ["sharding=hybrid", "precision=fp16"],
    ["sharding=ddp", "precision=bf16"],
    ["sharding=none"],
])
def test_the_users_model_composes_with_every_option(project: Path, options: list[str]) -> None:
    from fsdp_exp.commands.experiment import compose_checked

    plan = prepare(compose_checked(["model=mynet", "data=squares", SEARCHPATH, *options]), 0)
    assert plan.exp.model.target == "mypkg.model.Net" and plan.exp.model.kwargs == {
        "width": 64, "depth": 4, "num_classes": 4}


def test_a_config_folder_inside_the_users_package_joins_with_pkg(project: Path) -> None:
    shutil.move(project / "conf", project / "mypkg" / "conf")
    (project / "mypkg" / "conf" / "__init__.py").touch()
    from fsdp_exp.commands.experiment import compose_checked

    cfg = compose_checked(["model=mynet", "data=squares", "hydra.searchpath=[pkg://mypkg.conf]"])
    assert cfg.model._target_ == "mypkg.model.Net" and cfg.data._target_ == "mypkg.data.squares"


def test_a_model_from_the_command_line_gets_only_its_own_arguments(project: Path) -> None:
    """model=custom: the builder and its arguments on the command line, none of the ViT's."""
    from fsdp_exp.commands.experiment import compose_checked

    cfg = compose_checked(["model=custom", "model._target_=mypkg.model.Net", "+model.width=32",
                           "+model.num_classes=4", "model.blocks=[mypkg.model.Block]", "data=squares", SEARCHPATH])
    exp = prepare(cfg, 0).exp
    assert exp.model.kwargs == {"width": 32, "num_classes": 4}
    model, blocks = exp.model.build()
    assert model.head.out_features == 4 and blocks == (sys.modules["mypkg.model"].Block,)


MYNET = ["model=mynet", "data=squares"]


@pytest.mark.parametrize("overrides, message", [
    ([*MYNET, "+model.heads=4"],
     "model.heads: unknown key; model has: blocks, depth, image_size, init_device, num_classes, width"),
    ([*MYNET, "model.blocks=[mypkg.model.Net,torch.nn.GRU]"],
     "model.blocks: torch.nn.modules.rnn.GRU is not in the model mypkg.model.Net builds"),
    ([*MYNET, "model.num_classes=3"], "model.num_classes=3: smaller than the data's 4 classes"),
    ([*MYNET, "model.num_classes=5"],
     "model.num_classes=5: more than the data's 4 classes (mypkg.model.Net returns 5 logits per sample); "
     "set model.num_classes=4"),
    (["model=mynet", "data=synthetic_tokens"], "data.seq_len=128: model mypkg.model.Net cannot read this data's inputs"),
    (["model=custom", "model._target_=torch.nn.Identity", "sharding.wrap=root", "data=squares"],
     "model: torch.nn.Identity returns logits of shape [2, 1, 28, 28] for targets of shape [2]"),
    ([*MYNET, "data._target_=mypkg.model.Block", "~data.num_samples", "+data.width=3"],
     "data._target_=mypkg.model.Block: returned a Block, not a map-style Dataset"),
])
def test_a_model_or_data_that_breaks_the_contract_gets_one_line(project: Path, overrides: list[str],
                                                                message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        precheck([*overrides, SEARCHPATH])
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


SEGMENTATION = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class UNetish(nn.Module):
    def __init__(self, classes=3, width=8):
        super().__init__()
        self.stem, self.block, self.head = nn.Conv2d(1, width, 3, padding=1), Block(width), nn.Conv2d(width, classes, 1)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


class Masks(torch.utils.data.Dataset):
    classes = ["background", "disc", "ring"]

    def __init__(self, train=True):
        g = torch.Generator().manual_seed(0 if train else 1)
        self.images = torch.randn(32, 1, 16, 16, generator=g)
        self.masks = torch.randint(0, 3, (32, 16, 16), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.masks[i]
'''
SEGMENT = ["model=custom", "model._target_=seg.UNetish", "model.blocks=[seg.Block]", "data=custom",
           "data._target_=seg.Masks", "loss.class_dim=1", "train.batch_size=8", "wandb.mode=disabled"]


def test_a_segmentation_nets_logits_without_loss_class_dim_name_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits (batch, classes, H, W) for targets (batch, H, W): the line names loss.class_dim=1,
    and no built-in model (the net is the user's own)."""
    user_package(tmp_path, monkeypatch, "seg", SEGMENTATION)
    with pytest.raises(ConfigError) as refusal:
        precheck([o for o in SEGMENT if o != "loss.class_dim=1"])
    names(str(refusal.value), "model", "seg.UNetish", "[2, 3, 16, 16]", "[2, 16, 16]", "loss.class_dim=1")


@pytest.mark.parametrize("source, target, said", [
    ("import nonexistent_dependency\n", "broken.Net",
     "model._target_=broken.Net: importing broken failed: No module named 'nonexistent_dependency' "
     "(a package it imports is not installed)"),
    ("raise RuntimeError('no GPU driver here')\n", "broken.Net",
     "model._target_=broken.Net: importing broken failed: RuntimeError: no GPU driver here"),
    ("class Unet:\n    pass\n", "broken.UNet", "model._target_=broken.UNet: broken has no 'UNet'; did you mean Unet?"),
])
def test_a_target_that_does_not_import_is_one_line_with_its_whole_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, target: str, said: str) -> None:
    user_package(tmp_path, monkeypatch, "broken", source)
    with pytest.raises(ConfigError) as refusal:
        precheck(["model=custom", f"model._target_={target}", "wandb.mode=disabled"])
    assert str(refusal.value) == said
    sys.modules.pop("broken", None)


def test_a_users_image_model_of_the_wrong_shape_is_not_told_of_the_built_in_models(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_package(tmp_path, monkeypatch, "seg", SEGMENTATION)
    with pytest.raises(ConfigError) as refusal:
        precheck(["model=custom", "model._target_=torch.nn.Flatten", "sharding.wrap=root", "data=custom",
                  "data._target_=seg.Masks", "train.batch_size=8", "wandb.mode=disabled"])
    assert "model=vit" not in str(refusal.value) and "logits of shape" in str(refusal.value), str(refusal.value)


@pytest.mark.parametrize("classes, refused", [(3, None), (2, "smaller than"), (5, "more than")])
def test_a_segmentation_models_classes_are_checked_both_ways_against_the_datas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, classes: int, refused: str | None) -> None:
    """A user's segmentation net (logits (batch, classes, H, W)) on a data set that names its
    3 classes: as many logits as classes pass; fewer or more are refused, naming the setting."""
    user_package(tmp_path, monkeypatch, "seg", SEGMENTATION)
    overrides = [*SEGMENT, f"+model.classes={classes}"]
    if refused is None:
        precheck(overrides)
        return
    with pytest.raises(ConfigError) as refusal:
        precheck(overrides)
    assert str(refusal.value).startswith(f"model.classes={classes}: {refused} the data's 3 classes"), str(refusal.value)


@pytest.mark.parametrize("typed", ["data.num_sample=10", "+data.num_sample=10"])
def test_a_key_the_users_data_builder_does_not_take_lists_the_keys_it_does(project: Path, typed: str) -> None:
    done = refused_here("model=mynet", "data=squares", typed, SEARCHPATH, cwd=project)
    assert done.returncode == 2
    names(done.stderr, "data.num_sample", "image_size, input_keys, num_samples, num_workers, seed, target_key",
          "mypkg.data.squares takes num_samples, image_size, seed")


def test_an_option_of_ones_own_without_the_search_path_names_it(project: Path, tmp_path: Path) -> None:
    here = refused_here("model=mynet", cwd=project)
    assert here.returncode == 2
    names(here.stderr, "model=mynet", "cnn, custom, gpt, hf, hf_dir, resnet, vit", "./conf/model/mynet.yaml",
          "'hydra.searchpath=[file://./conf]'")
    elsewhere = refused_here("model=unet", cwd=tmp_path)
    assert elsewhere.returncode == 2
    names(elsewhere.stderr, "model=unet", "'hydra.searchpath=[file://./conf]'", "model/unet.yaml")
    searched = refused_here("model=unet", SEARCHPATH, cwd=project)  # the path given: no hint
    assert searched.returncode == 2 and "hydra.searchpath" not in searched.stderr
    names(searched.stderr, "model=unet", "cnn, custom, gpt, hf, hf_dir, mynet, resnet, vit")


def test_the_users_data_holds_out_samples_for_eval(project: Path) -> None:
    from fsdp_exp.commands.experiment import compose_checked

    exp = prepare(compose_checked(["model=mynet", "data=squares", SEARCHPATH]), 0).exp
    train, held_out = exp.data.dataset(), exp.data.eval_dataset()
    assert len(train) == len(held_out) == 2048
    assert not torch.equal(train[0][0], held_out[0][0])


SGD = ["optimizer._target_=torch.optim.SGD", "+optimizer.momentum=0.9", "train.lr=0.05"]


@pytest.mark.slow
def test_the_users_model_trains_the_same_under_every_sharding_option(project: Path) -> None:
    """Sharded, offloaded, meta-initialised and checkpointed runs of the user's model match
    its unsharded run step by step; bf16 with compile trains too."""
    common = ["model=mynet", "data=squares", SEARCHPATH, *SMALL, "train.log_every=1", *SGD]
    result = run_cli("-m", *common, "sharding=none,full,grad_op,hybrid,ddp", cwd=project, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (project / "outputs" / "multirun").glob("*/*")
    runs = {read_json(run / "summary.json")["choices"]["sharding"]: run for run in sweep.iterdir() if run.is_dir()}
    out = project / "offload_meta_ac"
    result = run_cli(*common, "sharding=full", "offload=true", "model.init_device=meta",
                     "train.activation_checkpointing=true", f"hydra.run.dir={out}", cwd=project, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs["offload_meta_ac"] = out
    reference = [r["loss"] for r in read_jsonl(runs.pop("none") / "metrics.jsonl")]
    assert reference[-1] < reference[0]
    for name, run in runs.items():
        losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]
        assert losses == pytest.approx(reference, rel=1e-5), name

    out = project / "bf16_compiled"
    result = run_cli(*common, "precision=bf16", "train.compile=true", f"hydra.run.dir={out}", cwd=project, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert losses[-1] < losses[0] and read_json(out / "summary.json")["status"] == "ok"


def test_a_search_path_that_is_not_there_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no conf/ here
    with pytest.raises(ConfigError, match=r"^hydra.searchpath: file://conf: no such folder$"):
        precheck(["model=mynet", SEARCHPATH])
    with pytest.raises(ConfigError, match=r"^hydra.searchpath: pkg://nopkg.conf: no such package here$"):
        precheck(["model=mynet", "hydra.searchpath=[pkg://nopkg.conf]"])


def test_a_package_search_path_whose_package_has_no_such_folder_is_named(project: Path) -> None:
    """The example's package has no conf/ inside it: the search path adds nothing, which
    Hydra only shows as the options it holds being missing."""
    with pytest.raises(ConfigError, match=r"^hydra.searchpath: pkg://mypkg.conf: package mypkg has no conf/ folder"):
        precheck(["model=mynet", "data=squares", "hydra.searchpath=[pkg://mypkg.conf]"])


def test_the_users_model_brings_its_own_data_as_the_main_readme_types_it(project: Path) -> None:
    """`python -m fsdp_exp model=mynet 'hydra.searchpath=[file://./conf]'`, from the project's folder."""
    plans = precheck(["model=mynet", "hydra.searchpath=[file://./conf]"])
    (plan,) = plans.values()
    assert plan.exp.data.target == "mypkg.data.squares" and plan.exp.model.kwargs["num_classes"] == 4


@pytest.mark.slow
def test_the_example_project_installs_as_its_readme_says(tmp_path: Path) -> None:
    """`pip install -e .` in examples/my_project: its pyproject.toml builds a package of mypkg."""
    import subprocess
    import zipfile

    source = tmp_path / "my_project"  # a build leaves its files beside the sources: not in the checkout
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("mypkg-*.whl")
    assert {"mypkg/model.py", "mypkg/data.py"} <= set(zipfile.ZipFile(wheel).namelist())
