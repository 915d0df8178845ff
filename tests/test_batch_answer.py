"""What task=max_batch reads from its probes besides the boundary: the noise band, the room
each probe left, the fastest batch and the answer line. Probes as a search records them."""

from __future__ import annotations

import pytest

from fsdp_exp.tasks.max_batch.answer import (
    answer_line,
    fastest,
    fits_with_room,
    noise_band_gb,
    probe_to_place_fastest,
)
from fsdp_exp.tasks.max_batch.probe import Probe
from fsdp_exp.tasks.max_batch.record import MaxBatchRecord
from fsdp_exp.tasks.max_batch.report import summary_figures
from fsdp_exp.tasks.max_batch.settings import VERIFY_WINDOW
from fsdp_exp.tasks.max_batch.verify import step_down

LIMIT = 0.6
MB = 1 / 1024


def ok(size: int, peaks: list[float], samples_per_s: float = 100.0, held: list[float] | None = None) -> Probe:
    return Probe(size, "ok", peak_mem_gb=max(peaks) + 0.05, peak_under_limit_gb=max(peaks),
                 peak_under_limit_gb_per_rank=peaks, held_before_limit_gb_per_rank=held or [0.3369, 0.3369],
                 samples_per_s=samples_per_s)


def test_the_noise_band_is_the_widest_spread_the_probes_show():
    # The floor: two tenths of a percent of the limit, when the probes agree closely.
    assert noise_band_gb([ok(4, [0.47, 0.47])], LIMIT) == pytest.approx(0.002 * LIMIT)
    # Between the ranks of one probe.
    assert noise_band_gb([ok(4, [0.47, 0.47]), ok(64, [0.50, 0.5014])], LIMIT) == pytest.approx(0.0014)
    # Between two probes of one size.
    assert noise_band_gb([ok(64, [0.50, 0.50]), ok(64, [0.5015, 0.5015])], LIMIT) == pytest.approx(0.0015)
    # Between what ranks held when their limit was set.
    held = [ok(4, [0.47, 0.47], held=[0.3369, 0.3369]), ok(8, [0.48, 0.48], held=[0.3369, 0.3385])]
    assert noise_band_gb(held, LIMIT) == pytest.approx(0.0016)
    # A probe that ran out of memory has no peaks and adds nothing.
    assert noise_band_gb([ok(4, [0.47, 0.47]), Probe(9, "oom", reason="x")], LIMIT) == pytest.approx(0.0012)


def test_a_probe_that_fit_inside_the_noise_band_does_not_count_as_fitting():
    noise = 0.6 * MB
    assert fits_with_room(ok(652, [0.599, 0.5988]), LIMIT, noise)  # 1 MB to spare
    assert not fits_with_room(ok(656, [0.59977, 0.5997]), LIMIT, noise)  # 0.24 MB to spare
    assert not fits_with_room(Probe(660, "oom", reason="x"), LIMIT, noise)


def test_the_fastest_batch_and_the_smallest_within_five_percent_of_it():
    probes = [ok(4, [0.47] * 2, 150), ok(128, [0.5] * 2, 1600), ok(296, [0.53] * 2, 1700),
              ok(296, [0.53] * 2, 1800), ok(656, [0.6] * 2, 1720), ok(700, [0.61] * 2, 3000)]
    # 296 is the fastest on the mean of its two probes; 700 is past the answer and not counted.
    assert fastest(probes, up_to=656) == (296, 1750.0, 296)
    probes[1].samples_per_s = 1670  # within 5% of 1750
    assert fastest(probes, up_to=656) == (296, 1750.0, 128)
    assert fastest([Probe(1, "oom")], up_to=1) == (None, None, None)


def test_one_more_probe_places_a_fastest_batch_whose_neighbours_are_far():
    probes = [ok(4, [0.47] * 2, 150), ok(128, [0.5] * 2, 1700), ok(296, [0.53] * 2, 1600), ok(656, [0.6] * 2, 1500)]
    # The fastest, 128, is 32x from 4 and 2.3x from 296: halfway across the wider gap, in log scale.
    assert probe_to_place_fastest(probes, up_to=656, resolution=1) == 23
    assert probe_to_place_fastest(probes, up_to=656, resolution=4) == 24
    close = [ok(96, [0.5] * 2, 1500), ok(128, [0.5] * 2, 1700), ok(200, [0.52] * 2, 1600)]
    assert probe_to_place_fastest(close, up_to=656, resolution=1) is None


def record(**changes) -> MaxBatchRecord:
    return MaxBatchRecord(**{
        "max_batch_size": 652, "world_size": 2, "resolution": 4, "limit_gb": LIMIT, "search_up_to": 4096,
        "bounded_by": "oom", "noise_band_gb": 0.6 * MB, "noise_band_samples": 3.04, "peak_under_limit_gb": 0.5991,
        "recommended_batch_size": 352, "margin": 0.1, "fastest_batch_size": 624,
        "fastest_samples_per_s": 1536.6, "near_fastest_batch_size": 428, "smallest_batch_needs_gb": None,
        "probe_count": 7, "probe_wall_s": 91.0, "searched_max_batch_size": 652, "verify_wall_s": 40.0,
        "verification": {"steps": 50, "status": "completed", "ran_out_of_memory_at": [],
                         "runs": [{"batch_size": 652, "status": "ok", "reason": None}]}} | changes)


def test_the_answer_line_names_the_counted_peak_the_noise_band_and_the_fastest_batch():
    line = answer_line(record(), LIMIT)
    assert line == ("max batch: 652 per rank on 2 rank(s) (656 ran out of memory under memory.limit_gb=0.6); "
                    "verified: a 50-step run of the command at 652 completed; "
                    "peak 0.599 GB as the limit counts it, noise band 0.6 MB (3.0 samples); recommended 352 (10% margin); "
                    "fastest 624 (1,536.6 samples/s), within 5% of it from 428; 7 probes, 91 s of probing, "
                    "40 s verifying")
    assert "(656 fit with less than the 0.6 MB that runs of this setup vary by to spare under memory.limit_gb=0.6)" \
        in answer_line(record(bounded_by="noise"), LIMIT)
    measured = record(length_check={"batch_size": 4, "beyond_probe_gb": 1.5 * MB, "counted_gb": 1.5 * MB})
    assert ("noise band 0.6 MB (3.0 samples), a 50-step run holds 1.5 MB more than a probe (measured at batch 4, "
            "counted); recommended") in answer_line(measured, LIMIT)


def test_the_answer_line_says_how_long_a_run_until_its_peak_settled_held():
    def bounded(settled_at: int | None) -> MaxBatchRecord:
        return record(verification={"steps": 100, "until_settled": True, "status": "completed",
                                    "ran_out_of_memory_at": [], "runs": [
                                        {"batch_size": 652, "status": "ok", "steps": 60 if settled_at else 100,
                                         "settled_at_step": settled_at}]},
                      length_check={"batch_size": 4, "beyond_probe_gb": 1.5 * MB, "counted_gb": 1.5 * MB})
    line = answer_line(bounded(60), LIMIT)
    assert "; verified: a run of the command at 652 held for 60 steps, its peak settled (no new high over its last " \
           f"{VERIFY_WINDOW} steps); " in line
    assert ", a run of up to 100 steps holds 1.5 MB more than a probe (measured at batch 4, counted)" in line
    assert "; verified: a run of the command at 652 held for 100 steps, its peak still rising at the end " \
           "(task.verify_steps=<the run's steps> runs the whole length); " in answer_line(bounded(None), LIMIT)


def test_the_answer_line_when_none_fits():
    none = record(max_batch_size=0, resolution=1, smallest_batch_needs_gb=3.6512, fastest_batch_size=None)
    assert answer_line(none, 3.0) == ("max batch: none fits under memory.limit_gb=3: batch 1 needs 3.65 GB per rank; "
                                      "7 probes, 91 s of probing, 40 s verifying")


def test_none_fits_is_a_status_of_its_own_and_exit_code_3_unless_a_run_failed():
    from fsdp_exp.driver.outcomes import EXIT_NONE_FITS, EXIT_RUN_FAILED, exit_code
    from fsdp_exp.metrics.summary import Summary

    complete = {"searched_from": 1, "data_share_per_rank": 1024, "samples_per_s": None, "peak_mem_gb": None,
                "peak_mem_gb_per_rank": None, "run_beyond_probe_gb": None}
    none = summary_figures(record(**complete, max_batch_size=0, smallest_batch_needs_gb=3.65, fastest_batch_size=None))
    assert none.status == "none_fits" and summary_figures(record(**complete)).status is None
    found = Summary(status="ok").with_figures(none.figures())  # as the driver makes the summary of the task's figures
    assert found.status == "none_fits" and found.answered and not found.ok
    ok, failed = Summary(status="ok"), Summary(status="oom")
    assert (exit_code([ok]), exit_code([found]), exit_code([ok, found])) == (0, EXIT_NONE_FITS, EXIT_NONE_FITS) == (0, 3, 3)
    assert exit_code([found, failed]) == EXIT_RUN_FAILED == 1  # a failure says more than an answer


def test_an_answer_that_a_run_of_the_command_did_not_hold_says_where_it_stepped_down_from():
    stepped = record(max_batch_size=592, bounded_by="verification", verification={
        "steps": 50, "status": "stepped down", "ran_out_of_memory_at": [652, 620],
        "runs": [{"batch_size": 652, "status": "oom"}, {"batch_size": 620, "status": "oom"},
                 {"batch_size": 592, "status": "ok"}]})
    assert answer_line(stepped, LIMIT).startswith(
        "max batch: 592 per rank on 2 rank(s) (the probes found 652, but a 50-step run of the command ran out of "
        "memory at 652, 620 under memory.limit_gb=0.6); verified: a 50-step run of the command at 592 completed; ")
    none = record(max_batch_size=0, verification={"steps": 50, "status": "none completed",
                                                  "ran_out_of_memory_at": [652, 100, 4], "runs": []})
    assert answer_line(none, LIMIT).startswith("max batch: none verified under memory.limit_gb=0.6: the probes found "
                                               "652, but a 50-step run of the command ran out of memory at 652, 100, 4")
    unverified = answer_line(record(verification={"steps": 0, "status": "not run", "runs": []}), LIMIT)
    assert "; NOT VERIFIED (task.verify_steps=0): a run's memory can grow past a probe's first steps" in unverified
    assert "verifying" not in unverified
    failed = record(verification={"steps": 50, "status": "failed", "ran_out_of_memory_at": [],
                                  "runs": [{"batch_size": 652, "status": "failed", "reason": "disk full"}]})
    assert "; NOT VERIFIED: a 50-step run of the command at 652 failed, not for lack of memory (disk full); " in \
        answer_line(failed, LIMIT)


def test_each_step_down_is_twice_the_last_on_the_resolutions_grid_and_stops_at_the_smallest_size():
    assert step_down(652, 1, 4, 4) == 616  # 5% less: 619.4, on the grid of 4
    assert step_down(616, 2, 4, 4) == 552  # 10% less
    assert step_down(552, 3, 4, 4) == 440  # 20%
    assert step_down(5, 1, 1, 1) == 4  # at least one resolution down
    assert step_down(440, 5, 4, 4) == 88  # 80%: 88 exactly, not a grid step below it
    assert step_down(88, 6, 4, 4) is None  # 100%: below the smallest size the search read
    assert step_down(12, 1, 4, 12) is None


def test_a_probe_that_failed_otherwise_above_the_boundary_is_named_with_its_reason_not_memory():
    refused = {"batch_size": 656, "status": "failed",
               "reason": "rank 0 failed: ConfigError: train.batch_size=656: larger than this rank's share of the data "
                         "(652 samples); lower it or use more data"}
    line = answer_line(record(bounded_by="failed", probes=[refused]), LIMIT)
    assert line.startswith("max batch: 652 per rank on 2 rank(s) (656 did not train, not for lack of memory: "
                           "rank 0 failed: ConfigError: train.batch_size=656: larger than this rank's share")
    assert "failed under" not in line and "out of memory" not in line


def test_an_answer_bounded_by_the_data_says_so_and_how_much_memory_was_left():
    line = answer_line(record(max_batch_size=256, bounded_by="data", data_share_per_rank=256, limit_gb=1.5,
                              peak_under_limit_gb=0.7, verification={
                                  "steps": 50, "status": "completed", "ran_out_of_memory_at": [],
                                  "runs": [{"batch_size": 256, "status": "ok", "reason": None}]}), 1.5)
    assert line.startswith("max batch: 256 per rank on 2 rank(s), bounded by the data (256 samples a rank); "
                           "0.8 GB of 1.5 left; verified: a 50-step run of the command at 256 completed; "
                           "peak 0.700 GB as the limit counts it")
    assert "failed" not in line and "memory.limit_gb" not in line


def test_sizes_too_small_to_train_are_named_as_such_not_as_out_of_memory():
    small = [{"batch_size": 1, "reason": "rank 0 failed: ValueError: Expected more than 1 value per channel when "
                                         "training, got input size torch.Size([1, 8, 1, 1])"}]
    line = answer_line(record(too_small_to_train=small, searched_from=2), LIMIT)
    assert ("; batch 1 did not train, not for lack of memory (rank 0 failed: ValueError: Expected more than 1 value "
            "per channel when training, got input size torch.Size([1, 8, 1, 1])), so the search started at 2; "
            "7 probes") in line
    none = answer_line(record(max_batch_size=0, smallest_batch_needs_gb=0.7, too_small_to_train=small,
                              searched_from=2), LIMIT)
    assert none.startswith("max batch: none fits under memory.limit_gb=0.6: batch 2 needs 0.70 GB per rank; "
                           "batch 1 did not train, not for lack of memory")


def test_where_no_size_keeps_the_margin_free_the_line_says_so_instead_of_recommending_the_smallest():
    line = answer_line(record(recommended_batch_size=4, recommended_keeps_margin=False, searched_from=4), LIMIT)
    assert "; no size keeps 10% of the limit free (batch 4 already takes more), so none is recommended" in line
    assert "recommended 4" not in line
    assert "recommended 352 (10% margin)" in answer_line(record(recommended_keeps_margin=True), LIMIT)
    # and the summary (its table, wandb's run summary) recommends none either
    complete = {"searched_from": 4, "data_share_per_rank": 1024, "samples_per_s": 1500.0, "peak_mem_gb": 0.2,
                "peak_mem_gb_per_rank": [0.2, 0.2], "run_beyond_probe_gb": None}
    assert summary_figures(record(**complete, recommended_keeps_margin=False)).recommended_batch_size is None
    assert summary_figures(record(**complete, recommended_keeps_margin=True)).recommended_batch_size == 352


def test_allocator_retries_at_the_answer_are_said():
    line = answer_line(record(alloc_retries=3.0), LIMIT)
    assert "; at 652 the allocator freed its cache to allocate 3 time(s), which slows a step;" in line
    assert "allocator" not in answer_line(record(alloc_retries=0.0), LIMIT)
