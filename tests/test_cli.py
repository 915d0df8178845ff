"""`python -m fsdp_exp` end to end, as a user types it, in a fresh directory."""

from __future__ import annotations

import importlib
import os
import pickle
import tomllib
import subprocess
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from fsdp_exp.commands.experiment import CONF_DIR, RunTask
from fsdp_exp.driver.check import check_sweep, combinations, parse_overrides, run_key
from fsdp_exp.driver.sweep import SideBySide
from hydra_plugins.fsdp_exp_sweeper.fsdp_exp_sweeper import ComposedOnce
from fsdp_exp.errors import ConfigError
from tests.conftest import REPO, SMALL_VIT, names, read_json, read_jsonl, refused_here, run_cli

@pytest.mark.slow  # 50 steps of the default ViT: 33 s of the fast suite's 15 minutes
def test_default_experiment_trains_to_the_end(tmp_path: Path) -> None:
    """No overrides at all: the default experiment, wandb offline, no network, no GPU."""
    result = run_cli(cwd=tmp_path, timeout=400, extra_env={"WANDB_API_KEY": ""})
    assert result.returncode == 0, result.stderr
    (out,) = (tmp_path / "outputs").glob("*/*")  # outputs/<date>/<time>

    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok"
    assert summary["steps"] == 50 and summary["world_size"] == 2
    assert summary["samples_per_s"] > 0 and summary["peak_mem_gb"] > 0
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50]
    assert {"step", "loss", "samples_per_s", "lr", "step_time_s", "peak_mem_gb"} <= records[0].keys()
    assert records[-1]["loss"] < 0.7 * records[0]["loss"], "the synthetic data must be learnable"
    assert summary["final_loss"] == records[-1]["loss"]

    assert {"config.yaml", "overrides.yaml", "hydra.yaml"} <= {p.name for p in (out / ".hydra").iterdir()}
    assert "step 50/50" in (out / "rank0.log").read_text()
    assert (out / "rank1.log").exists()
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "wandb offline run missing"


# One -m sweep, as a user types it (the outputs/multirun/<date>/<time> default), read by the
# three tests below: every combination runs, offload with both mixed precisions trains, and
# the combinations the check refuses (ddp keeps a full replica) are rows of their own.
GRID = ["sharding=full,ddp", "offload=false,true", "precision=bf16,fp16"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict[tuple, dict], Path]:
    tmp = tmp_path_factory.mktemp("grid")
    result = run_cli("-m", *GRID, *SMALL_VIT, "train.steps=3", "train.log_every=1", cwd=tmp, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (tmp / "outputs" / "multirun").glob("*/*")
    summaries = {}
    for run in sweep.iterdir():
        if run.is_dir() and run.name.isdigit():
            summary = read_json(run / "summary.json")
            offload = next(o.split("=")[1].lower() for o in summary["overrides"] if o.startswith("offload="))
            key = (summary["choices"]["sharding"], offload, summary["choices"]["precision"])
            summaries[key] = summary | {"dir": run}
    return result, summaries, sweep


def test_a_sweep_runs_every_combination_in_a_directory_of_its_own(grid) -> None:
    _, summaries, sweep = grid
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert runs == [str(n) for n in range(8)]
    assert sorted(summaries) == sorted((s, o, p) for s in ("full", "ddp") for o in ("false", "true")
                                       for p in ("bf16", "fp16"))
    for (sharding, offload, _), summary in summaries.items():
        if (sharding, offload) == ("ddp", "true"):
            continue
        assert summary["status"] == "ok", summary
        assert [r["step"] for r in read_jsonl(summary["dir"] / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offload_trains_in_mixed_precision(grid, precision: str) -> None:
    summary = grid[1][("full", "true", precision)]
    assert summary["status"] == "ok" and summary["world_size"] == 2
    losses = [r["loss"] for r in read_jsonl(summary["dir"] / "metrics.jsonl")]
    assert all(loss == loss for loss in losses), f"NaN loss: {losses}"


def test_a_grid_sweep_runs_its_valid_runs_and_shows_the_invalid_one_as_refused(grid) -> None:
    """sharding=ddp with offload=true is refused (DDP keeps a full replica); the other runs of
    the grid still train, and each refused one is a row of its own with its reason."""
    result, summaries, _ = grid
    refused_lines = [line for line in result.stderr.splitlines() if line.startswith("fsdp_exp: refused ")]
    assert len(refused_lines) == 2, result.stderr[-3000:]
    for line in refused_lines:  # the run named by its swept values, then its check's line
        shown, _, reason = line.removeprefix("fsdp_exp: refused ").partition(": ")
        assert set(shown.lower().split()) >= {"sharding=ddp", "offload=true"}  # as Hydra writes a swept value: True
        names(reason, "offload=true", "sharding=full")
    assert "fsdp_exp: 2 of 8 runs" in result.stderr
    for precision in ("bf16", "fp16"):
        refused = summaries[("ddp", "true", precision)]
        assert refused["status"] == "refused"
        names(refused["error"], "offload=true", "sharding=full")


# Hydra's submitit launcher plugin, on this machine; one rank per run keeps it small.
SUBMITIT_LOCAL = ["-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "launcher.nproc_per_node=1",
                  *SMALL_VIT, "train.steps=2"]


@pytest.mark.slow
def test_a_sweep_under_hydras_submitit_launcher_runs_its_runs_at_the_same_time(tmp_path: Path) -> None:
    result = run_cli(*SUBMITIT_LOCAL, "sharding=full,ddp", cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    assert (sweep / ".submitit").is_dir(), "the plugin did not launch the runs"
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in runs] == ["0", "1"]
    summaries = [read_json(run / "summary.json") for run in runs]
    assert [s["status"] for s in summaries] == ["ok", "ok"], summaries
    assert {s["choices"]["sharding"] for s in summaries} == {"full", "ddp"}
    started = [(run / ".hydra").stat().st_mtime for run in runs]
    ended = [(run / "summary.json").stat().st_mtime for run in runs]
    assert max(started) < min(ended), "the runs did not overlap"


@pytest.mark.slow
def test_a_failed_run_under_hydras_submitit_launcher_fails_the_command(tmp_path: Path) -> None:
    """The runs ran in submitit's processes; the command still lists the failed one and exits 1."""
    # 0.6 GB: batch 16 of the default ViT fits with room on either CPU seen (under 0.5 it ran out on one with AMX)
    result = run_cli(*SUBMITIT_LOCAL, "memory.limit_gb=0.6", "train.batch_size=2048,16", cwd=tmp_path, timeout=400)
    assert result.returncode == 1, result.stderr
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "fsdp_exp: 1 of 2 runs failed:", result.stderr
    assert lines[1].startswith(f"  {sweep / '0'}: rank 0 failed: OutOfMemory: ") and "memory.limit_gb=0.6" in lines[1]
    assert read_json(sweep / "0" / "summary.json")["status"] == "oom"
    assert read_json(sweep / "1" / "summary.json")["status"] == "ok"


def test_a_sweep_runs_every_combination_in_hydras_order() -> None:
    def runs(*texts: str) -> list[list[str]]:
        return combinations(parse_overrides(texts))

    assert runs("sharding=ddp,full", "precision=fp32,bf16", "train.steps=3") == [
        ["sharding=ddp", "precision=fp32", "train.steps=3"], ["sharding=ddp", "precision=bf16", "train.steps=3"],
        ["sharding=full", "precision=fp32", "train.steps=3"], ["sharding=full", "precision=bf16", "train.steps=3"]]
    assert runs("train.lr=0.1", "train.lr=0.2,0.3") == [["train.lr=0.2"], ["train.lr=0.3"]]  # the later one
    assert runs("train.batch_size=range(8,25,8)") == [["train.batch_size=8"], ["train.batch_size=16"],
                                                      ["train.batch_size=24"]]
    with pytest.raises(ConfigError, match=r"^train.lr=interval\(0,1\): a range sweep needs a sweeper plugin"):
        runs("train.lr=interval(0,1)")


def test_a_sweep_whose_every_run_is_refused_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = refused_here("-m", *SMALL_VIT, "sharding=ddp", "offload=true", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 2
    names(result.stderr, "offload=true", "sharding=ddp", "full replica")


class CountingLoader:
    """Hydra's own config loader, counting how often it composes a run."""

    def __init__(self, loader: object) -> None:
        self.loader, self.calls = loader, 0

    def load_sweep_config(self, master: object, overrides: list[str]) -> object:
        self.calls += 1
        return self.loader.load_sweep_config(master, overrides)


def test_the_sweeper_hands_the_launcher_each_run_as_the_check_composed_it() -> None:
    """A run of a -m sweep is composed once: for its check, before any run starts; the
    launcher gets that config, not a second composing of the same overrides."""
    with initialize_config_dir(CONF_DIR, version_base="1.3", job_name="fsdp_exp"):
        counting = CountingLoader(GlobalHydra.instance().config_loader())
        master = counting.loader.load_configuration("config", [], run_mode=RunMode.MULTIRUN)
        once = ComposedOnce(counting)
        runs = combinations(parse_overrides(["sharding=full,ddp", *SMALL_VIT], counting.loader))
        launch = check_sweep(runs, lambda overrides: once.compose(master, overrides)).launch
        checked = dict(once.composed)
        given = [once.load_sweep_config(master, overrides) for overrides in launch]
        assert counting.calls == 2 and [checked[tuple(o)] for o in launch] == given
        assert [OmegaConf.get_type(g.sharding).__name__ for g in given] == ["FullyShard", "DDP"]
        again = once.load_sweep_config(master, launch[0])  # not kept twice: composed anew
        assert counting.calls == 3 and again is not given[0] and again == given[0]
        assert pickle.loads(pickle.dumps(ComposedOnce(None))).composed == {}  # a launcher plugin pickles it


def test_a_single_run_its_check_refuses_leaves_nothing_of_it_and_no_file_of_the_users_goes(tmp_path: Path) -> None:
    """A single run is checked by the task function, after Hydra has made its folder: the
    refusal is one line and exit 2, and what Hydra wrote for it (.hydra/, its log file, the
    folders it made) is taken back; a folder of the user's, and what is in it, stays, and
    so do an earlier run's files in its folder."""
    refused = ["sharding=ddp", "offload=true"]  # DDP keeps a whole replica: nothing to offload
    result = refused_here(*refused, cwd=tmp_path)
    assert result.returncode == 2 and not (tmp_path / "outputs").exists(), result.stderr
    names(result.stderr.strip().splitlines()[-1], "offload=true", "sharding=full")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for run_dir in ("mine", "mine/run", "."):
        result = refused_here(*refused, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["mine", "mine/notes.txt"]
    earlier = tmp_path / "earlier"  # the folder of an earlier run: its files and its log's lines stay
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / "summary.json").write_text('{"status": "ok"}')
    (earlier / "fsdp_exp.log").write_text("[10:00:00][INFO] step 1\n")
    result = refused_here(*refused, f"hydra.run.dir={earlier}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert (earlier / "summary.json").read_text() == '{"status": "ok"}'
    assert (earlier / "fsdp_exp.log").read_text() == "[10:00:00][INFO] step 1\n"


def test_hydra_raises_only_while_the_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """HYDRA_FULL_ERROR (Hydra's own switch: raise what composing found, do not print it) is
    set while the command runs, and the user's own setting is back after it, set or not."""
    from fsdp_exp.commands.experiment import hydra_raises

    for users in (None, "0"):
        if users is None:
            monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
        else:
            monkeypatch.setenv("HYDRA_FULL_ERROR", users)
        with pytest.raises(ConfigError), hydra_raises():
            assert os.environ["HYDRA_FULL_ERROR"] == "1"
            raise ConfigError("refused")
        assert os.environ.get("HYDRA_FULL_ERROR") == users


def test_a_launcher_plugins_process_gets_the_task_function_without_the_drivers_plans() -> None:
    """A launcher plugin pickles the task function to its process, which checks its run
    there again: the plans and the outcomes are the driver's, and stay with it."""
    from fsdp_exp.driver.check import Refused

    task = RunTask(SideBySide())
    task.take_plans({run_key(["sharding=ddp"]): Refused("kept")}, {"sharding"})
    elsewhere = pickle.loads(pickle.dumps(task))
    try:
        assert elsewhere.plans == {} and elsewhere.swept == {"sharding"}
        assert task.plans == {("sharding=ddp",): Refused("kept")}
    finally:
        task.side_by_side.close()
        elsewhere.side_by_side.close()


DRIVER = """
import atexit
import sys
import threading
import time
from fsdp_exp.commands import experiment
import fsdp_exp.commands.experiment as cli

main_ended = threading.Event()


def main():
    atexit.register(imported)  # the command ends the process at once, after atexit's hooks
    try:
        run_main()
    finally:
        main_ended.set()


def imported():
    print("driver imported:", sorted(m for m in ("torchvision", "fsdp_exp.models.vit") if m in sys.modules))


if __name__ == "__main__":  # as python -m fsdp_exp does it
    sys.argv = ["fsdp_exp", *sys.argv[1:]]
    run_main, cli.main = cli.main, main
    late = lambda: (main_ended.wait(), time.sleep(0.3), print("a thread still running: waited for"))  # noqa: E731
    threading.Thread(target=late).start()
    experiment()
"""


@pytest.mark.parametrize("bad", [pytest.param(False, marks=pytest.mark.slow), True])  # the run that trains: slow
def test_the_model_is_checked_against_the_data_in_a_fork_of_the_rank_server(tmp_path: Path, bad: bool) -> None:
    """The command never imports the model's modules (torchvision's take 1.1 s): its check
    of the model against the data runs forked from the rank server, which has them; a
    model that cannot read the data is refused from there in one line, before any run
    directory exists. The command then ends at once (fsdp_exp.commands.EndAtOnce), yet waits for a thread
    still running and runs atexit's hooks first, as a normal exit does."""
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "run"
    args = [*SMALL_VIT, "train.steps=1", f"hydra.run.dir={out}", *(["data=synthetic_tokens"] if bad else [])]
    result = run_cli(str(tmp_path / "driver.py"), *args, cwd=tmp_path, module=())
    assert result.stdout.strip().splitlines()[-2:] == ["a thread still running: waited for", "driver imported: []"], \
        result.stdout + result.stderr
    if bad:
        assert result.returncode == 2 and not out.exists()
        assert result.stderr.strip().startswith("fsdp_exp: data.seq_len=128: model fsdp_exp.models.vit.build_vit "
                                                "cannot read this data's inputs"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert read_json(out / "summary.json")["status"] == "ok"


def test_a_key_of_a_swept_group_says_how_to_set_it(tmp_path: Path) -> None:
    """Hydra composes a -m sweep's base config with the swept group's default first
    (checkpoint=none has no `every`): the refusal names the way that works, `++`."""
    result = refused_here("-m", "checkpoint=dcp,dcp_async", "checkpoint.every=1", cwd=tmp_path)
    assert result.returncode == 2 and not (tmp_path / "outputs").exists()
    names(result.stderr, "checkpoint.every", "checkpoint has: export_full", "++checkpoint.every=1")


def test_the_installed_command_starts_as_python_m_fsdp_exp_does() -> None:
    """`fsdp-exp` (pyproject's script) is the very function `python -m fsdp_exp` calls, which
    starts the rank server before torch is imported: the installed command skipped it, and
    each probe's ranks imported torch again."""
    import fsdp_exp.__main__ as python_m

    module, _, name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["fsdp-exp"].partition(":")
    assert getattr(importlib.import_module(module), name) is python_m.experiment
