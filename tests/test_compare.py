"""`python -m fsdp_exp.compare`: real sweeps and hand-made run directories in the on-disk format."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fsdp_exp.compare import main
from fsdp_exp.metrics.plots import plot_comparison, plot_max_batch
from tests.conftest import REPO, SMALL_VIT, read_json, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMPARE = ("-m", "fsdp_exp.compare")


def make_run(run_dir: Path, summary: dict | str | None, overrides: list[str] | None = None,
             batch_size: int | None = None) -> Path:
    """A run directory as Hydra and the driver leave it: .hydra/ and, when given, summary.json."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides or []))
    if batch_size is not None:
        (hydra / "config.yaml").write_text(
            f"seed: 0\ntrain:\n  steps: 50\n  batch_size: {batch_size}\nmemory:\n  limit_gb: null\n")
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
        f"wrote {sweep / 'comparison.md'}, {sweep / 'comparison.csv'}, {sweep / 'comparison.png'}")

    rows = read_csv(sweep / "comparison.csv")
    assert [(r["setup"], r["task"], r["status"], r["batch_size"], r["world_size"]) for r in rows] == [
        ("sharding=ddp", "train", "ok", "32", "2"), ("sharding=full", "train", "ok", "32", "2")]
    assert [float(r["samples_per_s"]) for r in rows] == [speed["ddp"], speed["full"]]
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
    assert "interrupted: the run was stopped before it finished" in md


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
    assert "| sharding=full | max_batch | ok | 212 | 160 | 96 | 212 | 400.5 | 1.5 | 1.495 | 1.62 | 2 |" in md
    # The peak next to the limit is the one the limit counts; the resident peak has its own name.
    assert "| memory.limit_gb | peak under the limit (GB) | peak memory (GB) |" in md


def test_none_fits_is_a_row_with_what_batch_one_needs(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "0", max_batch_summary("full", 212))
    make_run(tmp_path / "runs" / "1", max_batch_summary(
        "ddp", 0, recommended_batch_size=0, bounded_by="oom", samples_per_s=None, fastest_batch_size=None,
        fastest_samples_per_s=None, near_fastest_batch_size=None, peak_under_limit_gb=None, peak_mem_gb=None,
        smallest_batch_needs_gb=3.6512))
    code, rows, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0
    assert "| sharding=ddp | max_batch | ok | none fits (batch 1 needs 3.65 GB) | - | - | 0 |" in md
    assert "Failed runs" not in md
    ddp = rows[1]
    assert (ddp["status"], ddp["max_batch_size"], ddp["note"]) == ("ok", "0", "none fits (batch 1 needs 3.65 GB)")
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
     "{path}: holds no runs (no summary.json or .hydra/ in it, one or two levels down)"),
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
    assert lines[0].startswith("fsdp_exp.compare: --wandb somegroup: could not read the group's runs "
                               "from wandb project team/sweeps (")
    assert "API key" in lines[0]


def max_batch_record(**changes) -> dict:
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
    return record | changes


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
    record["probes"] = [p | {"status": "oom", "batch_size": 1} for p in record["probes"][:1]]
    texts = plot_max_batch(record, tmp_path / "max_batch.png")
    assert "none fits (batch 1 needs 3.65 GB)" in texts and "no probe trained" in texts


def test_plot_max_batch_without_an_answer_or_a_model(tmp_path: Path) -> None:
    """Even batch 1 ran out of memory and no limit was set: nothing to fit, nothing to mark."""
    record = max_batch_record(max_batch_size=None, recommended_batch_size=None, memory_model=None, limit_gb=None)
    record["probes"] = [p for p in record["probes"] if p["status"] != "ok"]
    plot_max_batch(record, tmp_path / "max_batch.png")
    png = (tmp_path / "max_batch.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
