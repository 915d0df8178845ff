"""`python -m fsdp_exp.compare`: real sweeps and hand-made run directories in the on-disk format."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest
import yaml

from fsdp_exp.commands.compare import main
from fsdp_exp.metrics.plots import plot_comparison
from fsdp_exp.tasks.max_batch.plot import plot_max_batch
from fsdp_exp.tasks.max_batch.record import MaxBatchRecord
from tests.conftest import REPO, SMALL_VIT, read_json, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMPARE = ("-m", "fsdp_exp.compare")


def make_run(run_dir: Path, summary: dict | str | None, overrides: list[str] | None = None,
             batch_size: int | None = None, config: dict | None = None) -> Path:
    """A run directory as Hydra and the driver leave it: .hydra/ and, when given, summary.json."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides or []))
    if batch_size is not None:
        (hydra / "config.yaml").write_text(
            f"seed: 0\ntrain:\n  steps: 50\n  batch_size: {batch_size}\nmemory:\n  limit_gb: null\n")
    if config is not None:
        (hydra / "config.yaml").write_text(yaml.safe_dump(config))
    if summary is not None:
        (run_dir / "summary.json").write_text(summary if isinstance(summary, str) else json.dumps(summary))
    return run_dir


def train_summary(sharding: str, samples_per_s: float, **extra) -> dict:
    return {"status": "ok", "steps": 50, "world_size": 2, "global_batch_size": 64,
            "samples_per_s": samples_per_s, "peak_mem_gb": 1.25, "mfu": None,
            "overrides": [f"sharding={sharding}", "train.steps=5"],
            "choices": {"model": "vit", "sharding": sharding, "task": "train"}, **extra}


def max_batch_summary(sharding: str, max_batch: int | None, **changes) -> dict:
    return {"status": "ok", "task": "max_batch", "world_size": 2, "max_batch_size": max_batch,
            "recommended_batch_size": 190, "bounded_by": "oom", "resolution": 1, "samples_per_s": 400.5,
            "fastest_batch_size": 160, "fastest_samples_per_s": 410.0, "near_fastest_batch_size": 96,
            "peak_under_limit_gb": 1.495, "noise_band_gb": 0.0015, "smallest_batch_needs_gb": None,
            "peak_mem_gb": 1.62, "limit_gb": 1.5, "probes": 5, **changes,
            "overrides": ["task=max_batch", f"sharding={sharding}", "memory.limit_gb=1.5"],
            "choices": {"model": "vit", "sharding": sharding, "task": "max_batch"}}


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def compare(*paths: Path, out: Path) -> tuple[int, list[dict], str]:
    """The command, in this process: its exit code, the CSV's rows and comparison.md."""
    code = main([*map(str, paths), "--out", str(out)])
    if code != 0:
        return code, [], ""
    return code, read_csv(out / "comparison.csv"), (out / "comparison.md").read_text()


@pytest.mark.slow
def test_compare_a_real_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "sharding=ddp,full", "train.steps=3", "train.log_every=1", "metrics.warmup_steps=1",
                     *SMALL_VIT, f"hydra.sweep.dir={sweep}", cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    speed = {read_json(sweep / n / "summary.json")["choices"]["sharding"]: read_json(sweep / n / "summary.json")["samples_per_s"]
             for n in ("0", "1")}

    result = run_cli(str(sweep), cwd=tmp_path, module=COMPARE)
    assert result.returncode == 0, result.stderr
    assert "skipped" not in result.stderr
    table_rows = [line for line in result.stdout.splitlines() if line.startswith("| sharding=")]
    assert [row.split(" | ")[0] for row in table_rows] == ["| sharding=ddp", "| sharding=full"]
    for row, sharding in zip(table_rows, ("ddp", "full")):
        assert f" {speed[sharding]:,.1f} " in row and f"{sweep / ('0' if sharding == 'ddp' else '1')}" in row
    assert result.stdout.splitlines()[-1] == (
        f"wrote {sweep / 'comparison.md'}, {sweep / 'comparison.csv'}, {sweep / 'comparison.png'}, "
        f"{sweep / 'throughput_vs_memory.png'}")

    rows = read_csv(sweep / "comparison.csv")
    assert [(r["setup"], r["task"], r["status"], r["batch_size"], r["world_size"]) for r in rows] == [
        ("sharding=ddp", "train", "ok", "32", "2"), ("sharding=full", "train", "ok", "32", "2")]
    assert [float(r["samples_per_s"]) for r in rows] == [speed["ddp"], speed["full"]]
    assert [float(r["final_loss"]) for r in rows] == [read_json(sweep / n / "summary.json")["final_loss"]
                                                       for n in ("0", "1")]
    assert "\n".join(table_rows) in (sweep / "comparison.md").read_text()
    assert (sweep / "comparison.png").read_bytes().startswith(PNG_MAGIC)


def test_a_run_of_warmup_steps_only_is_marked_beside_its_samples_per_s(tmp_path: Path) -> None:
    make_run(tmp_path / "sweep" / "0", train_summary("ddp", 226.1, warmup_only=True), ["sharding=ddp", "train.steps=3"])
    make_run(tmp_path / "sweep" / "1", train_summary("full", 800.0, warmup_only=False), ["sharding=full", "train.steps=3"])
    code, rows, md = compare(tmp_path / "sweep", out=tmp_path / "out")
    assert code == 0
    assert "| 226.1 (warm-up only) |" in md and "| 800.0 |" in md
    assert [r["samples_per_s"] for r in rows] == ["226.1", "800.0"]  # the CSV keeps numbers


def test_a_run_without_summary_is_skipped_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_run(tmp_path / "sweep" / "0", train_summary("ddp", 800.0), ["sharding=ddp", "train.steps=5"])
    make_run(tmp_path / "sweep" / "1", None, ["sharding=full", "train.steps=5"])
    code, rows, md = compare(tmp_path / "sweep", out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["samples_per_s"]) for r in rows] == [("sharding=ddp train.steps=5", "800.0")]
    reason = "no summary.json: the run did not finish (interrupted or still running)"
    assert f"skipped {tmp_path / 'sweep' / '1'}: {reason}" in capsys.readouterr().err
    assert md.endswith(f"## Skipped runs\n\n- `{tmp_path / 'sweep' / '1'}`: {reason}\n")


def test_interrupted_and_unreadable_runs_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_run(tmp_path / "runs" / "a", train_summary("ddp", 800.0))
    make_run(tmp_path / "runs" / "b", {"status": "interrupted", "world_size": 2, "overrides": ["sharding=full"]})
    make_run(tmp_path / "runs" / "c", '{"status": "ok", "samples_')
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0 and len(rows) == 1 and rows[0]["run_dir"] == str(tmp_path / "runs" / "a")
    err = capsys.readouterr().err
    assert f"skipped {tmp_path / 'runs' / 'b'}: interrupted" in err
    assert f"skipped {tmp_path / 'runs' / 'c'}: summary.json is not valid JSON" in err
    assert "interrupted before its first logged step: nothing to compare" in md


def test_an_interrupted_run_is_a_row_of_its_figures_so_far_marked_interrupted(tmp_path: Path) -> None:
    from fsdp_exp.metrics.sinks import figures_so_far

    logged = [{"step": 3, "loss": 2.0, "samples_per_s": 90.0, "steps_per_s": 1.5, "peak_mem_gb": 0.1, "warmup": True},
              {"step": 10, "loss": 1.0, "samples_per_s": 160.0, "steps_per_s": 2.5, "peak_mem_gb": 0.12},
              {"step": 20, "loss": 0.5, "samples_per_s": 200.0, "steps_per_s": 3.125, "peak_mem_gb": 0.11}]
    so_far = figures_so_far(logged)  # 7 + 10 steps past the warm-up, in 2.8 + 3.2 s: 17 x 64 samples
    assert so_far == {"final_loss": 0.5, "samples_per_s": pytest.approx(17 * 64 / 6.0), "peak_mem_gb": 0.12}
    assert figures_so_far([{"step": 1, "warmup": True}]) == {}
    # logged every 10 steps past a warm-up of 3 (its window not logged): the first spans steps 4-10
    unlogged_warmup = figures_so_far(logged[1:], warmup_steps=3)
    assert unlogged_warmup["samples_per_s"] == pytest.approx(17 * 64 / 6.0)
    make_run(tmp_path / "runs" / "0", train_summary("ddp", 800.0))
    make_run(tmp_path / "runs" / "1", {"status": "interrupted", "signal": "SIGINT", "steps_done": 20, "world_size": 2,
                                       "overrides": ["sharding=full"], "choices": {"sharding": "full", "task": "train"},
                                       **so_far})
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0 and [r["status"] for r in rows] == ["ok", "interrupted"]
    assert float(rows[1]["samples_per_s"]) == pytest.approx(17 * 64 / 6.0) and rows[1]["note"] == "interrupted (SIGINT) after step 20: its figures so far"
    assert "interrupted (SIGINT) after step 20: its figures so far" in md


def test_a_failed_run_is_a_row_that_says_so(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "0", train_summary("ddp", 800.0))
    make_run(tmp_path / "runs" / "1", {"status": "failed", "error": "rank 1 failed: boom\nTraceback...",
                                       "world_size": 2, "overrides": ["sharding=full", "train.steps=5"],
                                       "choices": {"sharding": "full", "task": "train"}})
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["status"], r["samples_per_s"], r["peak_mem_gb"]) for r in rows] == [
        ("sharding=ddp", "ok", "800.0", "1.25"), ("sharding=full", "failed", "", "")]
    assert "| sharding=full | train | failed | - | - | - | - | 2 |" in md
    assert f"- `{tmp_path / 'runs' / '1'}` (sharding=full): failed: rank 1 failed: boom\n" in md
    assert (tmp_path / "out" / "comparison.png").read_bytes().startswith(PNG_MAGIC)


def test_max_batch_runs_show_their_max_batch(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "0", max_batch_summary("full", 212))
    make_run(tmp_path / "runs" / "1", max_batch_summary("ddp", None))
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["task"], r["max_batch_size"], r["batch_size"]) for r in rows] == [
        ("sharding=full", "max_batch", "212", "212"), ("sharding=ddp", "max_batch", "", "")]
    assert "| sharding=full | max_batch | ok | 212 | 160 | 96 | 212 | 400.5 | 1.62 | 1.5 | 1.495 | 2 |" in md
    # The peak next to the limit is the one the limit counts; the resident peak has its own name.
    assert "| peak memory (GB) | memory.limit_gb | peak under the limit (GB) |" in md


def test_a_max_batch_row_says_when_its_answer_stepped_down_or_was_not_verified(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "0", max_batch_summary("full", 212, verification="completed",
                                                        searched_max_batch_size=212))
    make_run(tmp_path / "runs" / "1", max_batch_summary("ddp", 184, verification="stepped down",
                                                        searched_max_batch_size=196))
    make_run(tmp_path / "runs" / "2", max_batch_summary("grad_op", 200, verification="not run",
                                                        searched_max_batch_size=200))
    make_run(tmp_path / "runs" / "3", max_batch_summary("hybrid", 0, verification="not run", searched_max_batch_size=0,
                                                        smallest_batch_needs_gb=3.6512))
    _, rows, _ = compare(tmp_path / "runs", out=tmp_path / "out")
    notes = {r["setup"]: (r["max_batch_size"], r["note"]) for r in rows}
    assert notes == {"sharding=full": ("212", ""),
                     "sharding=ddp": ("184", "stepped down from 196: a run of the command there ran out of memory"),
                     "sharding=grad_op": ("200", "NOT VERIFIED: task.verify_steps=0"),
                     "sharding=hybrid": ("0", "none fits (batch 1 needs 3.65 GB)")}  # nothing to verify


def tune_summary(confirmed: dict | None, **changes) -> dict:
    """As task=tune's report writes it (fsdp_exp.tasks.tune.report)."""
    return {"status": "ok", "task": "tune", "winner": "sharding=full offload=true",
            "command": "python -m fsdp_exp task=train sharding=full offload=true train.batch_size=180",
            "batch_size": 180, "max_batch_size": 195, "grad_accum": 1, "step_s": None, "samples_per_s": 65.5,
            "tokens_per_s": None, "peak_gb": 0.7712, "speed_noise": 0.05, "confirmed": confirmed, "as_fast": [],
            "limit_gb": 0.8, "world_size": 2, "setups": 12, "settled": {"measured": 4}, "probes": 20,
            "probes_reused": 0, "stopped_by_budget": confirmed is None, **changes,
            "overrides": ["task=tune", "memory.limit_gb=0.8"], "choices": {"model": "vit", "task": "tune"}}


def test_a_tune_row_is_its_winner_with_its_batch_max_batch_and_peak_and_says_when_it_is_unconfirmed(
        tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "0", tune_summary({"status": "ok", "samples_per_s": 63.0}), batch_size=32)
    make_run(tmp_path / "runs" / "1", tune_summary(None), batch_size=32)
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0
    # train.batch_size=32 in the config is not the tune's answer: the winner's 180 is
    assert [(r["batch_size"], r["max_batch_size"], r["peak_under_limit_gb"], r["samples_per_s"]) for r in rows] == [
        ("180", "195", "0.7712", "65.5")] * 2
    assert rows[0]["note"] == "winner sharding=full offload=true"
    assert rows[1]["note"] == "winner sharding=full offload=true, NOT CONFIRMED: its command line was never run"
    assert "| 195 | 180 | 65.5 |" in md and "0.771" in md


ESTIMATE = {"status": "ok", "task": "estimate", "peak_mem_gb": 0.0469, "peak_with_runtime_gb": 0.4705, "batch_size": 32,
            "world_size": 2, "device": "cpu", "limit_gb": None, "largest_batch_fitting": None,
            "predicted_max_batch": None, "host_gb": 1.4997, "ranks_per_node": 2, "host_limit_gb": None, "wall_s": 5.3}


def test_an_estimate_sweep_shows_the_batch_its_peak_is_for_and_draws_the_peaks(tmp_path: Path) -> None:
    """As `-m task=estimate sharding=full,ddp` writes it: the batch each peak is for, the
    largest batch under the limit, and the estimated peaks drawn, where no run has samples/s."""
    for num, (sharding, peak, largest) in enumerate([("full", 0.0469, 610), ("ddp", 0.0971, 250)]):
        make_run(tmp_path / "runs" / str(num), ESTIMATE | {"peak_mem_gb": peak, "limit_gb": 0.6,
                                                            "largest_batch_fitting": largest,
                                                            "overrides": ["task=estimate", f"sharding={sharding}"],
                                                            "choices": {"task": "estimate", "sharding": sharding}})
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["batch_size"], r["max_batch_size"], r["estimated_peak_mem_gb"], r["peak_mem_gb"], r["limit_gb"])
            for r in rows] == [("sharding=full", "32", "610", "0.0469", "", "0.6"),
                               ("sharding=ddp", "32", "250", "0.0971", "", "0.6")]
    assert all(r["note"] == "estimated, not measured" for r in rows)
    drawn = plot_comparison([{"setup": r["setup"], "task": "estimate", "status": "ok",
                              "max_batch_size": int(r["max_batch_size"]), "estimated_peak_mem_gb": float(r["estimated_peak_mem_gb"])}
                             for r in rows], tmp_path / "chart.png")
    assert drawn == ["610", "250", "0.047", "0.097"]  # the largest batches, then the peaks


def test_none_fits_is_a_row_with_what_batch_one_needs(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "0", max_batch_summary("full", 212))
    make_run(tmp_path / "runs" / "1", max_batch_summary(
        "ddp", 0, recommended_batch_size=0, bounded_by="oom", samples_per_s=None, fastest_batch_size=None,
        fastest_samples_per_s=None, near_fastest_batch_size=None, peak_under_limit_gb=None, peak_mem_gb=None,
        smallest_batch_needs_gb=3.6512, status="none_fits"))
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0
    assert "| sharding=ddp | max_batch | none_fits | none fits (batch 1 needs 3.65 GB) | - | - | 0 |" in md
    assert "Failed runs" not in md  # an answer, not a failure
    ddp = rows[1]
    assert (ddp["status"], ddp["max_batch_size"], ddp["note"]) == ("none_fits", "0", "none fits (batch 1 needs 3.65 GB)")
    assert (tmp_path / "out" / "comparison.png").read_bytes().startswith(PNG_MAGIC)
    rows = [{"setup": "sharding=full", "task": "max_batch", "status": "ok", "max_batch_size": 212,
             "samples_per_s": 400.5},
            {"setup": "sharding=ddp", "task": "max_batch", "status": "ok", "max_batch_size": 0, "resolution": 1,
             "smallest_batch_needs_gb": 3.6512, "samples_per_s": None}]
    assert plot_comparison(rows, tmp_path / "chart.png") == ["212", "none fits (batch 1 needs 3.65 GB)", "400.5", "-"]


def test_train_and_max_batch_runs_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two separate run directories, one level apart: the setups name the task each ran, and
    the train run's batch size comes from its config; the output goes to a new folder."""
    monkeypatch.chdir(tmp_path)
    train = make_run(tmp_path / "outputs" / "2025-01-01" / "10-00-00", train_summary("full", 800.0),
                     batch_size=24)
    search = make_run(tmp_path / "outputs" / "2025-01-01" / "11-00-00", max_batch_summary("full", 212),
                      batch_size=1)
    assert main([str(train), str(search)]) == 0
    (out,) = (tmp_path / "outputs" / "compare").iterdir()
    assert [(r["setup"], r["max_batch_size"], r["batch_size"]) for r in read_csv(out / "comparison.csv")] == [
        ("train.steps=5 task=train memory.limit_gb=null", "", "24"),
        ("train.steps=50 task=max_batch memory.limit_gb=1.5", "212", "212")]


def test_runs_two_levels_down_and_overrides_from_hydra(tmp_path: Path) -> None:
    """outputs/<date>/<time>: runs found two levels down; without overrides in summary.json,
    .hydra/overrides.yaml names the setup; without a config, the global batch per rank."""
    summary = train_summary("ddp", 500.0)
    del summary["overrides"]
    make_run(tmp_path / "outputs" / "d1" / "t1", summary, ["sharding=ddp"])
    make_run(tmp_path / "outputs" / "d1" / "t2", train_summary("full", 700.0) | {"overrides": ["sharding=full"]})
    code, rows, _ = compare(tmp_path / "outputs", out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["batch_size"]) for r in rows] == [("sharding=ddp", "32"), ("sharding=full", "32")]


def test_same_overrides_everywhere_are_all_shown(tmp_path: Path) -> None:
    make_run(tmp_path / "a", train_summary("ddp", 1.0))
    code, rows, _ = compare(tmp_path / "a", out=tmp_path / "out")
    assert code == 0 and rows[0]["setup"] == "sharding=ddp train.steps=5"


@pytest.mark.parametrize(("make", "message"), [
    (lambda tmp: tmp / "missing", "{path}: no such directory"),
    (lambda tmp: (tmp / "empty" / "sub").mkdir(parents=True) or tmp / "empty",
     "{path}: holds no runs (no summary.json or .hydra/ in it or anywhere below it)"),
])
def test_a_path_without_runs_is_one_clear_line(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    result = run_cli(str(path), "--out", str(tmp_path / "out"), cwd=tmp_path, module=COMPARE)
    assert result.returncode == 2
    assert result.stderr == f"fsdp_exp.compare: {message.format(path=path)}\n"
    assert not (tmp_path / "out").exists()


def test_nothing_usable_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_run(tmp_path / "runs" / "0", None)
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "fsdp_exp.compare: nothing to compare: all 1 run(s) were skipped"
    assert not (tmp_path / "out").exists()


def test_wandb_without_a_key_is_one_clear_line(tmp_path: Path) -> None:
    """The project and entity default to WANDB_PROJECT and WANDB_ENTITY, as for the runs."""
    result = run_cli("--wandb", "somegroup", cwd=tmp_path, module=COMPARE, timeout=120,
                     extra_env={"WANDB_API_KEY": "", "WANDB_MODE": "offline", "HOME": str(tmp_path),
                                "NETRC": str(tmp_path / "no.netrc"), "WANDB_PROJECT": "sweeps",
                                "WANDB_ENTITY": "team"})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdp_exp.compare: --wandb somegroup: ")
    assert "team/sweeps" in lines[0] and "API key" in lines[0]


def max_batch_record(**changes) -> MaxBatchRecord:
    """A max_batch.json as a search writes it, on GPU: peaks as the limit counts them."""
    probe = {"status": "ok", "reason": None, "peak_mem_gb_per_rank": None, "held_mem_gb": 0.7,
             "predicted_peak_gb": None, "wall_s": 7.1, "within_noise": False, "alloc_retries": 0.0}
    probes = [
        probe | {"batch_size": 1, "peak_reserved_gb": 0.81, "samples_per_s": 30.1, "dir": "probes/b1"},
        probe | {"batch_size": 64, "peak_reserved_gb": 0.99, "samples_per_s": 410.0, "dir": "probes/b64"},
        probe | {"batch_size": 212, "peak_reserved_gb": 1.44, "samples_per_s": 405.0, "alloc_retries": 3.0,
                 "dir": "probes/b212"},
        probe | {"batch_size": 213, "peak_reserved_gb": 1.4995, "samples_per_s": 380.0, "within_noise": True,
                 "dir": "probes/b213"},
        probe | {"batch_size": 214, "status": "oom", "reason": "ran out of memory", "samples_per_s": None,
                 "dir": "probes/b214"},
        probe | {"batch_size": 400, "status": "failed", "reason": "rank 1 failed", "samples_per_s": None,
                 "dir": "probes/b400"},
    ]
    record = {"setup": "sharding=full offload=false", "device": "cuda", "world_size": 2, "limit_gb": 1.5,
              "resolution": 1, "margin": 0.1, "search_up_to": 4096, "steps_per_probe": 3,
              "max_batch_size": 212, "recommended_batch_size": 190, "bounded_by": "noise", "noise_band_gb": 0.0015,
              "fastest_batch_size": 64, "fastest_samples_per_s": 410.0, "near_fastest_batch_size": 64,
              "smallest_batch_needs_gb": None,
              "memory_model": {"intercept_gb": 0.8, "slope_gb_per_sample": 0.003, "points": 3,
                               "measure": "peak_reserved_gb"},
              "probes": probes, "probe_count": 6, "wall_s": 40.2}
    return MaxBatchRecord(**record | changes)


def test_plot_max_batch_draws_the_limit_its_noise_band_and_the_batch_to_use(tmp_path: Path) -> None:
    texts = plot_max_batch(max_batch_record(), tmp_path / "max_batch.png")
    assert (tmp_path / "max_batch.png").read_bytes().startswith(PNG_MAGIC)
    for text in ("peak reserved (max over ranks)", "fit inside the noise band", "noise band (1.5 MB)",
                 "oom probe", "failed probe", "max batch size = 212", "recommended = 190", "samples/s",
                 "allocator retries", "fastest = 64", "within 5% of the fastest, from 64"):
        assert text in texts, (text, texts)


def test_plot_max_batch_when_none_fits(tmp_path: Path) -> None:
    record = max_batch_record(max_batch_size=0, recommended_batch_size=0, memory_model=None,
                              smallest_batch_needs_gb=3.6512, fastest_batch_size=None, bounded_by="oom")
    record.probes = [p | {"status": "oom", "batch_size": 1} for p in record.probes[:1]]
    texts = plot_max_batch(record, tmp_path / "max_batch.png")
    assert "none fits (batch 1 needs 3.65 GB)" in texts and "no probe trained" in texts


def test_plot_max_batch_without_an_answer_or_a_model(tmp_path: Path) -> None:
    """Even batch 1 ran out of memory and no limit was set: nothing to fit, nothing to mark."""
    record = max_batch_record(max_batch_size=None, recommended_batch_size=None, memory_model=None, limit_gb=None)
    record.probes = [p for p in record.probes if p["status"] != "ok"]
    plot_max_batch(record, tmp_path / "max_batch.png")
    png = (tmp_path / "max_batch.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000


# What a user types besides the swept keys: about 300 characters, alike in every run.
COMMON = ["model=gpt", "model.num_layers=12", "model.dim=768", "model.num_heads=12", "data=token_file",
          "data.path=/data/datasets/openwebtext/train_tokens_uint16.bin", "train.steps=200",
          "train.batch_size=16", "train.log_every=10", "metrics.warmup_steps=20", "checkpoint=none",
          "wandb.mode=disabled", "wandb.project=sweeps-of-the-gpt-small-model", "launcher.nproc_per_node=8"]


def hydra_run(run_dir: Path, overrides: list[str], status: str = "ok", lr: float = 0.001, **figures) -> Path:
    """A run as the driver writes it: summary.json with its overrides and group choices, and
    .hydra/ with the same overrides and the composed config (which holds every default)."""
    choices = {"model": "gpt", "data": "token_file", "sharding": "full", "precision": "fp32", "task": "train"}
    choices |= {o.split("=")[0]: o.split("=")[1] for o in overrides if o.split("=")[0] in choices}
    summary = {"status": status, "world_size": 8, **figures, "overrides": overrides, "choices": choices}
    config = {"seed": 0, "train": {"steps": 200, "batch_size": 16, "lr": lr}, "memory": {"limit_gb": None}}
    return make_run(run_dir, summary, overrides, config=config)


def trained(samples_per_s: float, peak_mem_gb: float, final_loss: float) -> dict:
    return {"steps": 200, "final_loss": final_loss, "global_batch_size": 128, "warmup_only": False,
            "samples_per_s": samples_per_s, "peak_mem_gb": peak_mem_gb, "held_mem_gb": 0.4, "mfu": None}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    return struct.unpack(">II", data[16:24])


def test_a_learning_rate_sweep_shows_its_losses(tmp_path: Path) -> None:
    """train.lr swept: the final loss of each run, and an eval run's loss and accuracy."""
    sweep = tmp_path / "outputs" / "multirun" / "2026-01-02" / "10-00-00"
    for n, (lr, loss) in enumerate([("1e-3", 2.3456), ("3e-4", 2.8125), ("1e-4", 3.5)]):
        hydra_run(sweep / str(n), [*COMMON, f"train.lr={lr}"], lr=float(lr), **trained(900.0, 3.2, loss))
    evaluated = make_run(tmp_path / "outputs" / "2026-01-02" / "11-00-00", {
        "status": "ok", "eval_loss": 2.4012, "eval_accuracy": 0.5625, "eval_samples": 512,
        "weights": "/ckpt/model.pt", "overrides": ["task=eval", "task.weights=/ckpt/model.pt"],
        "choices": {"task": "eval", "model": "gpt"}})
    code, rows, md = compare(sweep, evaluated, out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["final_loss"], r["eval_loss"], r["eval_accuracy"]) for r in rows][:3] == [
        ("train.lr=1e-3 task=train", "2.3456", "", ""), ("train.lr=3e-4 task=train", "2.8125", "", ""),
        ("train.lr=1e-4 task=train", "3.5", "", "")]
    assert (rows[3]["task"], rows[3]["final_loss"], rows[3]["eval_loss"], rows[3]["eval_accuracy"]) == (
        "eval", "", "2.4012", "0.5625")
    assert "| final loss | eval loss | eval accuracy |" in md
    assert "| 2.3456 | - | - |" in md and "| - | 2.4012 | 56.25% |" in md


def test_compare_outputs_finds_single_runs_and_every_multirun_run(tmp_path: Path) -> None:
    """outputs/<date>/<time> and outputs/multirun/<date>/<time>/<n>, as Hydra lays them out;
    a max_batch run's probes (each with a summary.json) are part of that run, not runs."""
    outputs = tmp_path / "outputs"
    hydra_run(outputs / "2026-01-01" / "09-00-00", ["sharding=ddp"], **trained(500.0, 4.0, 3.0))
    for n, sharding in enumerate(["full", "grad_op"]):
        hydra_run(outputs / "multirun" / "2026-01-01" / "10-00-00" / str(n), [f"sharding={sharding}"],
                  **trained(700.0 + n, 2.0, 3.0))
    search = make_run(outputs / "multirun" / "2026-01-02" / "08-00-00" / "0", max_batch_summary("full", 212))
    make_run(search / "probes" / "01_b64", train_summary("full", 410.0))
    (outputs / "compare" / "2026-01-01_12-00-00").mkdir(parents=True)
    code, rows, _ = compare(outputs, out=tmp_path / "out")
    assert code == 0
    assert [r["run_dir"] for r in rows] == [
        str(outputs / "2026-01-01" / "09-00-00"), str(outputs / "multirun" / "2026-01-01" / "10-00-00" / "0"),
        str(outputs / "multirun" / "2026-01-01" / "10-00-00" / "1"), str(search)]


def test_rows_are_named_by_what_differs_and_the_csv_keeps_every_override(tmp_path: Path) -> None:
    """Two sweeps over sharding x precision with the same 300 characters of other overrides, one
    run that leaves train.lr at its default of 0.001 where the sweeps say 1e-3, and a setup
    run twice: each row is named by its differing settings alone."""
    first = tmp_path / "multirun" / "2026-01-03" / "10-00-00"
    n = 0
    for sharding in ("full", "grad_op"):
        for precision in ("bf16", "fp32"):
            hydra_run(first / str(n), [*COMMON, "train.lr=1e-3", f"sharding={sharding}", f"precision={precision}"],
                      **trained(800.0 + n, 2.0, 3.0))
            n += 1
    again = hydra_run(tmp_path / "2026-01-03" / "12-00-00", [*COMMON, "sharding=full", "precision=bf16"],
                      **trained(790.0, 2.0, 3.0))
    code, rows, md = compare(first, again, out=tmp_path / "out")
    assert code == 0
    assert len(" ".join(COMMON)) > 250
    assert [r["setup"] for r in rows] == [
        f"sharding=full precision=bf16 [{first.relative_to(tmp_path) / '0'}]", "sharding=full precision=fp32",
        "sharding=grad_op precision=bf16", "sharding=grad_op precision=fp32",
        "sharding=full precision=bf16 [2026-01-03/12-00-00]"]
    assert rows[1]["overrides"] == " ".join([*COMMON, "train.lr=1e-3", "sharding=full", "precision=fp32"])
    assert f"Every run: `{' '.join(COMMON)}`" in md


def test_the_bar_chart_stays_readable_at_60_runs(tmp_path: Path) -> None:
    """At most MAX_BARS bars, the fastest, and a figure no larger than MAX_FIGURE (14 x 11 inches
    at 120 dpi)."""
    sweep = tmp_path / "sweep"
    for n in range(60):
        hydra_run(sweep / str(n), [*COMMON, f"train.lr={n + 1}e-5", f"train.batch_size={8 * (n + 1)}"],
                  **trained(100.0 + 10 * n, 1.0 + n / 10, 3.0))
    hydra_run(sweep / "60", [*COMMON, "train.lr=1e-3", "train.batch_size=4096"], status="oom",
              error="ran out of memory on rank 0")
    code, rows, _ = compare(sweep, out=tmp_path / "out")
    assert code == 0 and len(rows) == 61
    width, height = png_size(tmp_path / "out" / "comparison.png")
    assert width <= 14 * 120 and height <= 11 * 120, (width, height)

    from fsdp_exp.commands.compare import Run, comparison_rows
    from fsdp_exp.metrics.plots import MAX_BARS
    from fsdp_exp.metrics.summary import Summary

    texts = plot_comparison(comparison_rows([Run(str(sweep / str(n)), Summary.read(sweep / str(n)), [], {})
                                             for n in range(61)]), tmp_path / "chart.png")
    assert texts[:MAX_BARS] == [f"{100.0 + 10 * n:,.1f}" for n in range(59, 59 - MAX_BARS, -1)]
    assert texts[-1] == (f"the {MAX_BARS} highest by samples/s of 61 runs; {61 - MAX_BARS} left out "
                         "(every run is in comparison.md and comparison.csv)")


def test_throughput_against_peak_memory_marks_the_pareto_front(tmp_path: Path) -> None:
    """One point per run at its peak (the one the limit counts, where a limit was set), the
    front being the runs no other run beats on both; the chart is a function of plain points."""
    sweep = tmp_path / "sweep"
    figures = [("ddp", 1000.0, 6.0, None), ("full", 900.0, 3.0, None), ("grad_op", 850.0, 4.0, None),
               ("hybrid", 600.0, 2.5, 2.2)]
    for n, (sharding, speed, peak, under_limit) in enumerate(figures):
        extra = {"peak_under_limit_gb": under_limit} if under_limit else {}
        hydra_run(sweep / str(n), [*COMMON, f"sharding={sharding}"], **trained(speed, peak, 3.0), **extra)
    hydra_run(sweep / "4", [*COMMON, "sharding=none"], status="failed", error="rank 1 failed: boom")
    code, _, _ = compare(sweep, out=tmp_path / "out")
    assert code == 0
    width, height = png_size(tmp_path / "out" / "throughput_vs_memory.png")
    assert width <= 13 * 120 and height <= 6.5 * 120, (width, height)

    from fsdp_exp.metrics.plots import pareto_front, plot_throughput_vs_memory

    points = [("sharding=ddp", 1000.0, 6.0), ("sharding=full", 900.0, 3.0), ("sharding=grad_op", 850.0, 4.0),
              ("sharding=hybrid", 600.0, 2.2)]
    assert pareto_front(points) == [3, 1, 0]
    texts = plot_throughput_vs_memory(points, tmp_path / "front.png")
    assert texts == ["1   1,000.0 samples/s at 6.00 GB\n     sharding=ddp", "2   900.0 samples/s at 3.00 GB\n     sharding=full",
                     "3   850.0 samples/s at 4.00 GB\n     sharding=grad_op",
                     "4   600.0 samples/s at 2.20 GB\n     sharding=hybrid",
                     "run", "Pareto front: no run is faster at this memory or less"]
    many = [(f"run {n}", 100.0 + n, 1.0 + (n % 7)) for n in range(60)]
    texts = plot_throughput_vs_memory(many, tmp_path / "many.png")
    assert [t.split("\n")[1].strip() for t in texts[:4]] == ["run 56", "run 57", "run 58", "run 59"]
    assert texts[4] == "60 runs; the key names 4 of the Pareto front (every run is in comparison.md)"


def test_failed_oom_and_refused_runs_are_rows_with_their_reason(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    hydra_run(sweep / "0", [*COMMON, "sharding=full"], **trained(900.0, 3.0, 2.5))
    hydra_run(sweep / "1", [*COMMON, "sharding=ddp"], status="oom",
              error="rank 0 ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB\nTraceback ...")
    hydra_run(sweep / "2", [*COMMON, "sharding=grad_op"], status="failed", error="rank 1 failed: boom\nTraceback ...")
    hydra_run(sweep / "3", [*COMMON, "sharding=none"], status="refused",
              error="memory.limit_gb=2: task=estimate needs 7.5 GB per rank for this setup")
    code, rows, md = compare(sweep, out=tmp_path / "out")
    assert code == 0
    assert [(r["setup"], r["status"], r["note"]) for r in rows] == [
        ("sharding=full", "ok", ""),
        ("sharding=ddp", "oom", "rank 0 ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("sharding=grad_op", "failed", "rank 1 failed: boom"),
        ("sharding=none", "refused", "memory.limit_gb=2: task=estimate needs 7.5 GB per rank for this setup")]
    assert f"| rank 1 failed: boom | {sweep / '2'} |" in md
    assert f"| memory.limit_gb=2: task=estimate needs 7.5 GB per rank for this setup | {sweep / '3'} |" in md


def test_one_memory_axis_and_labels_told_apart_when_cut() -> None:
    """Runs with and without a limit are placed by the peak each measured, not half of them
    by the limit's count (which holds the runtime); runs whose setups are cut to the same
    label are numbered as their rows."""
    from fsdp_exp.commands.compare import memory_label, memory_points
    from fsdp_exp.metrics.plots import bar_labels

    limited = {"setup": "a", "status": "ok", "samples_per_s": 10.0, "peak_mem_gb": 0.16, "peak_under_limit_gb": 0.8}
    plain = {"setup": "b", "status": "ok", "samples_per_s": 12.0, "peak_mem_gb": 0.17, "peak_under_limit_gb": None}
    assert memory_points([limited, plain]) == [("a", 10.0, 0.16), ("b", 12.0, 0.17)]
    assert memory_label([limited, plain]) == "peak memory per rank (GB)"
    assert memory_points([limited]) == [("a", 10.0, 0.8)] and "limit" in memory_label([limited])
    long = " ".join(f"group.key_{k}=value_{k}" for k in range(15))
    rows = [{"setup": f"{long} train.lr={lr}", "row": n} for n, lr in enumerate((0.1, 0.2), 1)]
    labels = bar_labels(rows)
    assert labels[0] != labels[1] and labels[0].startswith("1. ") and labels[1].startswith("2. ")
    assert bar_labels([{"setup": "sharding=full", "row": 1}, {"setup": "sharding=ddp", "row": 2}]) == \
        ["sharding=full", "sharding=ddp"]


def test_runs_that_differ_in_many_settings_are_named_by_where_each_is_unusual() -> None:
    """A folder of a user's runs: past 4 differing settings, a run's name leaves out the
    values most runs share; a sweep of a few settings keeps every one of them."""
    from fsdp_exp.commands.compare import Run, setup_names
    from fsdp_exp.metrics.summary import Summary

    base = [f"train.key_{k}=1" for k in range(6)]
    runs = [Run(f"r{n}", Summary(status="ok"), [o.replace("=1", "=2") if i == n else o for i, o in enumerate(base)], {})
            for n in range(6)]
    assert setup_names(runs) == [f"train.key_{n}=2" for n in range(6)]
    sweep = [Run(f"s{n}", Summary(status="ok"), [f"sharding={s}", f"precision={p}"], {})
             for n, (s, p) in enumerate([("full", "fp32"), ("full", "bf16"), ("ddp", "fp32")])]
    assert setup_names(sweep) == ["sharding=full precision=fp32", "sharding=full precision=bf16",
                                  "sharding=ddp precision=fp32"]
