"""The package as a user installs it: a wheel, away from the checkout, run from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO, read_json, run_cli

# What the build reads. It runs on a copy, so the checkout gets no build/ or egg-info.
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "fsdp_exp", "conf", "hydra_plugins"]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True,
                   capture_output=True, text=True, timeout=180)


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of the checkout, built with this environment's setuptools (no network)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("fsdp_exp-*.whl")
    return wheel


def test_an_installed_wheel_runs_from_any_directory_with_user_configs(tmp_path: Path) -> None:
    """The wheel carries conf/; installed apart from the checkout, `python -m fsdp_exp` and
    `fsdp-exp` find it from an empty directory, and hydra.searchpath adds a user's options
    from a folder (file://) and from a package (pkg://)."""
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "fsdp-exp = fsdp_exp.commands:experiment" in archive.read(entry_points).decode()
    assert "hydra_plugins/fsdp_exp_sweeper/fsdp_exp_sweeper.py" in names  # the sweeper of -m
    shipped = {n.removeprefix("fsdp_exp/conf/") for n in names if n.startswith("fsdp_exp/conf/")}
    assert shipped == {p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml")}

    site = tmp_path / "site"
    pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    user_folder = tmp_path / "user_folder"  # a user's options in a folder of their own
    (user_folder / "sharding").mkdir(parents=True)
    (user_folder / "sharding" / "keep_unsharded.yaml").write_text(
        "defaults:\n  - full\n  - _self_\n\nreshard_after_forward: false\n")
    user_package = tmp_path / "user_site" / "my_configs"  # ... and in a package of their own
    (user_package / "conf" / "model").mkdir(parents=True)
    (user_package / "__init__.py").write_text("")
    (user_package / "conf" / "model" / "two_layer_vit.yaml").write_text("defaults:\n  - vit\n  - _self_\n\nnum_layers: 2\n")
    env = {"PYTHONPATH": f"{site}{os.pathsep}{user_package.parent}"}
    empty = tmp_path / "elsewhere"
    empty.mkdir()

    where = subprocess.run([sys.executable, "-c", "import fsdp_exp.commands.experiment as c; print(c.__file__); print(c.CONF_DIR)"],
                           cwd=empty, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    assert where.stdout.split() == [str(site / "fsdp_exp" / "commands" / "experiment.py"), str(site / "fsdp_exp" / "conf")]

    # One -m sweep through the installed sweeper, with the user's options: it checks both runs
    # (one refused), then trains the other.
    searchpath = f"hydra.searchpath=[file://{user_folder},pkg://my_configs.conf]"
    sweep = run_cli("-m", "train.steps=2,0", "wandb.mode=disabled", searchpath, "sharding=keep_unsharded",
                    "model=two_layer_vit", "hydra.sweep.dir=sweep", cwd=empty, extra_env=env)
    assert sweep.returncode == 0, sweep.stderr
    refused = [line for line in sweep.stderr.splitlines() if line.startswith("fsdp_exp: refused ")]
    assert len(refused) == 1 and refused[0].startswith("fsdp_exp: refused train.steps=0: train.steps=0:"), sweep.stderr
    assert read_json(empty / "sweep" / "1" / "summary.json")["status"] == "refused"
    run = empty / "sweep" / "0"
    summary = read_json(run / "summary.json")
    assert summary["status"] == "ok" and summary["steps"] == 2, summary
    assert summary["choices"]["sharding"] == "keep_unsharded" and summary["choices"]["model"] == "two_layer_vit"
    # The installed package says its version; no repository around it is fsdp_exp's.
    assert summary["environment"]["fsdp_exp"] == "0.1.0" and summary["environment"]["git_commit"] is None
    assert "num_layers: 2" in (run / ".hydra" / "config.yaml").read_text()

    script = run_cli("--cfg", "job", "sharding=grad_op", cwd=empty, extra_env=env, module=(str(site / "bin" / "fsdp-exp"),))
    assert script.returncode == 0, script.stderr
    assert "reshard_after_forward: false" in script.stdout
