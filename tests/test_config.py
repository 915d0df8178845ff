"""Bad input is refused before any process starts, with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_exp.cli import compose_checked, precheck
from fsdp_exp.config import ConfigError
from tests.conftest import run_cli


def test_default_config_composes_and_passes_checks() -> None:
    cfg = compose_checked([])
    assert cfg.sharding._target_.endswith("FullyShard") and cfg.sharding.reshard_after_forward
    assert cfg.model.num_layers == 10 and cfg.model.hidden_dim == 128 and cfg.model.patch_size == 7


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["sharding=foo"], "sharding=foo: no such option; choose one of: full, grad_op, none"),
        (["train.steps=abc"], "train.steps=abc: must be an integer"),
        (["train.lr=fast"], "train.lr=fast: must be a number"),
        (["offload=maybe"], "offload=maybe: must be true or false"),
        (["wandb.mode=loud"], "wandb.mode=loud: choose one of: online, offline, disabled"),
        (["precision.param_dtype=int8"], "choose one of: float32, bfloat16, float16"),
        (["train.foo=1"], "train.foo: unknown key; train has: batch_size, log_every, lr, steps"),
        (["+train.foo=1"], "train.foo: unknown key; train has: batch_size, log_every, lr, steps"),
        (["model=cnn", "model.num_layers=3"], "model.num_layers: unknown key; model has: blocks, dropout1"),
        (["train.batch_size=0"], "train.batch_size=0: must be at least 1"),
        (["train.steps=-3"], "train.steps=-3: must be at least 1"),
        (["train.lr=0"], "train.lr=0.0: must be greater than 0"),
        (["launcher.nproc_per_node=zero"], "launcher.nproc_per_node=zero: must be auto or an integer >= 1"),
        (["launcher.nproc_per_node=0"], "launcher.nproc_per_node=0: must be auto or an integer >= 1"),
        (["offload=true", "sharding=none"], "offload=true: needs a sharded model"),
        (["sharding=none", "launcher.nproc_per_node=2"], "sharding=none trains one unsharded replica"),
        (["sharding=full,grad_op"], "sharding=full,grad_op: a list of values is a sweep; add -m"),
        (["train.steps=[1"], "train.steps=[1: not a valid override"),
    ],
)
def test_bad_override_names_the_key_and_what_is_allowed(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        precheck(overrides)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_more_ranks_than_gpus_is_refused() -> None:
    from fsdp_exp.config import check

    cfg = compose_checked(["device=auto", "launcher.nproc_per_node=3"])  # fine on CPU
    with pytest.raises(ConfigError, match="launcher.nproc_per_node=3: only 2 GPU"):
        check(cfg, gpu_count=2)


def test_every_run_of_a_sweep_is_checked_before_any_starts() -> None:
    with pytest.raises(ConfigError, match="train.steps=0: must be at least 1"):
        precheck(["-m", "sharding=full,grad_op", "train.steps=5,0"])


@pytest.mark.parametrize(
    "args",
    [["sharding=bogus"], ["-m", "sharding=full,grad_op", "train.batch_size=8,0"], ["train.nope=1"]],
)
def test_cli_refuses_with_one_line_and_leaves_nothing_behind(args: list[str], tmp_path: Path) -> None:
    result = run_cli(*args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp_exp: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == [], "a refused run must leave no output directory"
