"""task=max_batch verifies its answer: the size the probes found is run as the command runs
it, for task.verify_steps steps, and steps down when that run runs out of memory. On 2 real
gloo ranks, with a model whose memory keeps growing after a probe's steps."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_exp.tasks.max_batch.settings import VERIFY_WINDOW

from tests.conftest import REPO, read_json, run_cli

KEPT_PER_SAMPLE = 4096  # floats kept per sample of every training forward: 16 KB


class GrowingNet(nn.Module):
    """A model that keeps a history it never frees (as a metric that appends every batch's
    outputs does): its memory grows with every step, past any short probe's."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
        self.kept: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.kept.append(torch.ones(images.shape[0], KEPT_PER_SAMPLE))
        return self.body(images)


GROW_FOR = 30  # training forwards that SettlingNet keeps a history for


class SettlingNet(nn.Module):
    """A model whose memory grows for its first GROW_FOR training steps, then holds (as a
    cache filled on the first batches does): past a short probe's steps, settled well within
    a bounded verification's."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
        self.kept: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and len(self.kept) < GROW_FOR:
            self.kept.append(torch.ones(images.shape[0], KEPT_PER_SAMPLE))
        return self.body(images)


GROWING = ["model=custom", f"model._target_={__name__}.GrowingNet", "model.blocks=[torch.nn.Linear]",
           "sharding=full", "wandb.mode=disabled", "memory.limit_gb=0.6"]


@pytest.mark.slow
def test_an_answer_that_a_run_of_the_command_does_not_hold_steps_down_to_one_that_does(tmp_path: Path) -> None:
    """Probes stop at 5 steps (task.settle_steps): the peak of this model never settles. A
    10-step run holds twice their history, so the size they found runs out of memory, and the
    runs step down, 5% then twice as far each time, to a size whose run completes; what that
    run held beyond a probe is counted, and the answer is at most its size."""
    out = tmp_path / "search"
    result = run_cli("task=max_batch", *GROWING, "task.estimate=false", "task.resolution=64", "task.settle_steps=5",
                     "task.verify_steps=10", "checkpoint=dcp", f"hydra.run.dir={out}", cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "max_batch.json")
    check = record["verification"]
    # the probes trained past task.steps_per_probe, up to task.settle_steps: their peak kept growing
    assert {p["steps"] for p in record["probes"] if p["status"] == "ok"} == {5}
    # each saved a checkpoint after task.steps_per_probe steps, as the run saves (checkpoint=dcp), then trained
    # on; what they saved is no one's, and is gone
    for probe in [p for p in record["probes"] if p["status"] == "ok"]:
        assert read_json(out / probe["dir"] / "summary.json")["checkpoint_saves"] == 2  # at step 3, and the last
    assert not list(out.glob("*/*/checkpoints"))
    # what grows with the batch, the verification catches: the run at the probes' boundary ran out of memory
    # (5 more steps' history), and the runs stepped down, 5% then twice as far each time, to one that completed
    searched, answer = record["searched_max_batch_size"], record["max_batch_size"]
    runs = check["runs"]
    assert runs[0]["status"] == "oom" and runs[0]["batch_size"] >= searched
    assert check["status"] == "stepped down" and runs[-1]["status"] == "ok"
    done_at = runs[-1]["batch_size"]
    assert [r["status"] for r in runs[:-1]] == ["oom"] * (len(runs) - 1) and check["ran_out_of_memory_at"] == [
        r["batch_size"] for r in runs[:-1]]
    assert 0 < answer and answer % 64 == 0
    # that run measured what a run of the command holds beyond a probe at its size (where no probe ran there,
    # beyond the probes' line): 5 more steps' history, counted against every probe
    length = record["length_check"]
    assert length["batch_size"] == done_at and length["run"]["dir"] == runs[-1]["dir"] and length["run"]["steps"] == 10
    history_gb = 5 * done_at * KEPT_PER_SAMPLE * 4 / 2**30
    assert length["beyond_probe_gb"] == pytest.approx(history_gb, rel=0.3)
    assert record["run_beyond_probe_gb"] == length["counted_gb"] == length["beyond_probe_gb"]
    for probe in [p for p in record["probes"] if p["status"] == "ok"]:
        assert probe["margin_gb"] == pytest.approx(0.6 - length["counted_gb"] - probe["peak_under_limit_gb"])
    # the answer: where the run completed, or below it where the probes, with that counted, found less
    assert answer == min(searched, done_at)
    assert record["bounded_by"] == "verification" if answer < searched else record["bounded_by"] in ("noise", "oom")
    # each step down is on the grid and larger than the last (5% of the size, then 10%, 20% ...)
    sizes = [r["batch_size"] for r in runs]
    assert all(b < a for a, b in zip(sizes, sizes[1:]))
    # the run that completed is the command's own: 10 steps, a record at each train.log_every and the last
    done = out / runs[-1]["dir"]
    assert read_json(done / "summary.json")["steps"] == 10 and runs[-1]["steps"] == 10
    assert read_json(done / "summary.json")["checkpoint_saves"] == 1  # checkpoint.every=100: the last step
    assert (done / "metrics.jsonl").read_text().count('"step": 10,') == 1
    # its figures are the answer's where it ran at the answer, and the answer line says what happened
    line = next(x for x in (result.stdout + result.stderr).splitlines() if "max batch: " in x)
    assert f"verified: a 10-step run of the command at {done_at} completed" in line
    if answer < searched:
        assert record["peak_under_limit_gb"] == runs[-1]["peak_under_limit_gb"] <= 0.6
        assert (f"max batch: {answer} per rank on 2 rank(s) (the probes found {searched}, but a 10-step run of the "
                f"command ran out of memory at {', '.join(str(s) for s in check['ran_out_of_memory_at'])} under "
                "memory.limit_gb=0.6)") in line
    assert read_json(out / "summary.json")["verification"] == "stepped down"


@pytest.mark.slow  # 25 s; the length's rule itself is the next test's, in the fast suite
def test_the_verification_runs_until_the_peak_settles_whatever_train_steps_is(tmp_path: Path) -> None:
    """SettlingNet's memory grows for 30 steps, past its 5-step probes, then holds. With
    train.steps=5000, the answer is run only until its peak settles (no new high over
    VERIFY_WINDOW steps, read from step 3 on: 38 steps here, 43 at most), not for 5000: the size the probes found runs
    out of memory within those steps and the answer steps down to one whose run settled."""
    out = tmp_path / "search"
    result = run_cli("task=max_batch", "model=custom", f"model._target_={__name__}.SettlingNet",
                     "model.blocks=[torch.nn.Linear]", "sharding=full", "wandb.mode=disabled", "memory.limit_gb=0.6",
                     "task.estimate=false", "task.resolution=32", "task.settle_steps=5", "train.steps=5000",
                     f"hydra.run.dir={out}", cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "max_batch.json")
    check = record["verification"]
    assert (check["steps"], check["until_settled"], check["status"]) == (100, True, "stepped down")
    assert {p["steps"] for p in record["probes"] if p["status"] == "ok"} == {5}  # settled to the probes' eyes
    done = check["runs"][-1]
    # read at step 3 (task.steps_per_probe), then every VERIFY_WINDOW steps: grown at each read until
    # one a whole window past step 30, when it stopped growing; or one window later, where a rank's
    # allocator took its last MB (more than the 0.6 MB it may rise by) after that read, as it
    # sometimes does on a CPU
    settled = next(step for step in range(3, 101, VERIFY_WINDOW) if step - VERIFY_WINDOW >= GROW_FOR)
    assert done["status"] == "ok" and done["steps"] == done["settled_at_step"] in (settled, settled + VERIFY_WINDOW)
    assert read_json(out / done["dir"] / "summary.json")["steps"] == done["steps"]
    assert check["ran_out_of_memory_at"] and min(check["ran_out_of_memory_at"]) > done["batch_size"]
    assert record["max_batch_size"] == done["batch_size"] < record["searched_max_batch_size"]
    line = next(x for x in (result.stdout + result.stderr).splitlines() if "max batch: " in x)
    held = f"verified: a run of the command at {done['batch_size']} held for {done['steps']} steps, its peak settled"
    assert held in line


def test_the_verifications_length_is_task_verify_steps_or_bounded_never_train_steps() -> None:
    from fsdp_exp.tasks.max_batch.settings import VERIFY_CAP, SearchSettings, VerifyLength

    assert SearchSettings().verify_length() == VerifyLength(VERIFY_CAP, until_settled=True)
    assert SearchSettings(verify_steps=20000).verify_length() == VerifyLength(20000, until_settled=False)
    assert SearchSettings(verify_steps=0).verify_length().steps == 0


@pytest.mark.slow  # 14 s
def test_on_cpu_each_probe_and_the_verification_log_to_wandb_as_the_run_would(tmp_path: Path) -> None:
    """With wandb on, rank 0 holds wandb's run under the CPU limit (about 40 MB here), so a
    probe logs offline too, a record every step, while it trains on. What rank 0 alone holds
    is no noise: the noise band leaves it out."""
    out = tmp_path / "search"
    result = run_cli("task=max_batch", "memory.limit_gb=0.6", "model.num_layers=2", "wandb.mode=offline",
                     "task.search_up_to=8", "task.resolution=4", "task.estimate=false", "task.verify_steps=4",
                     f"hydra.run.dir={out}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "max_batch.json")
    trained = [p for p in record["probes"] if p["status"] == "ok"]
    assert trained and record["verification"]["status"] == "completed"
    for probe in trained:
        assert list((out / probe["dir"] / "wandb").glob("offline-run-*/run-*.wandb")), probe["dir"]
        steps = [line for line in (out / probe["dir"] / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
        assert len(steps) == probe["steps"] >= 5  # a record at every step
        held = probe["held_before_limit_gb_per_rank"]
        assert held[0] - held[1] > 0.01  # rank 0 holds wandb's run (more than 10 MB) ...
    assert record["noise_band_gb"] < 0.005  # ... which the noise band does not take for noise
    (verified,) = record["verification"]["runs"]
    # the command as it runs: wandb offline, a record at each train.log_every
    assert list((out / verified["dir"] / "wandb").glob("offline-run-*/run-*.wandb")), verified["dir"]
    assert verified["steps"] == 4 and (out / verified["dir"] / "metrics.jsonl").read_text().count('"step"') == 1
    assert verified["dir"] == "verify/01_b8"
    assert record["probes_before_verifying"] == len(record["probes"])  # nothing to probe below it afterwards
    # the one run of the command also measured what it held beyond the probe at its size, counted against
    # every probe (the room each had is the limit less it)
    length = record["length_check"]
    (probe,) = [p for p in trained if p["batch_size"] == 8]
    assert length["batch_size"] == 8 and length["run"]["dir"] == verified["dir"]
    assert length["probe_peaks_gb_per_rank"] == probe["peak_under_limit_gb_per_rank"]
    assert length["beyond_probe_gb"] == pytest.approx(max(
        r - p for r, p in zip(verified["peak_under_limit_gb_per_rank"], probe["peak_under_limit_gb_per_rank"])))
    for p in trained:
        assert p["margin_gb"] == pytest.approx(0.6 - length["counted_gb"] - p["peak_under_limit_gb"])
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # and the search's own run, with its answer


def test_a_probes_peak_has_settled_when_two_checks_a_window_apart_agree_within_the_noise_band() -> None:
    from fsdp_exp.rank.peak_settled import PeakSettled

    peaks = iter([0.500, 0.520, 0.5205, 0.530])  # the peak so far, at each check
    settled = PeakSettled(tolerance_gb=0.001, first_check=3, window=2, device=torch.device("cpu"),
                          measure=lambda device, window: next(peaks))
    # checked at steps 3, 5, 7 and 9 only; at 5 it grew 20 MB, at 7 half a MB: settled
    assert [step for step in range(1, 8) if settled(step, lambda: None)] == [7]
    assert not settled(9, lambda: None)  # 10 MB more: not settled (a probe stops at the first that is)
    unmeasured = PeakSettled(tolerance_gb=0.001, first_check=3, window=2, device=torch.device("cpu"),
                             measure=lambda device, window: None)
    assert not any(unmeasured(step, lambda: None) for step in range(1, 20))  # no count here: it runs its steps
    # On a GPU the trainer's window peaks are reset each window: the largest seen so far counts
    windows = iter([0.60, 0.40, 0.6004])
    gpu = PeakSettled(tolerance_gb=0.001, first_check=3, window=2, device=torch.device("cuda"))
    assert [gpu(step, lambda: next(windows)) for step in (3, 5, 7)] == [False, True, True]


def test_a_probe_saves_a_checkpoint_where_the_run_does_and_trains_on_beside_it() -> None:
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.driver.plan import prepare
    from fsdp_exp.tasks.max_batch.probe import command_config, probe_config

    exp = prepare(compose_checked(["task=max_batch", "memory.limit_gb=1", "checkpoint=dcp_async",
                                   "checkpoint.dir=/tmp/theirs", "wandb.mode=offline"]), 0).exp
    probe = probe_config(exp, batch_size=8, steps=3, world_size=2, up_to_steps=20)
    assert (probe.checkpoint.every, probe.checkpoint.dir, probe.checkpoint.mode) == (3, None, exp.checkpoint.mode)
    assert probe.train.steps == 20 and probe.train.log_every == 1 and probe.wandb.mode.value == "offline"
    assert probe.wandb.id is None and probe.wandb.job_type == "probe"
    assert replace(probe.wandb, tags=["x"]).job_type == "probe"  # a setting: a copy keeps it
    # the verification: the command as it runs, at the answer, never in the user's checkpoint.dir
    run = command_config(exp, batch_size=8, steps=50, job_type="verify")
    assert (run.checkpoint.every, run.checkpoint.dir, run.train.log_every) == (exp.checkpoint.every, None, 10)
    assert run.wandb.mode == exp.wandb.mode and run.wandb.id != exp.wandb.id and run.wandb.job_type == "verify"
    # one that may stop once its peak settles saves within the window it checks, as the run saves within its length
    assert exp.checkpoint.every > 10
    bounded = command_config(exp, batch_size=8, steps=100, job_type="verify", save_within=10)
    assert (bounded.checkpoint.every, bounded.train.log_every) == (10, 5)  # and its speed read twice a window
    none = prepare(compose_checked(["task=max_batch", "memory.limit_gb=1", "wandb.mode=disabled"]), 0).exp
    assert type(probe_config(none, 8, 3, 2).checkpoint).__name__ == "NoCheckpoint"


class VariantNet(nn.Module):
    """Setups of one model for task=tune's tests (+task.space.model.variant=[...]):
    `fast_growing` keeps 18 MB every training step (a history it never frees), so a 5-step
    probe (90 MB) fits under 0.6 GB where a 10-step run (180 MB) does not; `steady` and
    `steady_too` keep nothing and wait 100 ms a forward, which sets their speed: one model
    under two names, within the noise of each other, and slower than `fast_growing`."""

    def __init__(self, variant: str = "steady") -> None:
        super().__init__()
        self.variant = variant
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
        self.kept: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.variant == "fast_growing":
            if self.training and torch.is_grad_enabled():
                self.kept.append(torch.ones(18 * 2**20 // 4))
        else:
            time.sleep(0.1)
        return self.body(images)


VARIANTS = ["task=tune", "model=custom", f"model._target_={__name__}.VariantNet", "model.blocks=[torch.nn.Linear]",
            "memory.limit_gb=0.6", "wandb.mode=disabled", "task.space.sharding=[full]",
            "task.space.train.activation_checkpointing=[false]", "task.space.offload=[false]", "task.estimate=false",
            "task.resolution=64", "task.search_up_to=512", "task.settle_steps=5", "task.verify_steps=10"]


@pytest.mark.slow
def test_generated_data_bounds_the_search_at_each_ranks_share_and_one_run_verifies_it(tmp_path: Path) -> None:
    """data.num_samples=300 on 2 ranks: 150 a rank, far below what fits in 4 GB. The search,
    its first probe placed by the estimate, answers 150, bounded by the data, far under the
    limit: one run of the command, at 150, verifies it."""
    out = tmp_path / "search"
    result = run_cli("task=max_batch", "memory.limit_gb=4", "model.num_layers=2", "data.num_samples=300",
                     "task.verify_steps=4", "wandb.mode=disabled", f"hydra.run.dir={out}",
                     cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "max_batch.json")
    assert (record["max_batch_size"], record["bounded_by"], record["data_share_per_rank"]) == (150, "data", 150)
    assert record["probe_count"] <= 3 and max(p["batch_size"] for p in record["probes"]) == 150
    (run,) = record["verification"]["runs"]
    assert record["verification"]["status"] == "completed"
    # what that run held beyond its probe is measured there, and changes nothing this far from the limit
    assert record["length_check"]["batch_size"] == 150 and record["length_check"]["run"]["dir"] == run["dir"]
    assert [p.name for p in (out / "verify").iterdir()] == ["01_b150"]  # one run of the command
    assert record["verify_wall_s"] == run["wall_s"]  # and its time counted once
    assert "max batch: 150 per rank on 2 rank(s), bounded by the data (150 samples a rank)" in result.stdout


def test_one_run_of_the_command_verifies_and_what_it_held_beyond_its_probe_brings_the_boundary_down(
        tmp_path: Path) -> None:
    """The search's own decisions, on probes and runs as a search records them (peaks on a
    line of 0.25 MB a sample under 0.6 GB, noise band 1.2 MB). The command runs once, at the
    probes' boundary, 404. It held 1 MB more than its probe there: counted against every
    probe, 404 no longer has the band to spare, the probes go on below it, and their answer,
    400, is covered by the run at 404 (a run at a smaller size holds less): no second run.
    Where the run at the boundary ran out of memory instead, the next run steps down."""
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.driver.plan import prepare
    from fsdp_exp.tasks.max_batch.answer import answer_line
    from fsdp_exp.tasks.max_batch.probe import Probe
    from fsdp_exp.tasks.max_batch.search import MaxBatchSearch

    slope, mb = 0.25 / 1024, 1 / 1024

    def peak(size: int) -> float:
        return 0.5 + slope * size

    def probe(size: int, creep_gb: float = 0.0, steps: int = 5, **kind) -> Probe:
        status = "oom" if peak(size) + creep_gb > 0.6 else "ok"
        if status == "oom":
            return Probe(size, "oom", reason="out of memory", **kind)
        at = peak(size) + creep_gb
        return Probe(size, "ok", peak_under_limit_gb=at, peak_under_limit_gb_per_rank=[at, at - 0.1 * mb],
                     held_before_limit_gb_per_rank=[0.3, 0.3], samples_per_s=100.0, steps=steps, **kind)

    plan = prepare(compose_checked(["task=max_batch", "memory.limit_gb=0.6", "task.resolution=4",
                                    "task.estimate=false", "wandb.mode=disabled"]), 0)
    search = MaxBatchSearch(plan.exp, tmp_path, plan.launcher, plan.nproc)
    search.placed = True
    search.probes = [probe(size) for size in (200, 360, 404, 408)]  # 408 fits inside the band: not with room
    assert search.noise_gb() == pytest.approx(0.0012) and search.boundary() == 404 and search.next_size() is None
    assert search.size_to_verify(404) == 404 and search.verify(404) == 404  # not run yet: unverified

    search.verification.runs.append(probe(404, creep_gb=mb, steps=20, settled_at_step=20, dir="verify/01_b404"))
    assert search.held_beyond().beyond_gb() == pytest.approx(mb) and search.counted_beyond_gb() == pytest.approx(mb)
    asked = []
    while (size := search.next_size()) is not None:  # the probes go on below 404, with 1 MB counted
        asked.append(size)
        search.probes.append(probe(size))
    assert asked and all(360 < s < 404 for s in asked)
    assert search.boundary() == 400 and search.size_to_verify(400) is None and search.verify(400) == 400
    record = search.save(400)
    assert record.length_check["batch_size"] == 404 and record.run_beyond_probe_gb == pytest.approx(mb)
    assert record.verification["status"] == "completed" and record.bounded_by == "noise"
    line = answer_line(record, 0.6)
    assert ("verified: a run of the command at 404 held for 20 steps (above 400: what it held beyond its probe, "
            "counted, brought the probes' boundary down), its peak settled") in line
    assert "holds 1.0 MB more than a probe (measured at batch 404, counted)" in line

    # A run of the command at the boundary that ran out of memory: the next one is 5% below, no probe there
    search.verification.runs = [probe(404, creep_gb=10 * mb, steps=20)]
    search.probes = search.probes[:4]
    assert search.boundary() == 404 and search.size_to_verify(404) == 380  # 404 less 5%, on the grid of 4
    search.verification.runs.append(probe(380, creep_gb=2 * mb, steps=20, dir="verify/02_b380"))
    length = search.held_beyond()
    # no probe ran at 380: what the run held beyond one is read against the probes' line
    assert length.batch_size == 380 and length.probe_peaks_gb_per_rank is None
    assert length.probe_peak_gb == pytest.approx(peak(380) + 0.05 * mb, abs=0.1 * mb)  # the ranks' mean, near enough
    assert length.beyond_gb() == pytest.approx(2 * mb, abs=0.1 * mb)
    while (size := search.next_size()) is not None:  # with 2 MB counted, the probes find 396 ...
        search.probes.append(probe(size))
    assert search.boundary() == 396
    # ... above the run that completed: the answer is where a run completed, with nothing more to run
    assert search.size_to_verify(396) is None and search.verify(396) == 380
    record = search.save(380)
    assert (record.verification["status"], record.bounded_by, record.searched_max_batch_size) == (
        "stepped down", "verification", 396)


def test_a_probe_at_the_size_the_search_expects_to_answer_runs_as_the_command(tmp_path: Path) -> None:
    """MaxBatchSearch.answers_at: a probe runs as the command, and verifies the answer as it
    probes, where a size that fits there closes the bracket, or where the estimate's curve
    puts the boundary less than one step of task.resolution above it; not when the answer
    runs task.verify_steps steps, is not verified, or a run of the command completed."""
    from fsdp_exp.driver.plan import prepare
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.tasks.max_batch.probe import Probe
    from fsdp_exp.tasks.max_batch.search import MaxBatchSearch

    def search_of(*overrides: str) -> MaxBatchSearch:
        plan = prepare(compose_checked(["task=max_batch", "memory.limit_gb=0.6", "model.num_layers=2",
                                        "wandb.mode=disabled", "task.estimate=false", "task.resolution=4",
                                        *overrides]), 0)
        return MaxBatchSearch(plan.exp, tmp_path / "search", plan.launcher, 2)

    search = search_of()
    assert not search.answers_at(4)  # nothing known: no estimate, no probe
    search.estimated = {"peaks_gb": [[4, 0.40], [64, 0.64]]}  # 4 MB a sample
    crossing = 4 + (0.6 - search.noise_gb() - 0.40) / 0.004  # where the room the probes aim at is reached: 53.7
    assert 52 < crossing < 56
    assert search.answers_at(48) and not search.answers_at(44)  # within one step of 4 below it, or not
    search.estimated = None
    search.probes = [Probe(40, "ok", peak_under_limit_gb=0.56, peak_under_limit_gb_per_rank=[0.56, 0.56]),
                     Probe(48, "oom")]
    assert search.answers_at(44) and not search.answers_at(40 - 4)  # 44 fitting closes (40, 48); 36 does not
    search.verification.runs.append(replace(search.probes[0], as_command=True))
    assert not search.answers_at(44)  # a run of the command completed: the later probes are probes
    for length in ("task.verify_steps=10", "task.verify_steps=0"):
        exact = search_of(length)
        exact.probes = search.probes
        assert not exact.answers_at(44)


def test_a_search_that_probes_only_its_answer_verifies_it_with_that_probe(tmp_path: Path) -> None:
    """task.search_up_to=8 on the resolution's grid of 8: the first probe, at 8, closes the
    search if it fits, so it runs as the command, until its peak settles, and is both the
    search's one probe and the run of the command that verifies its answer: no second run."""
    out = tmp_path / "search"
    result = run_cli("task=max_batch", "memory.limit_gb=0.6", "model.num_layers=2", "wandb.mode=disabled",
                     "task.estimate=false", "task.resolution=8", "task.search_up_to=8", f"hydra.run.dir={out}",
                     cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_json(out / "max_batch.json")
    (probe,) = record["probes"]
    check = record["verification"]
    assert (probe["batch_size"], probe["status"], probe["as_command"]) == (8, "ok", True)
    assert (check["status"], record["max_batch_size"], record["bounded_by"]) == ("completed", 8, "search_up_to")
    assert check["runs"] == [probe] and probe["dir"].startswith("probes/") and not (out / "verify").exists()
    # run as the command: until its peak settled, read at step 3 and every VERIFY_WINDOW steps after (8 here)
    assert probe["settled_at_step"] == probe["steps"] and (probe["steps"] - 3) % VERIFY_WINDOW == 0
    assert 3 + VERIFY_WINDOW <= probe["steps"] < 100
    assert read_json(out / probe["dir"] / "summary.json")["steps"] == probe["steps"]
    # its seconds are probing, said once; nothing beyond a probe is counted (it was the probe)
    assert record["verify_wall_s"] == 0 and record["probe_wall_s"] == pytest.approx(probe["wall_s"])
    assert record["length_check"] is None and record["run_beyond_probe_gb"] is None
    line = next(x for x in result.stdout.splitlines() if "max batch: " in x)
    assert f"verified: the probe at 8, run as the command, held for {probe['steps']} steps" in line
    assert "s verifying" not in line
    # run again into the same folder, the record is reused as it is: nothing more runs
    again = run_cli("task=max_batch", "memory.limit_gb=0.6", "model.num_layers=2", "wandb.mode=disabled",
                    "task.estimate=false", "task.resolution=8", "task.search_up_to=8", f"hydra.run.dir={out}",
                    cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_json(out / "max_batch.json")["verification"]["runs"] == [probe]
    assert sorted(p.name for p in (out / "probes").iterdir()) == ["01_b8"]


@pytest.mark.parametrize("plain", ["ok", "failed"])
def test_a_probe_that_failed_as_the_command_is_probed_plain_and_counts_where_the_failure_was(
        plain: str, tmp_path: Path) -> None:
    """A probe run as the command that failed, not for lack of memory, is probed again as the
    probes run: where that trains, the failure was the command's own (its wandb, its
    checkpoints), which leaves the answer not verified with its reason, and the plain probe
    stands for the size; where it fails too, the size does not train, and both are probes."""
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.driver.plan import prepare
    from fsdp_exp.tasks.max_batch.probe import Probe
    from fsdp_exp.tasks.max_batch.search import MaxBatchSearch

    class Outcomes(MaxBatchSearch):
        """The search's bookkeeping, with each launch's outcome given: as the command, a failure."""

        def probe(self, size, limit_gb="same", for_fastest=False, as_command=False):  # noqa: ANN001, ANN202
            status = "failed" if as_command else plain
            run = Probe(size, status, reason="disk full" if as_command else None, as_command=as_command,
                        peak_under_limit_gb=0.5 if status == "ok" else None)
            self.probes.append(run)
            return run

    plan = prepare(compose_checked(["task=max_batch", "memory.limit_gb=0.6", "model.num_layers=2",
                                    "wandb.mode=disabled", "task.estimate=false", "task.resolution=8",
                                    "task.search_up_to=8"]), 0)
    search = Outcomes(plan.exp, tmp_path / "search", plan.launcher, 2)
    search.run_dir.mkdir()  # where a launch would have made it
    assert search.step()  # the only size, 8, closes the search: run as the command, then plain
    assert [(p.status, p.as_command) for p in search.probes] == (
        [("ok", False)] if plain == "ok" else [("failed", True), ("failed", False)])
    runs = search.verification.runs
    if plain == "ok":
        assert [(r.status, r.reason) for r in runs] == [("failed", "disk full")]
        assert search.boundary() == 8 and search.verification.status() == "failed"
        assert not search.verify_step() and search.verify(8) == 8  # not verified: said so, with the reason
    else:
        assert runs == [] and search.boundary() == 0
