"""Every training run checks task=estimate against itself (memory.estimate): the estimate of
the same setup, traced beside the run at idle priority, recorded beside the peak measured in
summary.json, the log, wandb and compare's table."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.commands.compare import main as compare
from fsdp_exp.driver.plan import prepare
from fsdp_exp.estimate.beside import EstimateBeside, at_idle_priority, checked, wait_for_estimate
from fsdp_exp.estimate.earlier import setup_key
from fsdp_exp.estimate.record import ESTIMATE_FILE, EstimateRecord
from fsdp_exp.metrics.summary import NOT_READY, Summary
from tests.conftest import REPO, SMALL_VIT, estimated_first, read_json, run_and_list_left, run_cli, user_package
from tests.test_estimate import STACK

RUN = [*SMALL_VIT, "device=cpu", "train.steps=3", "train.log_every=1", "metrics.warmup_steps=1"]


@pytest.mark.slow
def test_a_run_records_its_own_estimate_beside_its_peak_and_compare_shows_both(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A sweep of one run with its estimate and one without: the first's summary holds
    task=estimate's figures for its setup (the same figures `task=estimate` prints), each
    under the name of the figure the run measured, beside it, with its ratio; the second
    traced nothing. compare shows the estimate and its error for the first, nothing for the
    second. The setup is estimated first (task=estimate): a run this short ends before a trace
    beside it would, and reuses that estimate."""
    alone = estimated_first(*RUN, "wandb.mode=offline", cwd=tmp_path, where=tmp_path / "estimate")
    record = read_json(alone / ESTIMATE_FILE)
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "memory.estimate=true,false", *RUN, "wandb.mode=offline", f"hydra.sweep.dir={sweep}",
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    checked_run, plain = read_json(sweep / "0" / "summary.json"), read_json(sweep / "1" / "summary.json")
    # the same trace: the tensors to the byte; the data set's share and the build's (what making
    # them grew the process by) are measured, to a few MB
    beside = read_json(sweep / "0" / ESTIMATE_FILE)
    for figure in ("peak_mem_gb", "peak_in_use_gb"):
        assert beside[figure] == checked_run[f"estimated_{figure}"] > 0
        assert checked_run[f"estimate_ratio_{figure[:-3]}"] == pytest.approx(beside[figure] / checked_run[figure])
    measured = ("data_gb", "build_held_gb")
    assert beside["peak_mem_gb"] - sum(beside[k] for k in measured) == pytest.approx(
        record["peak_mem_gb"] - sum(record[k] for k in measured), abs=1e-9)
    assert beside["data_gb"] == pytest.approx(record["data_gb"], abs=4 / 1024) and record["data_gb"] > 0
    assert beside["build_held_gb"] == pytest.approx(record["build_held_gb"], abs=4 / 1024)
    assert beside["peak_in_use_gb"] == pytest.approx(record["peak_in_use_gb"], abs=4 / 1024)
    # on CPU the headline is what the allocations held: the resident peak also holds glibc's kept blocks
    assert checked_run["estimate_ratio"] == checked_run["estimate_ratio_peak_in_use"]
    assert abs(checked_run["estimate_ratio"] - 1) <= 0.1, checked_run
    assert 0 <= checked_run["estimate_wait_s"] <= 0.5 and "estimate_failed" not in checked_run  # there at once
    assert checked_run["estimate_reused_from"] and "estimate_trace_held" not in checked_run  # no trace was started

    log = (sweep / "0" / "rank0.log").read_text()
    (wandb_log,) = (sweep / "0" / "wandb").glob("offline-run-*/run-*.wandb")
    error = f"{checked_run['estimate_ratio'] - 1:+.1%}"  # in rank 0's log line and wandb too
    assert f"in use at phase ends {checked_run['estimated_peak_in_use_gb']:.3f} GB (measured " \
           f"{checked_run['peak_in_use_gb']:.3f} GB, {error})" in log, log[-2000:]
    assert b"estimated_peak_in_use_gb" in wandb_log.read_bytes() and b"estimate_ratio" in wandb_log.read_bytes()

    assert not (sweep / "1" / ESTIMATE_FILE).exists()
    assert not {k for k in plain if k.startswith("estimate")}, plain

    assert compare([str(sweep), "--out", str(tmp_path / "compared")]) == 0
    head, _, *rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in head.strip("|").split("|")]
    cells = [dict(zip(columns, (c.strip() for c in row.strip("|").split("|")))) for row in rows]
    assert [(c["estimated (GB)"], c["in use (GB)"], c["estimate error"]) for c in cells] == [
        (f"{checked_run['estimated_peak_mem_gb']:.2f}", f"{checked_run['peak_in_use_gb']:.3f}",
         f"{checked_run['estimate_ratio'] - 1:+.0%}"), ("-", f"{plain['peak_in_use_gb']:.3f}", "-")]


@pytest.mark.slow
def test_under_a_cpu_limit_rank_0s_wandb_run_is_in_the_estimate_and_grows_nothing_mid_run(tmp_path: Path) -> None:
    """wandb on (offline, as without an API key): rank 0 holds its wandb run from before its
    runtime is marked, which memory.limit_gb counts, and the estimate holds it too; logging
    starts nothing that grows rank 0 beyond what the other rank grows while training."""
    out, setup = tmp_path / "run", [*RUN, "train.steps=6", "wandb.mode=offline", "memory.limit_gb=2"]
    estimated_first(*setup, cwd=tmp_path, where=tmp_path / "estimate")
    result = run_cli(*setup, f"hydra.run.dir={out}", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert abs(summary["estimate_ratio_peak_under_limit"] - 1) <= 0.03, summary  # without wandb's run: 0.95
    grown = [peak - held for peak, held in zip(summary["peak_under_limit_gb_per_rank"],
                                               summary["held_before_limit_gb_per_rank"], strict=True)]
    assert abs(grown[0] - grown[1]) <= 6 / 1024, grown  # wandb's error reporting started 16 MB of threads


@pytest.mark.slow
def test_a_model_the_estimate_cannot_trace_still_trains_and_says_why(tmp_path: Path) -> None:
    """task=estimate of a model the trace cannot follow fails, and keeps why for the setup: its
    training run, shorter than a trace, trains and says why at once."""
    stack = [o.replace("tests.test_estimate.linear_stack", "tests.test_estimate.ReadsItsInput") for o in STACK]
    out = tmp_path / "run"
    tried = run_cli(*stack, "task=estimate", f"hydra.run.dir={tmp_path / 'estimate'}", cwd=REPO)
    assert tried.returncode == 1 and "could not trace this setup" in tried.stdout + tried.stderr, tried.stderr[-2000:]
    result = run_cli(*stack, "train.steps=2", f"hydra.run.dir={out}", cwd=REPO)  # kept: said at once
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["peak_mem_gb"] > 0
    assert summary["estimate_failed"].startswith("task=estimate could not trace this setup"), summary
    assert "estimated_peak_mem_gb" not in summary
    assert "no estimate" not in result.stderr and "Traceback" not in result.stdout + result.stderr


def test_a_trace_rank_0_gave_up_on_is_stopped_and_the_summary_says_not_ready(tmp_path: Path) -> None:
    """Rank 0 waited for the trace and it did not come (`estimate_wait_s` in the figures): the
    driver does not wait again. The trace is stopped (nothing it started outlives the command),
    nothing half-written is left, and the figures say `estimate: not ready`."""
    beside = EstimateBeside(prepare(compose_checked(STACK), 0).exp, 2, tmp_path)
    figures = beside.add_to({"peak_mem_gb": 0.01, "peak_in_use_gb": 0.01, "estimate_wait_s": 30.0}, run_s=1.0)
    assert figures["estimate"] == NOT_READY  # a trace takes seconds: it cannot be done yet
    assert beside.process.returncode == -signal.SIGKILL
    assert not (tmp_path / ESTIMATE_FILE).exists() and not list(tmp_path.glob(".estimate*"))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_runs_end_waits_for_a_trace_still_going_at_most_as_long_as_it_may(tmp_path: Path) -> None:
    """A record that is there is read at once; a trace still going is waited for, at most as
    long as asked; one that ended (a zombie not yet waited for, as the driver's child is) or
    none at all, not at all."""
    path = tmp_path / ESTIMATE_FILE
    assert wait_for_estimate(path, None, 5.0)[0] is None and wait_for_estimate(path, None, 5.0)[1] < 0.5
    going = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record, waited = wait_for_estimate(path, going.pid, 1.0)
        assert record is None and 1.0 <= waited < 2.0
        going.kill()
        deadline = time.monotonic() + 5
        while state(going.pid) != "Z" and time.monotonic() < deadline:  # ended, not waited for yet
            time.sleep(0.05)
        assert state(going.pid) == "Z"
        record, waited = wait_for_estimate(path, going.pid, 5.0)
        assert record is None and waited < 0.5
    finally:
        going.kill()
        going.wait()
    EstimateRecord(error="traced, and refused").write_to(path)
    record, waited = wait_for_estimate(path, os.getpid(), 5.0)
    assert record.error == "traced, and refused" and waited < 0.5


def test_a_setup_traced_once_has_its_estimate_at_once_in_its_later_runs(tmp_path: Path) -> None:
    """A trace that ends keeps its estimate for the setup: the next run of the same setup
    (train.steps and the seed do not count) starts no trace and checks against it at once,
    saying where it was kept; another batch size is another setup."""
    exp = prepare(compose_checked(STACK), 0).exp
    for folder in ("first", "second", "third"):
        (tmp_path / folder).mkdir()
    first = EstimateBeside(exp, 2, tmp_path / "first")
    waited_for, _ = wait_for_estimate(first.path, first.process.pid, 120)  # as the run's end waits for it
    assert waited_for is not None, (tmp_path / "first" / "estimate.log").read_text()
    record = read_json(tmp_path / "first" / ESTIMATE_FILE)
    assert first.process.wait(timeout=10) == 0
    first.stop()
    assert not list((tmp_path / "first").glob(".estimate*"))  # nothing of the trace's left in the run directory
    again = prepare(compose_checked([*STACK, "train.steps=7", "seed=3"]), 0).exp
    second = EstimateBeside(again, 2, tmp_path / "second")
    assert second.process is None and read_json(second.path)["peak_mem_gb"] == record["peak_mem_gb"] > 0
    figures = second.add_to({"peak_mem_gb": 0.01, "peak_in_use_gb": 0.01}, run_s=1.0)
    assert figures["estimated_peak_mem_gb"] == record["peak_mem_gb"]
    assert figures["estimate_ratio"] == pytest.approx(record["peak_in_use_gb"] / 0.01)
    assert Path(figures["estimate_reused_from"]).is_file()
    assert second.add_to({"peak_mem_gb": 0.01, "estimate_ratio": 1.0}, run_s=1.0) == \
        {"peak_mem_gb": 0.01, "estimate_ratio": 1.0}
    other = EstimateBeside(prepare(compose_checked([*STACK, "train.batch_size=3"]), 0).exp, 2, tmp_path / "third")
    assert other.process is not None
    other.stop()


def test_stopping_the_run_stops_its_trace(tmp_path: Path) -> None:
    """Ctrl-C: the run's trace goes with it, and writes nothing."""
    beside = EstimateBeside(prepare(compose_checked(STACK), 0).exp, 2, tmp_path)
    beside.stop()
    assert beside.process.returncode == -signal.SIGKILL and not (tmp_path / ESTIMATE_FILE).exists()
    assert not list(tmp_path.glob(".estimate*"))


def test_on_a_gpu_the_reserved_and_device_figures_are_checked_too() -> None:
    """A GPU run's record and summary (figures by hand): allocated against allocated,
    the replay's reserved against the allocator's reserved peak, and what the device holds
    against torch.cuda.mem_get_info's use at that peak: each under the run's own name."""
    record = EstimateRecord(peak_mem_gb=10.0, peak_under_limit_gb=11.0, peak_reserved_gb=11.0, device_used_gb=12.2)
    summary = Summary(peak_mem_gb=9.5, peak_reserved_gb=12.0, device_used_gb=13.0)
    assert checked(summary, record) == {
        "estimated_peak_mem_gb": 10.0, "estimate_ratio_peak_mem": pytest.approx(10 / 9.5),
        "estimate_ratio": pytest.approx(10 / 9.5),
        "estimated_peak_reserved_gb": 11.0, "estimate_ratio_peak_reserved": pytest.approx(11 / 12),
        "estimated_device_used_gb": 12.2, "estimate_ratio_device_used": pytest.approx(12.2 / 13)}
    cpu_under_a_limit = checked(Summary(peak_mem_gb=0.5, peak_in_use_gb=0.3, peak_under_limit_gb=1.0),
                                EstimateRecord(peak_mem_gb=0.4, peak_in_use_gb=0.33, peak_under_limit_gb=0.9))
    assert cpu_under_a_limit == {"estimated_peak_in_use_gb": 0.33, "estimate_ratio_peak_in_use": pytest.approx(1.1),
                                 "estimate_ratio": pytest.approx(1.1),
                                 "estimated_peak_mem_gb": 0.4, "estimate_ratio_peak_mem": pytest.approx(0.8),
                                 "estimated_peak_under_limit_gb": 0.9,
                                 "estimate_ratio_peak_under_limit": pytest.approx(0.9)}
    assert checked(Summary(peak_mem_gb=1.0), EstimateRecord(error="no")) == {"estimate_failed": "no"}


def test_an_estimate_is_written_and_read_back_as_one_record(tmp_path: Path) -> None:
    """estimate.json through `EstimateRecord`: figures in field order, one not known left out,
    a key it has no field for kept, a failed trace only its error, a damaged file no record."""
    written = EstimateRecord.of({"device": "cpu", "world_size": 2, "peak_mem_gb": 0.4, "limit_gb": None,
                                 "batches": [{"batch_size": 8, "peak_under_limit_gb": 0.5}], "older": 1})
    written.write(tmp_path)
    assert read_json(tmp_path / ESTIMATE_FILE) == {"device": "cpu", "world_size": 2, "peak_mem_gb": 0.4,
                                                   "batches": [{"batch_size": 8, "peak_under_limit_gb": 0.5}],
                                                   "older": 1}
    assert list(read_json(tmp_path / ESTIMATE_FILE)) == ["device", "world_size", "peak_mem_gb", "batches", "older"]
    read = EstimateRecord.read(tmp_path)
    assert read == written and read.more == {"older": 1} and not read.judged
    with pytest.raises(AttributeError):
        read.peak_gb = 1.0  # type: ignore[attr-defined]
    EstimateRecord(error="no").write(tmp_path)
    assert read_json(tmp_path / ESTIMATE_FILE) == {"error": "no"}
    (tmp_path / ESTIMATE_FILE).write_text('{"device": "cp')
    assert EstimateRecord.read(tmp_path) is None and EstimateRecord.read(tmp_path / "none") is None


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_trace_runs_at_idle_priority() -> None:
    """The driver's tracing thread takes SCHED_IDLE, and a process it starts has it too (the
    trace is such a process), so the trace gets only the CPU the ranks leave."""
    seen = []

    def start_one() -> None:
        at_idle_priority()
        seen.append(os.sched_getscheduler(0))
        child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                               capture_output=True, text=True, check=True)
        seen.append(int(child.stdout))

    thread = threading.Thread(target=start_one)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the driver's own thread keeps its priority


@pytest.mark.slow
def test_under_a_cpu_limit_the_estimate_is_within_5_percent_for_fsdp_and_ddp(tmp_path: Path) -> None:
    """What memory.limit_gb counts on CPU, estimated and measured, over every phase since the
    limit was set: FSDP2's backward starts autograd's device threads, whose whole stacks the
    limit counts (8 x 8 MB here), DDP's does not (left out, FSDP's estimate was 15% low); and
    for this small model making the data set (its temporaries) outgrows a step (left out,
    DDP's estimate was 13% low)."""
    sweep, setups = tmp_path / "sweep", ["-m", "sharding=full,ddp", *RUN, "memory.limit_gb=4"]
    estimated_first(*setups, cwd=tmp_path, where=tmp_path / "estimates")
    result = run_cli(*setups, f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    for run in ("0", "1"):
        summary = read_json(sweep / run / "summary.json")
        assert abs(summary["estimate_ratio_peak_under_limit"] - 1) <= 0.05, (
            summary["choices"], summary["estimated_peak_under_limit_gb"], summary["peak_under_limit_gb"])


FRESH_THREAD = """
import threading
from fsdp_exp.estimate.trace import thread_stack_bytes

def data():
    return int(open("/proc/self/status").read().split("VmData:")[1].split()[0]) * 1024

counted = thread_stack_bytes()
stop = threading.Event()
one = threading.Thread(target=stop.wait)
before = data()
one.start()
print(counted, data() - before)
stop.set()
"""


def test_a_threads_stack_is_counted_whole() -> None:
    """glibc gives a new thread `ulimit -s` of stack and a guard page, and the data segment
    memory.limit_gb counts grows by it whole: the first thread a fresh process starts shows
    it (later ones may get a stack glibc cached)."""
    stack, _ = resource.getrlimit(resource.RLIMIT_STACK)
    shown = subprocess.run([sys.executable, "-c", FRESH_THREAD], capture_output=True, text=True, cwd=REPO, check=True)
    counted, grown = map(int, shown.stdout.split())
    if stack != resource.RLIM_INFINITY:
        assert counted == stack + resource.getpagesize()
    # a Python thread holds a little more: its malloc arena (about 140 kB) and, where the
    # interpreter's small-object arenas are full, a new one of 1 MiB
    assert counted <= grown <= counted + 2 * 2**20, (counted, grown)


WIDE = 1024  # 8 layers of 1024 x 1024: a state (parameters, AdamW's moments) far above a step's activations


def wide_stack() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDE, WIDE, bias=False) for _ in range(8)])


class WideVectors(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(WIDE), torch.tensor(index % WIDE)


WIDE_RUN = ["model=custom", "model._target_=tests.test_own_estimate.wide_stack", "model.blocks=[torch.nn.Linear]",
            "data=custom", "data._target_=tests.test_own_estimate.WideVectors", "device=cpu", "wandb.mode=disabled",
            "train.batch_size=2", "train.steps=3", "memory.limit_gb=4"]


@pytest.mark.slow
def test_a_checkpoint_save_that_outgrows_the_step_is_named_and_counted(tmp_path: Path) -> None:
    """dcp_async_pinned keeps a copy of each rank's state (its parameter shards and AdamW's
    moments) beside the steps: for a model whose state outweighs its activations that is
    the run's peak. The estimate names the phase, the table says what avoids it
    (checkpoint=dcp), and the two runs' measured peaks differ by about the copy."""
    sweep = tmp_path / "sweep"
    setups = ["-m", "checkpoint=dcp_async_pinned,dcp", *WIDE_RUN, "++checkpoint.every=1"]
    estimated_first(*setups, cwd=REPO, where=tmp_path / "estimates")
    result = run_cli(*setups, f"hydra.sweep.dir={sweep}", cwd=REPO, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    pinned, sync = (read_json(sweep / run / "summary.json") for run in ("0", "1"))
    staged, plain = (read_json(sweep / run / ESTIMATE_FILE) for run in ("0", "1"))
    assert staged["phase"] == "checkpoint save" and plain["phase"] != "checkpoint save", (staged["phase"], plain["phase"])
    phases = staged["batches"][0]["phases_gb"]
    copy = phases["checkpoint save"] - phases["step"]
    assert copy > 0.04, phases  # 8 x 1024 x 1024 fp32 weights and two moments, halved by 2 ranks: 48 MB
    for summary in (pinned, sync):
        assert abs(summary["estimate_ratio_peak_under_limit"] - 1) <= 0.05, summary["estimate_ratio_peak_under_limit"]
    moved = pinned["peak_under_limit_gb"] - sync["peak_under_limit_gb"]
    predicted = staged["peak_under_limit_gb"] - plain["peak_under_limit_gb"]
    assert abs(moved - predicted) <= 0.25 * predicted, (moved, predicted)

    out = tmp_path / "estimate"
    shown = run_cli("task=estimate", "checkpoint=dcp_async_pinned", "checkpoint.every=1", *WIDE_RUN,
                    f"hydra.run.dir={out}", cwd=REPO)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "a checkpoint save's copy of the state, beside a step, peaks above a step at batch 2" in shown.stdout
    assert "checkpoint=dcp writes from the state itself" in shown.stdout


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_rank_0_holds_the_trace_still_through_the_timed_steps_and_lets_it_go_on_after() -> None:
    """A busy process in a session of its own, as the trace is (with a child, as a trace that
    holds a wandb run has): from the first timed step it is stopped, group and all, and uses no
    CPU; once training ends it runs again."""
    from fsdp_exp.rank.trace_held import TraceHeld

    busy = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']); \nwhile True: pass"
    trace = subprocess.Popen([sys.executable, "-c", busy], start_new_session=True)
    try:
        time.sleep(0.5)
        held = TraceHeld(trace.pid, first_timed=3)
        held.before_step(2)  # a warm-up step: the trace runs beside it
        assert state(trace.pid) == "R"
        held.before_step(3)
        time.sleep(0.2)
        before = cpu_ticks(trace.pid)
        time.sleep(1.0)
        assert state(trace.pid) == "T" and cpu_ticks(trace.pid) == before
        (child,) = Path(f"/proc/{trace.pid}/task/{trace.pid}/children").read_text().split()
        assert state(int(child)) == "T"
        assert held.figures(Summary()) == {"estimate_trace_held": True}  # training ended: it goes on
        time.sleep(0.5)
        assert state(trace.pid) in "RS" and cpu_ticks(trace.pid) > before
    finally:
        os.killpg(trace.pid, signal.SIGKILL)
        trace.wait()


def hashed(folder: Path) -> dict[str, str]:
    """Every file under `folder`, by path, with a hash of its bytes."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_a_setups_first_run_waits_for_its_trace_and_its_next_run_has_it_at_once(tmp_path: Path) -> None:
    """The default path, the estimate on, a run shorter than its trace: rank 0 held the trace
    from the first timed step and, the last step measured, waited for it, saying so. The
    summary has the estimate; no process the command started is alive when it exits, and no
    file it wrote changes after. The setup's next run (another length and seed) starts no trace
    and has the estimate at once."""
    out = tmp_path / "run"
    result, left = run_and_list_left(*RUN, "train.steps=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert left == []
    at_exit = hashed(out)
    summary = read_json(out / "summary.json")
    assert summary["estimate_trace_held"] is True and "estimate" not in summary, summary
    assert summary["estimated_peak_mem_gb"] > 0 and summary["estimate_ratio"] > 0 and "estimate_reused_from" not in summary
    if summary["estimate_wait_s"] > 0.5:  # a 2-core machine: the start-up and the warm-up left the trace too little
        assert "this setup's own estimate is still tracing" in result.stdout + result.stderr, result.stdout[-2000:]
    time.sleep(1)  # the slow test below waits 30 s
    assert hashed(out) == at_exit
    again = run_cli(*RUN, "train.steps=3", "seed=5", f"hydra.run.dir={tmp_path / 'again'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    later = read_json(tmp_path / "again" / "summary.json")
    assert later["estimate_wait_s"] < 0.5 and Path(later["estimate_reused_from"]).is_file(), later
    assert later["estimated_peak_mem_gb"] == summary["estimated_peak_mem_gb"]


@pytest.mark.slow
def test_the_default_command_leaves_nothing_running_and_nothing_changes_30_s_after(tmp_path: Path) -> None:
    """`python -m fsdp_exp` as typed (the default ViT, its estimate on, wandb offline): nothing
    it started is alive when it exits, and its run directory is the same 30 s later."""
    out = tmp_path / "run"
    result, left = run_and_list_left(f"hydra.run.dir={out}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert left == []
    at_exit = hashed(out)
    assert read_json(out / "summary.json")["status"] == "ok" and any(f.startswith("wandb/") for f in at_exit)
    time.sleep(30)
    assert hashed(out) == at_exit


def test_a_kept_estimate_is_one_setups_an_edited_model_or_another_setting_is_traced_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key of a kept estimate (fsdp_exp.estimate.earlier) moves with every setting the
    estimate reads and with the source of the user's model, not with those it does not read."""
    user_package(tmp_path, monkeypatch, "kept_net", "from tests.test_estimate import linear_stack as net\n")
    setup = [o.replace("tests.test_estimate.linear_stack", "kept_net.net") for o in STACK]

    def key(*overrides: str) -> str:
        exp = prepare(compose_checked([*setup, *overrides]), 0).exp
        return setup_key(exp, 2, None, on_gpu=False)

    first = key()
    assert key("train.steps=9", "seed=4", "metrics.warmup_steps=2", "memory.estimate=false", "wandb.project=x") == first
    moved = [key("train.batch_size=3"), key("sharding=ddp"), key("wandb.mode=offline")]
    assert len({first, *moved}) == 1 + len(moved)
    exp = prepare(compose_checked(setup), 0).exp
    assert setup_key(exp, 4, None, on_gpu=False) != first and setup_key(exp, 2, 1, on_gpu=False) != first
    assert setup_key(exp, 2, None, on_gpu=True) != first  # a GPU run never reads a CPU run's estimate
    (tmp_path / "kept_net.py").write_text("from tests.test_estimate import linear_stack as net  # edited\n")
    assert key() != first


def test_task_estimate_of_a_runs_setup_is_kept_for_its_runs(tmp_path: Path) -> None:
    """task=estimate at the run's own batch (no task.batch_sizes, no task.gpu) keeps its
    record for the setup: a training run of it starts no trace and reads that record. With
    other batch sizes, a GPU named or a baseline given it keeps nothing."""
    def kept(*overrides: str) -> str | None:
        plan = prepare(compose_checked([*STACK, "task=estimate", *overrides]), 0)
        return plan.exp.task.kept_as(plan.exp, plan.nproc, 2)

    assert kept() is not None and kept("task.batch_sizes=[2,4]") is None and kept("task.gpu=L4") is None
    result = run_cli("task=estimate", *STACK, f"hydra.run.dir={tmp_path / 'one'}", cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    (run := tmp_path / "run").mkdir()
    beside = EstimateBeside(prepare(compose_checked([*STACK, "train.steps=9"]), 0).exp, 2, run, ranks_per_node=2)
    assert beside.process is None
    assert read_json(beside.path)["peak_mem_gb"] == read_json(tmp_path / "one" / ESTIMATE_FILE)["peak_mem_gb"] > 0
