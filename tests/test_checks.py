"""Bad input is refused before any process starts, with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from omegaconf import OmegaConf

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.check import check_sweeper, refuse_a_sweep
from fsdp_exp.driver.compose import CONF_DIR, compose_config
from tests.conftest import names, precheck, refused_here, run_cli
from fsdp_exp.errors import ConfigError
from fsdp_exp.sharding import FullyShard


def test_default_config_composes_and_passes_checks() -> None:
    cfg = compose_checked([])
    assert OmegaConf.get_type(cfg.sharding) is FullyShard and cfg.sharding.reshard_after_forward
    assert cfg.model.num_layers == 10 and cfg.model.hidden_dim == 128 and cfg.model.patch_size == 7


def rgb() -> list:
    """A user's data set of 3-channel images."""
    return [(torch.zeros(3, 32, 32), i % 10) for i in range(8)]


def triples() -> list:
    """A user's data set of (image, label, mask) items."""
    return [(torch.zeros(1, 28, 28), i % 10, torch.ones(3)) for i in range(8)]


def with_a_mask() -> list:
    """A user's data set of ((ids, mask), label) items."""
    return [((torch.zeros(16, dtype=torch.long), torch.ones(16)), i % 10) for i in range(8)]


class Broken(torch.utils.data.Dataset):
    """A user's data set whose items fail to load."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple:
        return {}[i]


def broken() -> Broken:
    return Broken()


@pytest.mark.parametrize(
    "overrides, key, allowed",
    [
        (["sharding=foo"], "sharding=foo", ('ddp', 'full', 'grad_op', 'hybrid', 'none')),
        (["train.steps=abc"], "train.steps=abc", ('integer',)),
        (["train.lr=fast"], "train.lr=fast", ('number',)),
        (["offload=maybe"], "offload=maybe", ('true', 'false')),
        (["wandb.mode=loud"], "wandb.mode=loud", ('auto', 'online', 'offline', 'disabled')),
        (["wandb.id=run/1"], "wandb.id=run/1", ('64', 'letters', 'digits', "'-'", "'_'")),
        (["precision.param_dtype=int8"], "precision.param_dtype=int8", ('float32', 'bfloat16', 'float16')),
        (["train.foo=1"], "train.foo", ('activation_checkpointing', 'batch_size', 'compile', 'grad_accum')),
        (["+train.foo=1"], "train.foo", ('activation_checkpointing', 'batch_size', 'compile', 'grad_accum')),
        (["model=cnn", "model.num_layers=3"], "model.num_layers", ('+model.num_layers=',)),
        (["model=cnn", "+model.num_layers=3"], "model.num_layers", ('blocks', 'dropout1', 'dropout2')),
        (["model=custom"], "model._target_", ('mypkg.Net',)),
        (["model=custom", "model._target_=torch.nn.Linear", "+model.in_features=4"],
         "model", ('torch.nn.Linear', 'out_features')),
        (["model=custom", "model._target_=nowhere.Net"], "model._target_=nowhere.Net",
         ("no module named 'nowhere'", 'the working directory', 'PYTHONPATH', 'pip install')),
        (["data=custom", "data._target_=nowhere.Squares"], "data._target_=nowhere.Squares",
         ("no module named 'nowhere'", 'the working directory')),
        (["model=custom", "model._target_=torch.nn.Linearr"], "model._target_=torch.nn.Linearr",
         ("torch.nn has no 'Linearr'", 'Linear')),
        (["model.blocks=[torch.nn.GRU]"], "model.blocks", ('torch.nn.modules.rnn.GRU', 'not in the model')),
        (["model.init_device=disk"], "model.init_device=disk", ('cpu', 'meta')),
        (["train.batch_size=0"], "train.batch_size=0", ('at least 1',)),
        (["train.steps=-3"], "train.steps=-3", ('at least 1',)),
        (["train.lr=0"], "train.lr=0.0", ('greater than 0',)),
        (["launcher.nproc_per_node=zero"], "launcher.nproc_per_node=zero", ('auto', '>= 1')),
        (["launcher.nproc_per_node=0"], "launcher.nproc_per_node=0", ('auto', '>= 1')),
        (["launcher.start_method=fork"], "launcher.start_method=fork", ('forkserver', 'spawn')),
        (["launcher=slurm", "launcher.cluster=pbs"], "launcher.cluster=pbs", ('slurm', 'local')),
        (["task=export", "task.format=onnx"], "task.format=onnx", ('safetensors', 'pt')),
        (["data=fashion_mnist", "data.name=CIFAR10"], "data.name=CIFAR10", ('MNIST', 'FashionMNIST')),
        (["offload=true", "sharding=none"], "offload=true", ('sharded',)),
        (["offload=true", "sharding=ddp"], "offload=true", ('sharding=ddp', 'full replica')),
        (["sharding=hybrid", "sharding.replicate=3"], "sharding.replicate=3", ('divide', '2 ranks')),
        (["sharding=hybrid", "launcher.nproc_per_node=4", "sharding.reshard_after_forward=4"],
         "sharding.reshard_after_forward=4", ('true', 'false', 'group size', '2 ranks')),
        (["sharding.reshard_after_forward=3"], "sharding.reshard_after_forward=3", ('true', 'false', 'group size')),
        (["model.blocks=[]"], "sharding.wrap=blocks", ('no block classes',)),
        (["sharding.wrap=layers"], "sharding.wrap=layers", ('blocks', 'size', 'blocks+size', 'root')),
        (["train.grad_accum=3"], "train.grad_accum=3", ('train.batch_size=32',)),
        (["train.grad_accum=0"], "train.grad_accum=0", ('at least 1',)),
        (["data=custom", f"data._target_={__name__}.triples"],
         "data", ('(input, target)', 'tuple of 3', 'Tensor[1, 28, 28]')),
        (["data=custom", f"data._target_={__name__}.with_a_mask"], "data", ('tuple of 2', 'not a tensor')),
        (["data=custom", f"data._target_={__name__}.broken"], "data", ('KeyError: 0',)),
        (["model=resnet", "data=custom", f"data._target_={__name__}.rgb"],
         "model.channels=1", ('3 channels', 'model.channels=3')),
        (["train.batch_size=4096", "data.num_samples=300"],
         "train.batch_size=4096", ('150 samples', '2 rank(s)', 'data.num_samples')),
        (["sharding=none", "train.batch_size=200", "data.num_samples=300"],
         "train.batch_size=200", ('micro-batches of 400', '300 samples', '1 rank(s)')),
        (["train.batch_size=320", "train.grad_accum=2", "data.num_samples=300"],
         "train.batch_size=320", ('micro-batches of 160', '150 samples')),
        (["model=gpt", "data=synthetic_tokens", "model.size=huge"],
         "model.size=huge", ('tiny', 'small', 'medium', 'large', 'xl')),
        (["model=gpt", "data=synthetic"], "data", ('fsdp_exp.models.gpt.build_gpt', '[1, 28, 28]')),
        (["data=text"], "data.seq_len=128", ('fsdp_exp.models.vit.build_vit', 'token ids', '[128]')),
        (["model=gpt", "data=text", "data.seq_len=2048"],
         "data.seq_len=2048", ('fsdp_exp.models.gpt.build_gpt', 'block_size=1024')),
        (["model=gpt", "data=text", "model.vocab_size=100"], "model.vocab_size=100", ('256 tokens',)),
        (["model.init_device=meta", "sharding=ddp"], "model.init_device=meta", ('sharding=full', 'grad_op', 'hybrid')),
        (["memory.limit_gb=0"], "memory.limit_gb=0.0", ('greater than 0',)),
        (["memory.limit_gb=100000"], "memory.limit_gb=100000.0", ("device's memory", '2 ranks')),
        (["optimizer.momentum=0.9"], "optimizer.momentum", ('+optimizer.momentum=',)),
        (["foo=1"], "foo", ('checkpoint', 'data', 'device', 'launcher', 'memory', 'metrics', 'model')),
        (["sharding=full,grad_op"], "sharding=full,grad_op", ('-m',)),
        (["train.steps=[1"], "train.steps=[1", ('not a valid override',)),
    ],
)
def test_bad_override_names_the_key_and_what_is_allowed(overrides: list[str], key: str, allowed: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        precheck(overrides)
    names(str(err.value), key, *allowed)


def test_more_ranks_than_gpus_is_refused() -> None:
    from fsdp_exp.driver.plan import prepare

    cfg = compose_checked(["device=auto", "launcher.nproc_per_node=3"])  # fine on CPU
    with pytest.raises(ConfigError, match="launcher.nproc_per_node=3: only 2 GPU"):
        prepare(cfg, 2)


def test_compile_is_refused_where_it_cannot_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A PATH with no C++ compiler: torch.compile's CPU backend could not build kernels."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="train.compile=true: torch.compile on CPU needs a C\\+\\+ compiler"):
        precheck(["train.compile=true"])


def test_sharding_none_stands_in_for_the_ranks_it_replaces() -> None:
    from fsdp_exp.driver.plan import prepare

    plan = prepare(compose_checked(["sharding=none", "launcher.nproc_per_node=3"]), 0)
    assert plan.nproc == 1 and plan.exp.train.batch_size == 3 * 32


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["hydra/launcher=nope"], "hydra/launcher=nope: no such option; choose one of: basic, submitit_local, submitit_slurm"),
        (["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=abc"], "hydra.launcher.timeout_min=abc: must be an integer"),
        (["hydra/launcher=submitit_slurm"], "hydra/launcher=submitit_slurm: no SLURM here (srun not found); "
                                            "use hydra/launcher=submitit_local to try it on this machine"),
        (["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"], "hydra.launcher.tasks_per_node=2: must "
         "be 1 (each run is one task that starts its ranks on one node); for a run across nodes, use launcher=slurm"),
        (["hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2"], "hydra.launcher.nodes=2: must be 1 (each run is "
         "one task that starts its ranks on one node); for a run across nodes, use launcher=slurm"),
    ],
)
def test_hydras_launcher_plugins_are_checked_with_the_runs(
        overrides: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    with pytest.raises(ConfigError) as err:
        precheck(["-m", *overrides, "sharding=full,ddp"])
    assert str(err.value) == expected


def test_another_sweeper_is_refused_where_a_launcher_plugin_would_run_its_runs_unseen(tmp_path: Path) -> None:
    """How a sweep's runs ended comes back through fsdp_exp's sweeper: Hydra's basic sweeper
    with the submitit plugin is refused before anything is written; with Hydra's own
    launcher, whose runs end in this process, it runs."""
    refused = refused_here("-m", "hydra/sweeper=basic", "hydra/launcher=submitit_local", "sharding=full,ddp",
                           cwd=tmp_path)
    assert refused.returncode == 2
    names(refused.stderr, "hydra/sweeper=basic", "hydra/launcher=submitit_local", "hydra/sweeper")
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()
    check_sweeper(compose_config(["hydra/sweeper=basic"]).hydra)  # the basic launcher: its runs end here


def test_every_run_of_a_sweep_is_checked_before_any_starts() -> None:
    """The runs a check refuses are known before the first starts (the others then run)."""
    from fsdp_exp.driver.check import Refused

    plans = precheck(["-m", "sharding=full,grad_op", "train.steps=5,0"])
    refused = {key: plan.reason for key, plan in plans.items() if isinstance(plan, Refused)}
    assert set(refused) == {("sharding=full", "train.steps=0"), ("sharding=grad_op", "train.steps=0")}
    for reason in refused.values():
        names(reason, "train.steps=0", "1")
    assert len(plans) == 4


@pytest.mark.parametrize(
    "args",
    [["sharding=bogus"], ["-m", "sharding=full,grad_op", "train.batch_size=0"], ["train.nope=1"],
     ["model=cnn", "data=fashion_mnist", "data.root=/nonexistent"],
     ["checkpoint=dcp", "checkpoint.dir=/proc/forbidden"], ["data.num_samples=300", "train.batch_size=4096"]],
    ids=["option", "sweep", "key", "data.root", "checkpoint.dir", "data share"],
)
def test_cli_refuses_with_one_line_and_leaves_nothing_behind(args: list[str], tmp_path: Path) -> None:
    """The sweep in a fresh process, as typed (the rank server started, then stopped); the
    others through the command's main() in this process. (Damaged weights for task=eval: the
    same checks, in-process, below.)"""
    result = run_cli(*args, cwd=tmp_path, timeout=120) if args[0] == "-m" else refused_here(*args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdp_exp: {args[-1].split('=')[0]}"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == [], "a refused run must leave no output directory"


def test_an_unknown_option_lists_the_options_not_the_schemas() -> None:
    with pytest.raises(ConfigError) as err:
        precheck(["checkpoint=dcp_sync"])
    assert err.value.key == "checkpoint" and err.value.refusal == ConfigError.NO_SUCH_OPTION
    names(str(err.value), "checkpoint=dcp_sync", "dcp, dcp_async, dcp_async_pinned, none")
    assert "schema" not in str(err.value)


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_damaged_weights_for_eval_are_refused_in_one_line(name: str, tmp_path: Path) -> None:
    weights = tmp_path / name
    weights.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ConfigError) as err:
        precheck(["task=eval", f"task.weights={weights}"])
    assert str(err.value).startswith(f"task.weights={weights}: not a weights file"), str(err.value)


def test_weights_of_another_model_are_refused_before_eval(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from fsdp_exp.models import build_model

    model, _ = build_model(compose_checked(["model=cnn"]).model)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="saved from a different model: class_token is absent there"):
        precheck(["task=eval", f"task.weights={tmp_path / 'model.safetensors'}"])


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_a_language_model_brings_token_data_unless_the_command_line_names_other_data(model: str) -> None:
    """`model=gpt` alone (as the README's estimate command types it) reads token data; a
    data option on the command line, before or after the model, still wins."""
    from fsdp_exp.commands.experiment import compose_config

    assert compose_config([f"model={model}"]).hydra.runtime.choices.data == "synthetic_tokens"
    assert compose_config(["data=text", f"model={model}"]).hydra.runtime.choices.data == "text"
    assert compose_config([f"model={model}", "data=text"]).hydra.runtime.choices.data == "text"
    assert compose_config([]).hydra.runtime.choices.data == "synthetic"


def test_the_readmes_estimate_command_is_accepted_as_typed() -> None:
    from tests.conftest import precheck

    plans = precheck(["task=estimate", "model=gpt", "model.size=xl", "task.world_size=64"])
    (plan,) = plans.values()
    assert plan.exp.data.tokens_per_sample > 0


def test_max_batchs_old_setting_names_are_refused_with_the_name_to_write(tmp_path: Path) -> None:
    """task=max_batch's settings are task.*; max_batch.*, where they were before 0.1.0, is
    refused in one line that names what to write instead, under any task."""
    for args in (["task=max_batch", "memory.limit_gb=1", "max_batch.resolution=8"], ["max_batch.resolution=8"]):
        result = refused_here(*args, cwd=tmp_path)
        assert result.returncode == 2 and not (tmp_path / "outputs").exists(), result.stderr
        names(result.stderr.strip().splitlines()[-1], "max_batch.resolution", "task=max_batch task.resolution=")
    (plan,) = precheck(["task=max_batch", "memory.limit_gb=1", "task.resolution=8"]).values()
    assert plan.exp.task.resolution == 8


def test_a_list_of_values_without_m_is_refused_as_a_sweep_and_runs_with_it(tmp_path: Path) -> None:
    """Hydra's parse of the overrides says which is a sweep (`a,b`, `range(...)`), not its
    message text; a list value (`[a,b]`) is one value."""
    for sweep, key in (("sharding=ddp,full", "sharding"), ("train.batch_size=range(8,24,8)", "train.batch_size")):
        result = refused_here(sweep, cwd=tmp_path)
        assert result.returncode == 2 and not (tmp_path / "outputs").exists(), result.stderr
        names(result.stderr.strip().splitlines()[-1], sweep, "a sweep", "-m (--multirun)")
        with pytest.raises(ConfigError) as refused:
            compose_config([sweep])
        assert refused.value.key == key
    refuse_a_sweep(["model.blocks=[torch.nn.Linear,torch.nn.Conv2d]", "train.steps=3"])  # one value each
    assert len(precheck(["-m", "sharding=ddp,full", "train.steps=2"])) == 2  # with -m, its two runs
    from fsdp_exp.commands.experiment import multirun  # what counts as -m, where the refusal is skipped

    assert multirun(["--multirun", "a=1"]) and multirun(["hydra.mode=MULTIRUN"]) and not multirun(["hydra.mode=RUN"])


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "valid"])
def test_cfg_job_prints_the_config_then_the_refusal_a_run_would_meet(refused: bool, tmp_path: Path) -> None:
    """`--cfg job` shows what would run: the config, then, for a combination the checks
    refuse, the run's one line and exit 2 (Hydra prints without the checks)."""
    sharding = "ddp" if refused else "full"
    result = refused_here("--cfg", "job", "model.init_device=meta", f"sharding={sharding}", cwd=tmp_path)
    assert "init_device: meta" in result.stdout  # the config, printed first
    if refused:
        assert result.returncode == 2
        (line,) = result.stderr.strip().splitlines()
        names(line, "model.init_device=meta", "sharding=full, grad_op or hybrid")
    else:
        assert result.returncode == 0 and not result.stderr.strip()
    assert list(tmp_path.iterdir()) == []
    swept = refused_here("-m", "--cfg", "job", "sharding=ddp,full", cwd=tmp_path)
    assert swept.returncode == 2
    names(swept.stderr.strip(), "--cfg job", "drop -m")


@pytest.mark.parametrize("picked", [["model=resnet"], []], ids=["on the command line", "by default"])
def test_a_users_option_named_like_one_of_fsdp_exps_is_refused_naming_both_files(picked: list[str],
                                                                                  tmp_path: Path) -> None:
    """Hydra finds fsdp_exp's conf/ first: a user's conf/model/resnet.yaml (or vit.yaml, the
    default) on the search path would silently lose to fsdp_exp's own option."""
    name = picked[0].partition("=")[2] if picked else "vit"
    (tmp_path / "conf" / "model").mkdir(parents=True)
    theirs = tmp_path / "conf" / "model" / f"{name}.yaml"
    theirs.write_text("_target_: torchvision.models.resnet18\nnum_classes: 10\n")
    result = refused_here(*picked, f"hydra.searchpath=[file://{tmp_path / 'conf'}]", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    names(line, f"model={name}", f"{CONF_DIR}/model/{name}.yaml", str(theirs), f"model/my_{name}.yaml",
          f"model=my_{name}")
    theirs.rename(theirs.with_name("my_net.yaml"))  # renamed: theirs is picked by its own name
    cfg = compose_config(["model=my_net", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
    assert cfg.model._target_ == "torchvision.models.resnet18"


@pytest.mark.parametrize("group, text, key", [
    ("sharding", "reshard_after_forward: false\n", "sharding/mine.yaml: sharding.reshard_after_forward"),
    ("launcher", "", "launcher"),  # sets nothing: composes, and is still no launcher
    ("sharding", "defaults:\n  - schema_fully_shard\nreshard_after_fwd: false\n", None),
], ids=["a key without a schema", "an empty file", "a key its schema lacks"])
def test_a_users_option_of_a_closed_group_must_extend_one_of_its_schemas(group: str, text: str, key: str | None,
                                                                        tmp_path: Path) -> None:
    """Experiment types each closed group by its base (fsdp_exp.groups): a user's option that
    extends no schema is one line naming the schemas, not a traceback at the first use."""
    (tmp_path / "conf" / group).mkdir(parents=True)
    (tmp_path / "conf" / group / "mine.yaml").write_text(text)
    result = refused_here(f"{group}=mine", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    if key is None:
        names(line, "sharding/mine.yaml: sharding.reshard_after_fwd", "min_params", "reshard_after_forward", "wrap")
    else:
        names(line, key, f"{group} group's schemas")
        options = line.rpartition(": ")[2].split(", ")
        assert ("fully_shard" if group == "sharding" else "slurm") in options and "mine" not in options
    assert not (tmp_path / "outputs").exists()


def test_a_model_key_the_option_lacks_is_refused_with_what_its_builder_takes(tmp_path: Path) -> None:
    """`model.n_head=8`: Hydra says to add it with `+`, which helps only when the builder takes
    it. For GPT's builder, which does not, the line lists what it takes; for one that does
    (torch.nn.Linear's in_features), the `+` stays the advice."""
    result = refused_here("model=gpt", "model.n_head=8", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    has, takes_keys = line.split("; model has: ")[1].split(" (fsdp_exp.models.gpt.build_gpt takes ")
    assert has.split(", ") == ["block_size", "blocks", "dropout", "init_device", "size", "vocab_size"]
    assert takes_keys.split(";")[0].split(", ") == ["size", "vocab_size", "block_size", "dropout"]
    names(line, "model.n_head", "model=custom")
    takes = refused_here("model=custom", "model._target_=torch.nn.Linear", "model.in_features=4", cwd=tmp_path)
    assert takes.returncode == 2
    names(takes.stderr, "model.in_features", "+model.in_features=...")


class TinyLM(nn.Module):
    """A user's language model: a token table, a table of positions, a head over 256 tokens."""

    def __init__(self, vocab: int = 256, positions: int = 128) -> None:
        super().__init__()
        self.tokens, self.places = nn.Embedding(vocab, 16), nn.Embedding(positions, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        places = torch.arange(ids.shape[-1], device=ids.device)
        return self.head(self.tokens(ids) + self.places(places))


TINY_LM = ["model=custom", "model._target_=tests.test_checks.TinyLM", "model.blocks=[torch.nn.Linear]",
           "data=synthetic_tokens"]


@pytest.mark.parametrize(("overrides", "line"), [
    (["+model.vocab=100"], "data: token ids up to 255 (its 256 tokens), past the 100 rows of model "
                           "tests.test_checks.TinyLM's token embedding (model.vocab=100)"),
    (["+model.positions=64"], "data.seq_len=128: longer than the 64 positions of model tests.test_checks.TinyLM's "
                              "position embedding (model.positions=64)"),
])
def test_token_ids_and_sequences_past_a_users_embeddings_are_refused_before_launch(overrides: list[str], line: str) -> None:
    """On the meta device an embedding checks no index: the ranks would each fail with
    IndexError. The check watches the tables the forward looks up, with the batch's ids
    or with one index per position."""
    with pytest.raises(ConfigError) as refused:
        precheck([*TINY_LM, *overrides])
    assert str(refused.value) == line
    assert precheck([*TINY_LM, "+model.vocab=256", "+model.positions=128"])  # tables that hold the data: checked, planned


class Regression(torch.utils.data.Dataset):
    """A user's regression data: 16 features, one float target."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((16,), float(index)), torch.tensor([float(index)])


class ReturnsADict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(28 * 28, 10)

    def forward(self, images: torch.Tensor) -> dict:
        return {"logits": self.head(images.flatten(1)), "features": images}


def test_a_regression_and_a_model_returning_a_dict_are_told_what_the_trainer_reads() -> None:
    """The default loss is cross-entropy over logits: a regression's float targets are
    named as such (not "this data gives images"), with the loss that trains them, which
    then passes; a dict output is named, with its keys."""
    regression = ["model=custom", "model._target_=torch.nn.Linear", "+model.in_features=16", "+model.out_features=1",
                  "model.blocks=[torch.nn.Linear]", "data=custom", "data._target_=tests.test_checks.Regression"]
    with pytest.raises(ConfigError) as refused:
        precheck(regression)
    names(str(refused.value), "model", "float32 values of shape [1]", "loss=mse")
    assert "images" not in str(refused.value)
    assert precheck([*regression, "loss=mse"])  # the same model and data, with the loss that reads them
    with pytest.raises(ConfigError) as as_dict:
        precheck(["model=custom", "model._target_=tests.test_checks.ReturnsADict", "model.blocks=[torch.nn.Linear]"])
    names(str(as_dict.value), "model", "tests.test_checks.ReturnsADict", "dict (logits, features)", ".logits")


@pytest.mark.parametrize(("override", "allowed"), [
    ("train.steps=abc", "must be an integer"),
    ("memory.limit_gb=abc", "must be a number"),
    ("offload=maybe", "must be true or false"),
    ("sharding.reshard_after_forward=yes", "must be true or false or an integer"),
    ("train.steps=null", "must have a value (null is not allowed)"),
    ("device=tpu", "choose one of: auto, cpu, cuda"),
    ("precision.param_dtype=fp7", "choose one of: float32, bfloat16, float16"),
    ("train=5", "is a group of settings; set one of its keys instead"),
])
def test_a_value_of_the_wrong_kind_is_refused_with_what_the_settings_type_allows(override: str, allowed: str) -> None:
    """What is allowed comes from the field's declared type in the settings' dataclass
    (OmegaConf's error names the class and the key), not from OmegaConf's wording."""
    with pytest.raises(ConfigError) as err:
        compose_config([override])
    assert str(err.value) == f"{override}: {allowed}"


@pytest.mark.parametrize(("overrides", "key", "value", "refusal"), [
    (["train.foo=1"], "train.foo", None, ConfigError.UNKNOWN_KEY),
    (["model=gpt", "model.n_head=8"], "model.n_head", None, ConfigError.NEW_KEY),
    (["model=mynet"], "model", "mynet", ConfigError.NO_SUCH_OPTION),
    (["logger=[wandb,nope]"], "logger", "nope", ConfigError.NO_SUCH_OPTION),
])
def test_a_refusal_the_command_line_adds_to_carries_its_key_and_kind(
        overrides: list[str], key: str, value: str | None, refusal: str) -> None:
    """The command line's hints (the builder's keys, the search path, a swept group's `++`)
    read what was refused from the error's fields, not from its words."""
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    assert (err.value.key, err.value.value, err.value.refusal) == (key, value, refusal)
