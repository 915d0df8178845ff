"""task=tune: the space of setups, the budget, the bounds that spare searches, the table
and the chart (fast); real tunes on 2 gloo ranks (slow)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.config import as_dict
from fsdp_exp.driver.plan import prepare
from fsdp_exp.errors import ConfigError
from fsdp_exp.tasks.tune.ranking import (SPEED_NOISE, Row, between_runs, can_win, mean_of_runs, ranked, speed_bound,
                                         table, winner)
from fsdp_exp.tasks.tune.report import answer_line, command_line, plot, report, rows_of, summary_of, tune_record
from fsdp_exp.tasks.tune.settings import Budget, default_space, parse_budget
from fsdp_exp.tasks.tune.space import flatten, fold_on_cpu, setups
from fsdp_exp.run_context import RunContext
from fsdp_exp.tasks.tune.bounding import NEAR_LARGEST, NEAR_LIMIT
from fsdp_exp.tasks.max_batch.settings import VERIFY_WINDOW
from fsdp_exp.tasks.tune.confirm import step_spread
from tests.conftest import REPO, read_json, refused_here, run_cli

# --- the space ---


def names(space: dict, command: list[str] = (), world: int = 2, nodes: int = 1) -> list[str]:
    return [s.name for s in setups(space, list(command), world, nodes)]


def test_the_default_space_is_every_combination_of_the_options_that_keep_the_numerics():
    made = names(default_space())
    # full, grad_op, ddp (hybrid needs more than one node) x activation checkpointing x offload
    assert len(made) == 3 * 2 * 2 == len(set(made))
    assert "sharding=grad_op train.activation_checkpointing=true offload=false" in made
    assert names({"sharding": ["full"], "offload": [True]}) == ["sharding=full offload=true"]  # nothing varies
    assert not any("precision" in m or "compile" in m for m in made)  # they change the numerics: only when listed


def test_a_key_the_command_line_sets_is_not_tuned():
    made = names(default_space(), ["sharding=grad_op", "model=cnn"])
    assert len(made) == 4 and not any("sharding" in m for m in made)


def test_hybrid_is_each_shape_that_divides_the_world_across_nodes_and_left_out_on_one_node():
    space = {"sharding": ["full", "hybrid"]}
    assert names(space, world=8, nodes=2) == ["sharding=full", "sharding=hybrid sharding.replicate=2",
                                              "sharding=hybrid sharding.replicate=4"]
    assert names(space, world=8, nodes=1) == ["sharding=full"]
    with pytest.raises(ConfigError, match="task.space.sharding: no option left"):
        names({"sharding": ["hybrid"]}, world=2, nodes=1)


def test_nested_keys_and_listed_options_join_the_space():
    space = {"precision": ["fp32", "bf16"], "train": {"compile": [False, True]}, "offload": False}
    assert flatten(space) == {"precision": ["fp32", "bf16"], "train.compile": [False, True], "offload": [False]}
    last = setups(space, [], 2, 1)[-1]
    assert last.name == "precision=bf16 train.compile=true"  # what sets it apart
    assert last.overrides == ("precision=bf16", "train.compile=true", "offload=false")  # what it runs with
    with pytest.raises(ConfigError, match=r"task.space.precision=\[\]"):
        flatten({"precision": []})


def test_a_key_the_config_does_not_have_is_added_as_the_command_line_adds_one():
    config = {"model": {"_target_": "mypkg.Net", "width": 64}, "sharding": {"reshard_after_forward": True}}
    made = setups({"sharding": ["full"], "model": {"width": [64], "depth": [2]}}, [], 2, 1, config)
    assert [s.overrides for s in made] == [("sharding=full", "model.width=64", "+model.depth=2")]


# --- the budget ---


@pytest.mark.parametrize("text, budget", [(None, Budget()), (40, Budget(probes=40)), ("40 probes", Budget(probes=40)),
                                          ("30m", Budget(minutes=30)), ("1.5 min", Budget(minutes=1.5))])
def test_a_budget_in_probes_or_minutes(text, budget):
    assert parse_budget(text) == budget


@pytest.mark.parametrize("text", ["soon", "0", "2.5", "-3m", "30s"])
def test_a_budget_that_is_neither_is_refused_in_one_line(text):
    with pytest.raises(ConfigError, match=r"task.budget=.*a number of probes \(40\) or minutes \(30m\)"):
        parse_budget(text)
    with pytest.raises(ConfigError, match="task.budget=1: at least 2 probes: the last is kept for running the winner"):
        parse_budget(1)


def test_the_budget_keeps_room_for_the_winners_confirmation_from_the_start(tmp_path):
    """One probe, and the time of the winner's slowest probe with its steps scaled to the
    confirmation's most (100 steps, until its peak settles): the search stops when what is left
    would not hold it."""
    from fsdp_exp.tasks.max_batch.probe import Probe

    tune = tuner(tmp_path, "task.space.sharding=[full,grad_op]", "task.space.train.activation_checkpointing=[false]",
                 "task.space.offload=[false]", "task.budget=5m")
    tune.entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1,
                                                    as_dict(tune.exp))]
    assert tune.confirmation_needs() == (1, 0.0) and not tune.budget_spent()  # no winner yet: nothing to time
    full = tune.entries[0]
    full.search.probes += [Probe(100, "ok", samples_per_s=250.0, wall_s=20.0, startup_s=8.0),
                           Probe(100, "ok", samples_per_s=240.0, wall_s=26.0, startup_s=8.0)]
    tune.update(full)
    full.row.status = "measured"
    # the slower probe: 8 s to start, 18 s for 3 steps: 8 + 18 * 100 / 3 = 608 s, over the 5 minutes
    assert tune.confirmation_needs() == (1, pytest.approx(608.0))
    assert tune.budget_spent() and tune.stopped
    roomy = tuner(tmp_path, "task.space.sharding=[full]", "task.budget=11m")
    roomy.entries = [full]
    assert not roomy.budget_spent()
    counted = tuner(tmp_path, "task.space.sharding=[full]", "task.budget=3")
    counted.entries, counted.probes_run = [full], 2
    assert counted.budget_spent()  # the third probe is the confirmation's
    # side by side, a probe under way counts from its start: one done and one under way leave
    # the third of 3 to the confirmation
    parallel = tuner(tmp_path, "task.space.sharding=[full]", "task.budget=3")
    parallel.entries, parallel.probes_run = [full], 1
    assert not parallel.budget_spent()
    parallel.probes_under_way = 1
    assert parallel.budget_spent()


def test_the_budget_is_spent_by_probes_or_by_time():
    assert Budget(probes=3).spent(3, 0) and not Budget(probes=3).spent(2, 1e9)
    assert Budget(minutes=1).spent(0, 60) and not Budget(minutes=1).spent(100, 59)
    assert not Budget().spent(10**6, 1e9)


# --- task.global_batch ---


def test_a_global_batch_splits_into_micro_batches_under_the_largest_that_fits():
    from fsdp_exp.tasks.tune.accumulation import fastest_splits, speed_at, splits

    assert splits(64, 2, 100) == [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (1, 32)]
    assert splits(1024, 2, 218) == [(128, 4), (64, 8), (32, 16), (16, 32), (8, 64), (4, 128), (2, 256), (1, 512)]
    speeds = {32: 100.0, 128: 300.0, 200: 280.0}
    assert speed_at(speeds, 64) == pytest.approx(100.0 + 200.0 * 32 / 96) and speed_at(speeds, 8) == 100.0
    # the probes say 128 is the fastest, past it the speed falls: 128 x 4 before 64 x 8
    assert fastest_splits(1024, 2, 218, speeds)[:2] == [(128, 4), (64, 8)]
    assert fastest_splits(1024, 2, 218, {})[0] == (128, 4)  # without speeds: the largest micro-batch


def test_a_global_batch_the_ranks_do_not_divide_is_refused_in_one_line():
    from fsdp_exp.commands.experiment import compose_checked

    with pytest.raises(ConfigError, match=r"^task.global_batch=33: must be a multiple of the 2 ranks"):
        compose_checked(["task=tune", "model=cnn", "memory.limit_gb=0.6", "task.global_batch=33"])


# --- bounds, ranking, the table ---


def test_a_setup_measured_at_one_batch_is_bounded_by_linear_growth_to_its_largest():
    # A step at a larger batch takes at least as long: 100 samples/s at 200 is at most 150 at 300.
    assert speed_bound(100.0, 200, 300) == pytest.approx(150.0)
    assert speed_bound(100.0, 200, 150) == 100.0  # below its own batch: what it measured
    assert can_win(150.0, 150.0 / (1 - SPEED_NOISE)) and not can_win(149.0, 150.0 / (1 - SPEED_NOISE))
    assert can_win(1.0, None)  # nothing measured yet


def rows() -> list[Row]:
    return [
        Row("sharding=ddp", ["sharding=ddp"], "bounded", "below the best", 300, samples_per_s=250.0, peak_gb=0.58,
            bound_samples_per_s=270.0, probes=1),
        Row("sharding=full", ["sharding=full"], "measured", "fastest of 3 probes", 200, max_batch_size=212,
            samples_per_s=300.0, peak_gb=0.59, headroom_gb=0.01, probes=3),
        Row("sharding=grad_op", ["sharding=grad_op"], "measured", "fastest of 4 probes", 250, samples_per_s=290.0,
            peak_gb=0.57, headroom_gb=0.03, probes=4),
        Row("sharding=ddp offload=true", ["sharding=ddp", "offload=true"], "refused", "offload=true: sharding=ddp ..."),
    ]


def test_measured_setups_rank_by_speed_then_bounded_then_the_rest():
    order = ranked(rows())
    assert [r.setup for r in order] == ["sharding=full", "sharding=grad_op", "sharding=ddp",
                                        "sharding=ddp offload=true"]
    assert winner(rows()).setup == "sharding=full"


def test_the_record_names_the_winner_its_command_line_and_what_is_as_fast():
    record = tune_record(rows(), prefix=["model=cnn", "hydra.searchpath=[file://./conf]"], world_size=2,
                         limit_gb=0.6, budget="none", stopped=False, probes_run=8, probes_reused=0,
                         tokens_per_sample=0, wall_s=100.0)
    assert record["winner"] == "sharding=full" and record["batch_size"] == 200
    assert record["max_batch_size"] == 212  # the winner's: compare shows it beside the batch
    # what the user types: the search path quoted for the shell
    assert record["command"] == ("python -m fsdp_exp model=cnn 'hydra.searchpath=[file://./conf]' sharding=full "
                                 "train.batch_size=200")
    assert record["as_fast"] == ["sharding=grad_op"]  # 290 within 5% of 300
    assert record["settled"] == {"measured": 2, "bounded": 1, "refused": 1}
    assert [r["winner"] for r in record["rows"]] == [True, False, False, False]
    text = table([Row(**r) for r in record["rows"]], tokens=False)
    assert "| 1 (winner) | sharding=full | 200 | 300.0 |" in text
    assert "refused: offload=true: sharding=ddp" in text


def test_a_runs_step_spread_is_half_its_timed_steps_range_over_their_median(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    steps = [{"step": 1, "samples_per_s": 10.0, "warmup": True}, *({"step": i + 2, "samples_per_s": v}
                                                                    for i, v in enumerate([90.0, 100.0, 110.0, 104.0]))]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert step_spread(metrics) == pytest.approx(10 / 102)  # the warm-up step is not counted
    with metrics.open("a") as f:
        f.write('{"step": 6, "samples_')  # cut short
    assert step_spread(metrics) == pytest.approx(10 / 102)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in steps[:3]))
    assert step_spread(metrics) is None and step_spread(tmp_path / "none.jsonl") is None


def test_a_measured_setup_is_ranked_by_the_mean_of_its_runs_and_says_how_many():
    """Read at 300 and 270 samples/s: 285, its tokens/s, MFU and step time alike; a row read once
    keeps its speed; averaged again over more runs, its `how` names the count once."""
    row = Row("sharding=full", ["sharding=full"], status="measured", how="fastest of 3 probes", batch_size=8,
              samples_per_s=300.0, tokens_per_s=3000.0, mfu=0.3, step_s=0.5)
    mean_of_runs(row, [300.0])
    assert row.samples_per_s == 300.0 and row.how == "fastest of 3 probes"
    mean_of_runs(row, [300.0, 270.0])
    assert (row.samples_per_s, row.tokens_per_s, row.mfu) == pytest.approx((285.0, 2850.0, 0.285))
    assert row.step_s == pytest.approx(0.5 * 300 / 285)
    assert row.how == "fastest of 3 probes; samples/s the mean of 2 runs"
    mean_of_runs(row, [300.0, 270.0, 280.0, 290.0], ", in turns with the setups as fast")
    assert row.samples_per_s == pytest.approx(285.0) and row.tokens_per_s == pytest.approx(2850.0)
    assert row.how == "fastest of 3 probes; samples/s the mean of 4 runs, in turns with the setups as fast"


def test_the_winner_run_again_sets_the_noise_band():
    """300 samples/s in the search, 270 run again: a 10% band, in which grad_op's 290 ties."""
    record = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=9,
                         probes_reused=0, tokens_per_sample=0, wall_s=1.0,
                         confirmed={"status": "ok", "samples_per_s": 270.0, "peak_gb": 0.59, "reason": None})
    assert record["speed_noise"] == pytest.approx(0.1) and record["as_fast"] == ["sharding=grad_op"]
    # the answer's speed is the command line's, as it ran; the probes' beside it
    assert record["samples_per_s"] == 270.0 and record["probed_samples_per_s"] == 300.0
    assert "300 samples/s" not in answer_line(record)
    assert "270.0 samples/s as its command line ran (its probes: 300.0; noise band 10%)" in answer_line(record)
    quiet = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=9,
                        probes_reused=0, tokens_per_sample=0, wall_s=1.0,
                        confirmed={"status": "ok", "samples_per_s": 299.0, "peak_gb": 0.59, "reason": None})
    assert quiet["speed_noise"] == SPEED_NOISE  # never below it
    unsteady = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=9,
                           probes_reused=0, tokens_per_sample=0, wall_s=1.0,
                           confirmed={"status": "ok", "samples_per_s": 299.0, "peak_gb": 0.59, "reason": None,
                                      "step_spread": 0.2})
    assert unsteady["speed_noise"] == pytest.approx(0.2)  # its own steps strayed further than the table
    failed = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=9,
                         probes_reused=0, tokens_per_sample=0, wall_s=1.0,
                         confirmed={"status": "oom", "samples_per_s": None, "peak_gb": None, "reason": "out of memory"})
    assert "run again at batch 200 it did not train (oom: out of memory)" in answer_line(failed)
    assert (record["winner_confirmed"], failed["winner_confirmed"]) == (True, False)


def test_a_tune_where_no_setup_fits_ends_with_status_none_fits_and_compare_shows_it(tmp_path):
    from tests.test_compare import compare, make_run

    fit_none = [Row("sharding=ddp", ["sharding=ddp"], "does not fit", "batch 1 needs 0.69 GB under the limit"),
                Row("sharding=full", ["sharding=full"], "does not fit", "batch 1 needs 0.61 GB under the limit")]
    record = tune_record(fit_none, prefix=[], world_size=2, limit_gb=0.5, budget="none", stopped=False, probes_run=4,
                         probes_reused=0, tokens_per_sample=0, wall_s=1.0)
    figures = summary_of(record)
    assert figures.status == "none_fits" and figures.winner is None
    one_fits = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=9,
                           probes_reused=0, tokens_per_sample=0, wall_s=1.0)
    assert summary_of(one_fits).status is None  # one setup fits: ok, as the driver says
    make_run(tmp_path / "runs" / "0", {"status": "ok", **figures.figures()}, ["task=tune"])
    code, shown, md = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0 and shown[0]["status"] == "none_fits"
    assert shown[0]["note"] == "no setup trained under the limit" and "Failed runs" not in md


def test_the_answer_and_compare_give_the_winners_speed_as_its_command_line_ran(tmp_path):
    """The table ranks the setups by their probes, alike; the answer, the summary and compare
    give the winner at the speed its command line, run as printed, trained at."""
    from tests.test_compare import compare, make_run

    record = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=9,
                         probes_reused=0, tokens_per_sample=0, wall_s=1.0,
                         confirmed={"status": "ok", "samples_per_s": 182.0, "peak_gb": 0.59, "reason": None})
    make_run(tmp_path / "runs" / "0", {"status": "ok", **summary_of(record).figures()}, ["task=tune"])
    code, shown, _ = compare(tmp_path / "runs", out=tmp_path / "out")
    assert code == 0 and shown[0]["samples_per_s"] == "182.0"
    assert shown[0]["note"] == "winner sharding=full as its command line ran (its probes: 300.0)"


def test_a_speed_is_known_to_move_between_runs_by_the_widest_spread_of_one_setup_run_twice():
    assert between_runs({("full", 64, 1): [100.0]}) is None  # nothing ran twice: unknown, not 0
    assert between_runs({("full", 64, 1): [100.0, 110.0], ("ddp", 64, 1): [200.0, 204.0], ("ddp", 32, 1): [90.0]}) \
        == pytest.approx(10 / 105)
    # a setup measured at 226.1 and 92.3, identical on a CPU: no one-probe bound beats that band
    assert not can_win(150.0, 226.1, 0.05) and can_win(150.0, 226.1, between_runs({("x", 8, 1): [226.1, 92.3]}))


def test_on_a_cpu_offload_is_folded_into_offload_false_with_the_reason():
    space, notes = fold_on_cpu(default_space())
    assert space["offload"] == [False] and space["sharding"] == default_space()["sharding"]
    (note,) = notes
    assert note.startswith("offload=true folded into offload=false: on a CPU offload moves nothing")
    made = setups(space, [], 2, 1)
    assert len(made) == 3 * 2 and all("offload=false" in s.fixed for s in made)
    assert all("offload" not in s.name for s in made)
    # a space without both, or without offload, is left as it is
    assert fold_on_cpu({"offload": [True], "sharding": ["full"]}) == ({"offload": [True], "sharding": ["full"]}, [])
    assert fold_on_cpu({"sharding": ["full", "ddp"]})[1] == []


def test_a_winner_whose_command_line_was_never_run_is_called_unconfirmed_everywhere(tmp_path):
    """The budget ran out before the winner was run again: the answer line, tune.md's table and
    tune.json say so in words a reader cannot miss."""
    record = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="4m", stopped=True, probes_run=9,
                         probes_reused=0, tokens_per_sample=0, wall_s=240.0, confirmed=None)
    assert record["winner"] == "sharding=full" and record["winner_confirmed"] is False
    line = answer_line(record)
    assert "NOT CONFIRMED: its command line was never run (task.budget ran out first)" in line
    assert "NOT CONFIRMED" in table(rows_of(record), tokens=False, confirmed=False).split("sharding=full")[0]
    report_md = tmp_path / "tune.md"
    exp = prepare(compose_checked(["task=tune", "memory.limit_gb=0.6", "wandb.mode=disabled"]), 0).exp
    summary = report(exp, RunContext(), tmp_path, record)
    assert summary.winner_confirmed is False
    assert "| 1 (winner, NOT CONFIRMED) | sharding=full |" in report_md.read_text()
    none = tune_record([rows()[-1]], prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False,
                       probes_run=1, probes_reused=0, tokens_per_sample=0, wall_s=1.0)
    assert none["winner_confirmed"] is None and "NOT CONFIRMED" not in answer_line(none)


def test_a_command_line_that_ran_out_of_memory_steps_down_to_a_size_its_probes_put_a_speed_on(tmp_path):
    from fsdp_exp.tasks.max_batch.probe import Probe
    from fsdp_exp.tasks.tune.confirm import smaller

    tune = tuner(tmp_path, "task.space.sharding=[full]", "task.space.train.activation_checkpointing=[false]",
                 "task.space.offload=[false]", "task.resolution=4")
    (entry,) = tune.entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1,
                                                               as_dict(tune.exp))]
    entry.search.probes += [Probe(4, "ok", samples_per_s=100.0), Probe(100, "ok", samples_per_s=300.0),
                            Probe(200, "ok", samples_per_s=400.0)]
    entry.row.batch_size = 200
    # 5% down, on the grid of 4: 188, its speed straight between the probes at 100 and 200
    assert smaller(entry, 1, 4) == (188, pytest.approx(388.0))
    assert smaller(entry, 5, 4) == (40, pytest.approx(100.0 + 200.0 * 36 / 96))  # 80% down
    entry.row.batch_size = 4
    assert smaller(entry, 1, 4) is None  # below the smallest size the search read
    entry.row.batch_size, entry.row.grad_accum = 200, 2
    assert smaller(entry, 1, 4) is None  # task.global_batch fixes the step's batch: the next setup instead


def test_a_winner_with_accumulation_runs_its_micro_batch_as_printed():
    """The row's batch is the micro-batch; train.batch_size is a step's batch on each rank,
    which the trainer splits into train.grad_accum micro-batches (fsdp_exp.rank.build)."""
    row = Row("sharding=full", ["sharding=full"], "measured", batch_size=16, grad_accum=4)
    line = command_line(["memory.limit_gb=1"], row)
    assert line.endswith("sharding=full train.batch_size=64 train.grad_accum=4")
    train = prepare(compose_checked(line.split()[3:]), 0).exp.train
    assert train.batch_size // train.grad_accum == 16


def test_the_chart_stars_the_winner_and_draws_the_limit(tmp_path):
    record = tune_record(rows(), prefix=[], world_size=2, limit_gb=0.6, budget="none", stopped=False, probes_run=8,
                         probes_reused=0, tokens_per_sample=0, wall_s=1.0)
    texts = plot(record, tmp_path / "tune.png")
    assert (tmp_path / "tune.png").stat().st_size > 10_000
    assert any(t.startswith("1   300.0 samples/s at 0.59 GB") and "sharding=full @ 200" in t for t in texts)
    assert any("sharding=ddp @ 300 (one probe; bounded)" in t for t in texts)
    assert "fastest: 1" in texts and "memory.limit_gb=0.6" in texts
    assert not any("offload=true" in t for t in texts)  # refused: no point


# --- setups composed as their command lines (no rank starts) ---


def tuner(tmp_path: Path, *overrides: str, model: str = "cnn"):
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.driver.plan import prepare
    from fsdp_exp.run_context import RunContext
    from fsdp_exp.tasks.tune.tuner import Tuner

    command = ["task=tune", f"model={model}", "memory.limit_gb=0.6", "wandb.mode=disabled", *overrides]
    plan = prepare(compose_checked(command), 0)
    return Tuner(plan.exp, RunContext(environment={"overrides": command}), tmp_path, plan.launcher, plan.nproc)


def test_each_setup_is_composed_and_checked_as_its_command_line_and_a_refused_one_is_a_row(tmp_path):
    tune = tuner(tmp_path, "task.space.sharding=[full,ddp]", "task.space.train.activation_checkpointing=[false]",
                 "task.steps_per_probe=2", "task.resolution=2")
    entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1)]
    by_name = {e.setup.name: e for e in entries}
    refused = by_name["sharding=ddp offload=true"]
    assert refused.row.status == "refused" and refused.plan is None
    assert refused.row.how.startswith("offload=true: sharding=ddp keeps a full replica")
    offloaded = by_name["sharding=full offload=true"]
    exp = offloaded.plan.exp
    assert type(exp.sharding).__name__ == "FullyShard" and exp.offload and not exp.train.activation_checkpointing
    assert type(exp.task).__name__ == "MaxBatch" and exp.task.steps_per_probe == 2 and exp.task.resolution == 2
    assert exp.memory.limit_gb == 0.6 and exp.wandb.mode.value == "disabled"  # the command line's, no wandb run a setup
    assert offloaded.search.run_dir == tmp_path / "setups" / "sharding=full,offload=true"
    assert tune.command == ["model=cnn", "memory.limit_gb=0.6", "wandb.mode=disabled"]


def test_the_estimate_prunes_a_setup_whose_smallest_batch_is_over_the_limit(tmp_path):
    """The estimate's record as a setup's search keeps it (max_batch.json's "estimate"):
    batch 1 at 0.7 GB under a 0.6 GB limit is pruned without a probe; 0.55 GB is not, and
    its largest batch is where the curve crosses the limit."""
    tune = tuner(tmp_path, "task.space.sharding=[full,grad_op]", "task.space.train.activation_checkpointing=[false]",
                 "task.space.offload=[false]")
    over, under = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1)]
    over.search.estimated = {"peaks_gb": [[1, 0.7], [2, 0.72]]}
    under.search.estimated = {"peaks_gb": [[1, 0.55], [64, 0.55], [128, 0.65]]}
    tune.entries = [over, under]
    tune.estimate(over)
    tune.estimate(under)
    assert over.row.status == "pruned" and over.row.probes == 0
    assert over.row.how == "the estimate puts batch 1 at 0.700 GB, over the 0.6 GB limit"
    assert under.row.status == "not reached" and not under.done
    assert under.row.estimated_max_batch == 95  # 64 + (0.6 - 0.0006 - 0.55) / 0.1 * 64 (noise band 0.6 MB)
    assert json.loads((tmp_path / "tune.json").read_text())["settled"] == {"pruned": 1, "not reached": 1}


def test_a_tune_on_a_cpu_tries_offload_false_alone_and_says_why(tmp_path):
    tune = tuner(tmp_path, "task.space.sharding=[full,grad_op]")
    space = tune.space_to_try()
    assert space["offload"] == [False] and space["sharding"] == ["full", "grad_op"]
    assert len(tune.folded) == 1 and tune.folded[0].startswith("offload=true folded into offload=false")
    assert tune.save()["folded"] == tune.folded


def test_the_setups_estimates_are_traced_side_by_side_each_into_its_own_record(tmp_path, caplog):
    """Two real traces at once on the 2 cores: both start before either ends, and each
    setup's record holds its own curve (a 2-layer ViT's MLPs 256 times wider hold about
    0.2 GB more at batch 1)."""
    tune = tuner(tmp_path, "model.num_layers=2", "+task.space.model.mlp_dim=[128,32768]",
                 "task.space.sharding=[full]", "task.space.train.activation_checkpointing=[false]", "task.space.offload=[false]",
                 "task.search_up_to=16", "memory.limit_gb=2", model="vit")
    tune.entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1, as_dict(tune.exp))]
    with caplog.at_level("INFO", logger="fsdp_exp"):
        tune.estimate_all(tune.entries)
    lines = [r.getMessage() for r in caplog.records]
    first_done = next(i for i, line in enumerate(lines) if "estimate: batch 1" in line)
    assert sum(": started in " in line for line in lines[:first_done]) == 2
    small, large = (read_json(tmp_path / e.row.dir / "max_batch.json")["estimate"]["peaks_gb"] for e in tune.entries)
    assert [b for b, _ in small] == [b for b, _ in large] == [1, 2, 4, 8, 16]
    assert 0.15 < large[0][1] - small[0][1] < 0.3
    assert all(e.row.estimated_max_batch and e.row.status == "not reached" for e in tune.entries)


def test_a_budget_spent_before_a_search_ends_answers_with_the_best_probe_so_far(tmp_path):
    """A setup with a probe that trained when the budget ran out is measured as far as it
    went, and can win; one without is not reached."""
    from fsdp_exp.tasks.max_batch.probe import Probe

    tune = tuner(tmp_path, "task.space.sharding=[full,grad_op]", "task.space.train.activation_checkpointing=[false]",
                 "task.space.offload=[false]", "task.budget=2")
    probed, unprobed = tune.entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command,
                                                                        tune.nproc, 1, as_dict(tune.exp))]
    probed.search.probes.append(Probe(100, "ok", samples_per_s=250.0, peak_under_limit_gb=0.55))
    tune.stopped = True
    tune.finish()
    record = read_json(tmp_path / "tune.json")
    rows = {r["setup"]: r for r in record["rows"]}
    assert rows["sharding=full"]["status"] == "measured" and rows["sharding=full"]["batch_size"] == 100
    assert rows["sharding=full"]["how"] == ("fastest of 1 probe(s) so far; the budget (task.budget=2 probes) "
                                            "ran out first, before its search ended")
    assert record["winner"] == "sharding=full"
    assert rows["sharding=grad_op"]["status"] == "not reached"


def test_with_its_estimate_a_setup_is_measured_by_a_probe_near_its_largest_batch_without_a_search(tmp_path):
    """The first probe that trained within NEAR_LIMIT of the limit measures its setup: no
    further probe runs (its boundary is not searched), and the row says how near the limit
    it came. A probe that left more free does not, nor one far below the largest batch the
    setup could reach; nor, with task.search_boundary=true, any."""
    from fsdp_exp.tasks.max_batch.probe import Probe

    curve = {"peaks_gb": [[1, 0.3], [64, 0.35], [256, 0.55], [512, 0.8]]}
    args = ("task.space.sharding=[full]", "task.space.train.activation_checkpointing=[false]", "task.space.offload=[false]")
    tune = tuner(tmp_path, *args)
    (entry,) = tune.entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1,
                                                                as_dict(tune.exp))]
    entry.search.estimated = curve
    assert tune.at_estimate(entry)
    first = entry.search.next_size()  # where its first probe goes: the estimate leaves 5% of the limit free
    assert tune.reach(entry) == (first, "where its estimate leaves 5% of the limit free")
    # within NEAR_LIMIT of the limit, but where what every batch holds fills it nearly alone: the
    # curve moved through it still has room for batches far larger
    entry.search.probes.append(Probe(1, "ok", samples_per_s=5.0, peak_under_limit_gb=0.57))
    assert tune.near_largest(entry) is None and tune.largest(entry) > 2 / NEAR_LARGEST
    entry.search.probes.clear()
    far = Probe(100, "ok", samples_per_s=250.0, peak_under_limit_gb=0.6 * (1 - NEAR_LIMIT) - 0.01)
    entry.search.probes.append(far)
    assert tune.near_largest(entry) is None
    near = Probe(first, "ok", samples_per_s=240.0, peak_under_limit_gb=0.57)
    entry.search.probes.append(near)
    assert tune.near_largest(entry) is near
    tune.search_those_that_can_win()  # concludes it: a probe more would start ranks
    row = read_json(tmp_path / "tune.json")["rows"][0]
    assert (row["status"], row["batch_size"], row["samples_per_s"]) == ("measured", 100, 250.0)  # its fastest
    assert f"the largest at batch {first} with 0.570 GB, 5.0% of the limit free" in row["how"]
    assert len(entry.search.probes) == 2

    searched = tuner(tmp_path / "searched", *args, "task.search_boundary=true")
    (other,) = [searched.prepare(s) for s in setups(searched.settings.space, searched.command, searched.nproc, 1,
                                                    as_dict(searched.exp))]
    other.search.estimated = curve
    other.search.probes.append(near)
    assert not searched.at_estimate(other) and searched.near_largest(other) is None  # its search goes on



def test_the_speed_models_first_setup_runs_again_at_half_its_batch_and_both_calibrate(tmp_path):
    """The first calibrating setup's second size is half the batch its probe trained at
    (real ranks, beside its search, in `half/`), not its search's next probe a sample away:
    the model's two runs of it are that far apart, and so is the range it was fitted in. A
    tune run again reuses the run; a setup that trained at its smallest batch goes on with
    its search instead."""
    from fsdp_exp.tasks.max_batch.probe import Probe

    args = ("task.space.sharding=[full,ddp]", "task.space.train.activation_checkpointing=[false]",
            "task.space.offload=[false]", "task.steps_per_probe=2", "task.resolution=4")
    tune = tuner(tmp_path, *args)
    first, _ = tune.entries = [tune.prepare(s) for s in setups(tune.settings.space, tune.command, tune.nproc, 1,
                                                               as_dict(tune.exp))]
    work = {"batch_size": 8, "flops": 8e9, "wire_bytes": 1e7, "offload_bytes": 0.0, "optimizer_params": 1e6,
            "world_size": 2}
    first.search.estimated = {"step_work": work}
    first.search.probes.append(Probe(70, "ok", samples_per_s=500.0, peak_under_limit_gb=0.55))
    tune.second_size(first)
    (ran,) = (tmp_path / first.row.dir / "half").iterdir()
    assert ran.name == "b32x1" and read_json(ran / "summary.json")["status"] == "ok"  # 70 // 2, to task.resolution
    assert len(first.search.probes) == 1 and first.extra_probes == 1 and tune.probes_run == 1
    assert sorted(m.batch_size for m in tune.measured_runs()) == [32, 70]
    assert tune.speed_model()["batches"] == [32, 70]

    again = tuner(tmp_path, *args)
    entry, _ = again.entries = [again.prepare(s) for s in setups(again.settings.space, again.command, again.nproc, 1,
                                                                 as_dict(again.exp))]
    entry.search.estimated = {"step_work": work}
    entry.search.probes.append(Probe(70, "ok", samples_per_s=500.0, peak_under_limit_gb=0.55))
    again.second_size(entry)
    assert again.probes_run == 0 and entry.readings == first.readings

    (tmp_path / "smallest").mkdir()
    smallest = tuner(tmp_path / "smallest", *args)
    entry, _ = smallest.entries = [smallest.prepare(s) for s in setups(smallest.settings.space, smallest.command,
                                                                       smallest.nproc, 1, as_dict(smallest.exp))]
    entry.search.probes.append(Probe(4, "ok", samples_per_s=50.0, peak_under_limit_gb=0.55))
    searched = []
    entry.search.step = lambda: searched.append(1) or True  # its search's next probe, not run here
    smallest.second_size(entry)
    assert searched == [1] and not (tmp_path / "smallest" / entry.row.dir / "half").exists()

@pytest.mark.parametrize("args, message", [
    ([], "memory.limit_gb: task=tune on CPU needs a per-rank limit"),
    (["memory.limit_gb=1", "resume=auto"], "resume=auto: task=tune starts every probe fresh"),
])
def test_what_no_search_can_do_is_one_line_naming_the_tune_before_any_probe(tmp_path, args, message):
    result = refused_here("task=tune", "device=cpu", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert message in result.stderr
    assert not (tmp_path / "outputs").exists()


# --- real tunes on 2 gloo ranks ---

# How far one fresh run of the same command moves from another on the 2-core CPU machine, whose
# runs can be steady within (a step spread of 5%) but not between: this CNN at batch 315 ran
# at 486 to 610 samples/s over 16 fresh runs of 10 to 12 steps. No band a tune measures
# from one run again can hold a further run on such a machine closer than this.
BETWEEN_RUNS = 0.25

SMALL_TUNE = ["task=tune", "model=cnn", "memory.limit_gb=0.6", "wandb.mode=disabled", "task.steps_per_probe=2",
              "task.space.train.activation_checkpointing=[false]", "task.space.offload=[false]"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_tune_finds_the_fastest_setup_and_its_command_line_trains_under_the_limit(tmp_path):
    out = tmp_path / "tune"
    result = run_cli(*SMALL_TUNE, "task.space.sharding=[full,ddp]", "wandb.mode=offline", f"hydra.run.dir={out}",
                     cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "tune.json")
    rows = {r["setup"]: r for r in record["rows"]}
    assert set(rows) == {"sharding=full", "sharding=ddp"} and record["winner"] in rows
    best = rows[record["winner"]]
    assert best["status"] == "measured" and best["winner"] and best["headroom_gb"] >= 0
    # each setup is measured near the largest batch its estimate puts under the limit, its boundary
    # not searched: a probe within NEAR_LIMIT of the limit (the estimate's first, most often; the
    # calibrating setups, a second size), recorded where its row says
    for row in rows.values():
        searched = read_json(out / row["dir"] / "max_batch.json")
        trained = {p["batch_size"]: p for p in searched["probes"] if p["status"] == "ok"}
        assert len(searched["probes"]) <= 3 and searched["max_batch_size"] is None, searched["probes"]
        if row["status"] == "measured":
            assert max(p["peak_under_limit_gb"] for p in trained.values()) >= 0.6 * (1 - NEAR_LIMIT)
            assert "near the largest batch (task.search_boundary=true searches for it)" in row["how"]
    # the winner's batch is its fastest probe's or, where its command line ran out of memory
    # within the run's steps there, the size it stepped down to
    trained = {p["batch_size"]: p for p in read_json(out / best["dir"] / "max_batch.json")["probes"]
               if p["status"] == "ok"}
    if "stepped down to" in best["how"]:
        assert best["batch_size"] < max(trained)
        assert best["how"].endswith(f"stepped down to {best['batch_size']}")
        assert best["samples_per_s"] == pytest.approx(record["confirmed"]["samples_per_s"])  # the run's own
    else:
        assert best["batch_size"] in trained
        if "samples/s the mean of" not in best["how"]:  # else run again in turns with a near-tie: their mean
            assert best["samples_per_s"] == pytest.approx(max(p["samples_per_s"] for p in trained.values()))
    other = next(r for r in rows.values() if not r["winner"])
    assert other["status"] in ("measured", "bounded"), other
    if other["status"] == "bounded":  # spared its search: one probe (and it again, for the noise), a bound under the best
        assert other["probes"] <= 2 and other["bound_samples_per_s"] < best["samples_per_s"] * (1 - 0.05) + 1e-9
    assert record["probes"] == sum(r["probes"] for r in rows.values())
    assert (out / "tune.png").stat().st_size > 10_000 and "| 1 (winner) |" in (out / "tune.md").read_text()
    assert "run it: python -m fsdp_exp model=cnn" in result.stdout + result.stderr
    # the line to copy is the command and nothing else (a "-> tune.json" after it, pasted into a
    # shell, would write over the record)
    (run_it,) = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("  run it: ")]
    assert run_it == f"  run it: {record['command']}"
    # the two setups' estimates were traced side by side: each line names its setup
    assert all(f"{name}: estimate: batch 1 " in result.stdout + result.stderr for name in rows)
    # one wandb run for the tune, with the rows as a table; the setups' searches log none of their own,
    # while on CPU each probe logs offline as the run would (rank 0 holds it under the limit)
    (table,) = (out / "wandb").glob("offline-run-*/files/media/table/setups_*.table.json")
    assert record["winner"] in table.read_text() and not list((out / "setups").glob("*/wandb"))
    assert list((out / "setups").glob("*/probes/*/wandb/offline-run-*"))
    # The answer holds: its command line, as printed, trains under the limit.
    words = [w for w in record["command"].split()[3:] if w != "wandb.mode=offline"] + ["wandb.mode=disabled"]
    run = run_cli(*words, "train.steps=12", "train.log_every=4", f"hydra.run.dir={tmp_path / 'winner'}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = read_json(tmp_path / "winner" / "summary.json")
    assert summary["status"] == "ok" and summary["peak_under_limit_gb"] <= 0.6
    # ... run by the tune itself as printed, until its peak settled, in fresh ranks: the noise band it reports
    assert record["confirmed"]["status"] == "ok" and record["speed_noise"] >= 0.05
    assert 3 + VERIFY_WINDOW <= record["confirmed"]["steps"] <= 100 and best["confirmed"] is True
    assert 0 < record["confirmed"]["step_spread"] <= record["speed_noise"]  # a record each of its steps
    assert abs(record["confirmed"]["samples_per_s"] / best["samples_per_s"] - 1) <= record["speed_noise"] + 1e-9
    # the command's own speed is the one the answer gives for it (its command line run again, as
    # it runs: its own data, 10 steps, where the table's come from short probes that rank the
    # setups alike) within that band, and the slack of one more fresh run on this machine
    ratio = summary["samples_per_s"] / record["confirmed"]["samples_per_s"]
    assert abs(ratio - 1) <= record["speed_noise"] + BETWEEN_RUNS, (ratio, record["speed_noise"], best["samples_per_s"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_budget_stops_the_tune_and_a_second_run_goes_on_from_its_probes(tmp_path):
    out = tmp_path / "tune"
    first = run_cli(*SMALL_TUNE, "task.space.sharding=[full,grad_op]", "task.budget=2", f"hydra.run.dir={out}",
                    cwd=tmp_path, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = read_json(out / "tune.json")
    # one probe of the search, and the one the budget kept for running the winner's command line
    assert stopped["stopped_by_budget"] and stopped["probes"] == 2
    assert "the budget (task.budget=2 probes) is spent" in first.stdout + first.stderr
    assert any(r["how"] == "the budget (task.budget=2 probes) ran out first" for r in stopped["rows"])
    probed = [r for r in stopped["rows"] if r["probes"]]
    assert len(probed) == 1 and probed[0]["samples_per_s"] > 0 and probed[0]["probes"] == 2
    assert (out / probed[0]["dir"] / "confirm").is_dir()  # its command line, run for the run's 50 steps
    again = run_cli(*SMALL_TUNE, "task.space.sharding=[full,grad_op]", f"hydra.run.dir={out}", cwd=tmp_path,
                    timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    done = read_json(out / "tune.json")
    assert not done["stopped_by_budget"] and done["winner"] and done["probes_reused"] >= 1
    assert "reusing 1 probe(s) recorded" in again.stdout + again.stderr
    assert {r["status"] for r in done["rows"]} <= {"measured", "bounded"}


BROKEN = """
import torch
from torch import nn


class Net(nn.Module):
    \"\"\"Fails on the ranks when broken: an error of the model's own, not of memory.\"\"\"

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.broken = broken
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images):
        if self.broken and torch.distributed.is_initialized() and torch.is_grad_enabled():
            raise RuntimeError("the model's own error in this setup")
        return self.body(images)
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_setup_that_fails_otherwise_is_a_row_with_its_reason_and_the_tune_goes_on(tmp_path):
    package = tmp_path / "brokenpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(BROKEN)
    out = tmp_path / "tune"
    result = run_cli("task=tune", "model=custom", "model._target_=brokenpkg.model.Net", "model.blocks=[torch.nn.Linear]",
                     "memory.limit_gb=0.6", "wandb.mode=disabled", "task.steps_per_probe=2", "task.space.sharding=[full]",
                     "task.space.train.activation_checkpointing=[false]", "task.space.offload=[false]",
                     "+task.space.model.broken=[true,false]", f"hydra.run.dir={out}",
                     cwd=tmp_path, timeout=900, extra_env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["setup"]: r for r in read_json(out / "tune.json")["rows"]}
    broken = rows["+model.broken=true"]
    assert broken["status"] == "failed" and "the model's own error in this setup" in broken["how"], broken
    assert "\n" not in broken["how"]
    # its estimate's trace met the same error: said, and its search went on from the probes alone
    assert "could not trace this setup: RuntimeError: the model's own error" in result.stdout + result.stderr
    assert rows["+model.broken=false"]["status"] == "measured"
    assert rows["+model.broken=false"]["winner"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_with_a_global_batch_each_setup_reaches_it_by_accumulation_and_is_ranked_by_step_time(tmp_path):
    """1024 samples a step on 2 ranks is 512 a rank, past the CNN's largest batch under 0.6 GB
    (about 218): each setup reaches it with a micro-batch that fits and train.grad_accum."""
    out = tmp_path / "tune"
    result = run_cli(*SMALL_TUNE, "task.space.sharding=[full,ddp]", "task.global_batch=1024", f"hydra.run.dir={out}",
                     cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "tune.json")
    measured = [r for r in record["rows"] if r["status"] == "measured"]
    assert measured and record["winner"] == measured[0]["setup"]
    for row in measured:
        assert row["batch_size"] * row["grad_accum"] * 2 == 1024 and row["grad_accum"] > 1, row
        assert row["batch_size"] <= row["max_batch_size"]
        assert row["step_s"] == pytest.approx(1024 / row["samples_per_s"])
        assert (out / row["dir"] / "extra_probes.json").is_file()
    best = measured[0]
    # train.batch_size is a step's batch on each rank: grad_accum micro-batches of the row's batch
    assert record["command"].endswith(f"train.batch_size={best['batch_size'] * best['grad_accum']} "
                                      f"train.grad_accum={best['grad_accum']}")
    assert "| step s |" in (out / "tune.md").read_text()
    assert f"at batch {best['batch_size']} x {best['grad_accum']} (train.grad_accum) per rank, " \
           f"{best['step_s']:.3f} s a step" in result.stdout + result.stderr


def first_probe_span(setup_dir: Path) -> tuple[float, float]:
    """From the start of the rank of the setup's first probe that trained to its last step."""
    probe = next(p for p in sorted((setup_dir / "probes").glob("*_b*")) if read_json(p / "summary.json")["status"] == "ok")
    started = read_json(probe / "summary.json")["startup"]["rank_started"]
    return started, json.loads((probe / "metrics.jsonl").read_text().splitlines()[-1])["time"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("launcher", [["launcher=slurm", "launcher.cluster=local", "launcher.nproc_per_node=1"],
                                      ["launcher=ray", "launcher.num_workers=1", "task.budget=5"]], ids=["slurm", "ray"])
def test_on_a_cluster_launcher_setups_run_side_by_side(tmp_path, launcher):
    """launcher.max_parallel setups in flight at once: real jobs of submitit's local executor
    (the whole tune), and a local Ray (its first probes: a Ray Train run starts in tens of
    seconds); each probe in fresh ranks as ever."""
    out = tmp_path / "tune"
    result = run_cli(*SMALL_TUNE, *launcher, "launcher.max_parallel=2", "task.space.sharding=[full,grad_op]",
                     f"hydra.run.dir={out}", cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "tune.json")
    assert record["world_size"] == 1
    assert record["winner"], record["settled"]
    if "task.budget=5" in launcher:  # the budget holds it to 5 probes, the winner's run among them
        assert record["probes"] <= 5
    dirs = [out / r["dir"] for r in record["rows"]]
    (start_a, end_a), (start_b, end_b) = (first_probe_span(d) for d in dirs)
    assert max(start_a, start_b) < min(end_a, end_b), "the two setups' first probes that trained ran at the same time"
    # each setup's lines carry its name, and its driver lines are in its own folder's log
    assert "sharding=grad_op: started in" in result.stdout
    assert "sharding=full: " in (dirs[0] / "fsdp_exp.log").read_text() + (dirs[1] / "fsdp_exp.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_winner_whose_command_line_does_not_complete_hands_over_to_the_next_which_is_run_as_printed(tmp_path):
    """The faster setup keeps 18 MB a step: its 5-step probes fit, its 10-step command line
    runs out of memory at any batch. Its batch steps down, run after run, while its speed
    falls; the steady setup, spared after one probe by a bound under the first winner's speed,
    is searched once that bound can win, wins, and its command line completes as printed."""
    from tests.test_batch_verify import VARIANTS

    out = tmp_path / "tune"
    result = run_cli(*VARIANTS, "+task.space.model.variant=[fast_growing,steady]", f"hydra.run.dir={out}",
                     cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "tune.json")
    rows = {r["setup"]: r for r in record["rows"]}
    fast, slow = rows["+model.variant=fast_growing"], rows["+model.variant=steady"]
    assert fast["status"] == slow["status"] == "measured" and fast["confirmed"] is not True and not fast["winner"]
    # its command line first ran at its fastest batch (the largest or, as speeds go on a CPU, another)
    fastest = read_json(out / fast["dir"] / "max_batch.json")["fastest_batch_size"]
    assert f"its command line at batch {fastest} did not complete 10 steps (oom: " in fast["how"]
    assert "; stepped down to " in fast["how"] and fast["batch_size"] < fast["max_batch_size"]
    assert slow["confirmed"] is True and slow["winner"] and record["winner"] == "+model.variant=steady"
    assert record["confirmed"]["status"] == "ok" and record["confirmed"]["steps"] == 10 and record["winner_confirmed"]
    output = result.stdout + result.stderr
    assert "the winner's command line ran out of memory at batch " in output and "NOT CONFIRMED" not in output
    assert "+model.variant=steady: its bound can beat the best now; searching it" in output
    # the line it printed is the one it ran: 10 steps of it, in the winner's confirm/ folder
    (confirm,) = (out / slow["dir"] / "confirm").iterdir()
    ran = read_json(confirm / "summary.json")
    assert (ran["steps"], ran["global_batch_size"]) == (10, 2 * slow["batch_size"])
    assert f"train.batch_size={slow['batch_size']}" in record["command"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_setups_within_the_noise_of_the_winner_are_run_again_in_turns_before_one_is_called_the_winner(tmp_path):
    from tests.test_batch_verify import VARIANTS

    out = tmp_path / "tune"
    result = run_cli(*VARIANTS, "+task.space.model.variant=[steady,steady_too]", f"hydra.run.dir={out}",
                     cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "tune.json")
    rows = [r for r in record["rows"] if r["status"] == "measured"]
    assert len(rows) == 2 and "running each again, in turns" in result.stdout + result.stderr
    started = {}
    for row in rows:
        # its speed: the mean of its runs at its batch, its search's and those beside it (where
        # no setup had run twice at one batch, the pair's first round measured the noise band)
        searched = read_json(out / row["dir"] / "max_batch.json")["probes"]
        beside = read_json(out / row["dir"] / "extra_probes.json")
        runs = [p["samples_per_s"] for p in searched if p["status"] == "ok" and p["batch_size"] == row["batch_size"]] \
            + [r["probe"]["samples_per_s"] for r in beside if r["kind"] != "confirm" and r["probe"]["status"] == "ok"
               and r["batch_size"] == row["batch_size"]]
        assert len(runs) >= 3 and row["samples_per_s"] == pytest.approx(statistics.mean(runs))
        assert f"samples/s the mean of {len(runs)} runs, in turns with the setups as fast" in row["how"], row["how"]
        assert not (out / row["dir"] / "repeat").exists()  # no run beside the two rounds
        # each run in turns as long as the setup's probe at its batch (a probe trains on until its peak settles)
        probed = next(p["steps"] for p in searched if p["status"] == "ok" and p["batch_size"] == row["batch_size"])
        for n in (1, 2):
            (done,) = (out / row["dir"] / f"rematch{n}").iterdir()
            summary = read_json(done / "summary.json")
            started[(row["setup"], n)] = summary["startup"]["rank_started"]
            assert summary["steps"] == probed, (summary["steps"], probed)
    first, second = (r["setup"] for r in rows)
    # the first round in one order, the second in the other
    order = sorted(started, key=started.__getitem__)
    assert order in ([(first, 1), (second, 1), (second, 2), (first, 2)],
                     [(second, 1), (first, 1), (first, 2), (second, 2)]), order


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_speed_model_calibrates_on_a_few_setups_and_leaves_out_one_that_cannot_win(tmp_path):
    """Real probes on 2 gloo ranks: a ViT of 2 layers and one of 8 (four times the FLOPs of
    its blocks), each sharded two ways. The model is fitted to the first probes, measures its
    own error on the setups it did not see, and leaves out the 8-layer setup it has not
    probed: its predicted speed, widened by that error, is below the best measured."""
    out = tmp_path / "tune"
    result = run_cli("task=tune", "memory.limit_gb=0.5", "wandb.mode=disabled", "task.steps_per_probe=2",
                     "task.space.sharding=[full,ddp]", "task.space.train.activation_checkpointing=[false]",
                     "task.space.offload=[false]", "+task.space.model.num_layers=[2,8]", f"hydra.run.dir={out}",
                     cwd=tmp_path, timeout=1100)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "tune.json")
    rows = {r["setup"]: r for r in record["rows"]}
    model = record["speed_model"]
    assert model["runs"] >= 3 and model["setups"] >= 2 and model["tflops"] > 0 and model["error"] is not None
    left_out = [r for r in rows.values() if r["status"] == "predicted"]
    assert left_out, [(r["setup"], r["status"]) for r in rows.values()]
    best = max(r["samples_per_s"] for r in rows.values() if r["status"] == "measured")
    for row in left_out:
        assert "model.num_layers=8" in row["setup"] and row["probes"] == 0
        assert not (out / row["dir"] / "probes").exists()
        assert 0 < row["predicted_samples_per_s"] < row["bound_samples_per_s"] < best
        assert row["bound_samples_per_s"] >= row["predicted_samples_per_s"] * (1 + SPEED_NOISE)
        assert "not probed" in row["how"] and "the speed model puts it at" in row["how"]
    # the calibration: the 2-layer setups, the most promising, each sending other bytes
    assert all(r["status"] == "measured" for r in rows.values() if "model.num_layers=2" in r["setup"])
    # every measured setup has the model's speed beside its own, fitted to the other setups alone
    for row in rows.values():
        if row["status"] == "measured":
            assert row["predicted_samples_per_s"] > 0
    assert "model.num_layers=2" in record["winner"]
    assert "speed model, fitted to" in (out / "tune.md").read_text()
