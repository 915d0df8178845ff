"""Ctrl-C (SIGINT, to the command or to its whole process group, as a terminal sends it)
and SIGTERM (kill, SLURM) on a running command: one line, exit 128 + the signal, the run's
summary.json with status "interrupted" and the last step logged, the metrics written so
far kept, and no rank left running. Real commands, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL_VIT, read_json, read_jsonl, rank_pid, wait_for_step

# Trains far longer than any test waits: only the signal ends it.
ENDLESS = [*SMALL_VIT, "train.steps=100000", "train.log_every=1", "train.batch_size=8"]


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`python -m fsdp_exp ARGS` in a session of its own, so that its process group holds
    only the command and what it starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    return subprocess.Popen([sys.executable, "-m", "fsdp_exp", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def live_in_group(pgid: int) -> list[int]:
    """The processes of a process group that have not ended (zombies left out)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


command_took: list[float] = []  # seconds from each signal stop_at_step sent to the command's end


def stop_at_step(command: subprocess.Popen, run_dir: Path, signum: int, group: bool, at_step: int = 2
                 ) -> tuple[int, str, str, list[int]]:
    """Once `run_dir` has logged `at_step`, send `signum` to the command (or to its process
    group); the step logged then, the command's stdout and stderr, and its ranks' pids."""
    step = wait_for_step([command], [run_dir], at_step)
    assert step is not None, command.communicate(timeout=60)
    ranks = [rank_pid(run_dir / f"rank{r}.log") for r in (0, 1)]
    sent = time.monotonic()
    (os.killpg if group else os.kill)(command.pid, signum)
    try:
        out, err = command.communicate(timeout=120)
        command_took.append(time.monotonic() - sent)
    except subprocess.TimeoutExpired:
        os.killpg(command.pid, signal.SIGKILL)  # leave nothing training behind the failed test
        out, err = command.communicate()
        pytest.fail(f"the command went on after {signal.Signals(signum).name}: {err[-2000:]}")
    return step, out, err, ranks


def assert_stopped(command: subprocess.Popen, run_dir: Path, signalled_at: int, out: str, err: str,
                   ranks: list[int], name: str) -> None:
    """What a user must see after the signal: one line, the exit code, the summary, the
    metrics kept, no rank left."""
    assert command.returncode == 128 + signal.Signals[name], (command.returncode, err[-3000:])
    console = (out + err).splitlines()
    assert "Traceback" not in err and "SignalException" not in out + err, err[-3000:]
    said = [line for line in console if "interrupted" in line]
    assert len(said) == 1, said
    assert f"interrupted ({name}) after step " in said[0] and said[0].endswith(f"summary in {run_dir / 'summary.json'}")
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r]
    assert steps[:signalled_at] == list(range(1, signalled_at + 1)), "the steps logged before the signal are kept"
    summary = read_json(run_dir / "summary.json")
    assert (summary["status"], summary["signal"], summary["steps_done"]) == ("interrupted", name, steps[-1])
    # the figures so far, which compare shows marked interrupted
    assert summary["final_loss"] == read_jsonl(run_dir / "metrics.jsonl")[-1]["loss"] and summary["samples_per_s"] > 0
    assert f"after step {steps[-1]} of 100000;" in said[0]
    assert said[0] in (run_dir / "fsdp_exp.log").read_text(), "the run's log says it too"
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no rank outlives the command
    deadline = time.monotonic() + 15  # the rank server leaves once it sees the command gone
    while live_in_group(command.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_in_group(command.pid), "nothing the command started is left"


def stop_a_local_run(tmp_path: Path, sig: signal.Signals, group: bool) -> None:
    run_dir = tmp_path / "run"
    command = start(tmp_path, *ENDLESS, f"hydra.run.dir={run_dir}")
    started = time.monotonic()
    step, out, err, ranks = stop_at_step(command, run_dir, sig, group=group)
    assert_stopped(command, run_dir, step, out, err, ranks, sig.name)
    assert command_took[-1] <= 1.0, f"the command ended {command_took[-1]:.2f} s after {sig.name}"
    assert time.monotonic() - started > command_took[-1]


def test_ctrl_c_on_a_local_run_stops_it_with_a_summary(tmp_path: Path) -> None:
    stop_a_local_run(tmp_path, signal.SIGINT, group=True)


def ranks_gone_after(pids: list[int], since: float, timeout: float = 30) -> float:
    """Seconds from `since` (time.monotonic) until none of `pids` runs (a zombie has ended)."""
    while time.monotonic() - since < timeout:
        running = []
        for pid in pids:
            try:
                running.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")
            except OSError:
                running.append(False)
        if not any(running):
            break
        time.sleep(0.005)
    return time.monotonic() - since


@pytest.mark.slow
def test_ctrl_c_stops_the_ranks_and_the_command_within_a_second_every_time(tmp_path: Path) -> None:
    """20 tries, Ctrl-C (SIGINT to the process group, as a terminal sends it) at steps 1 to 5
    in turn, every other try with wandb logging offline (its default): each time both ranks
    and the command are gone within a second, with the summary and the exit code."""
    took = []
    for attempt in range(20):
        run_dir = tmp_path / f"run{attempt}"
        command = start(tmp_path, *ENDLESS, *(["wandb.mode=offline"] if attempt % 2 else []),
                        f"hydra.run.dir={run_dir}")
        step = wait_for_step([command], [run_dir], 1 + attempt % 5)
        assert step is not None, command.communicate(timeout=60)
        ranks = [rank_pid(run_dir / f"rank{r}.log") for r in (0, 1)]
        sent = time.monotonic()
        os.killpg(command.pid, signal.SIGINT)
        ranks_s = ranks_gone_after(ranks, sent)
        try:
            command.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(command.pid, signal.SIGKILL)
        took.append((round(ranks_s, 2), round(time.monotonic() - sent, 2)))
        assert command.returncode == 130 and read_json(run_dir / "summary.json")["status"] == "interrupted"
    assert all(ranks_s <= 1.0 and command_s <= 1.0 for ranks_s, command_s in took), took


@pytest.mark.slow
def test_sigterm_on_a_local_run_stops_it_with_a_summary(tmp_path: Path) -> None:
    stop_a_local_run(tmp_path, signal.SIGTERM, group=False)


@pytest.mark.slow
def test_ctrl_c_on_a_one_node_torchrun_run_stops_it_with_a_summary(tmp_path: Path) -> None:
    from tests.test_launch_torchrun import free_port

    run_dir = tmp_path / "run"
    command = start(tmp_path, *ENDLESS, "launcher=torchrun", f"launcher.rdzv_endpoint=localhost:{free_port()}",
                    f"hydra.run.dir={run_dir}")
    step, out, err, ranks = stop_at_step(command, run_dir, signal.SIGINT, group=False)
    assert_stopped(command, run_dir, step, out, err, ranks, "SIGINT")


@pytest.mark.slow
def test_ctrl_c_during_a_local_sweep_stops_the_sweep_with_a_summary(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = start(tmp_path, "-m", *ENDLESS, "train.lr=0.001,0.002", f"hydra.sweep.dir={sweep}")
    step, out, err, ranks = stop_at_step(command, sweep / "0", signal.SIGINT, group=True)
    assert_stopped(command, sweep / "0", step, out, err, ranks, "SIGINT")
    assert not (sweep / "1").exists(), "the sweep's next run does not start"


TUNE = ["task=tune", "model=cnn", "memory.limit_gb=0.6", "task.space.sharding=[full,ddp]",
        "task.space.offload=[false]", "wandb.mode=disabled"]


def wait_for_lines(command: subprocess.Popen, log: Path, text: str, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and command.poll() is None:
        if log.is_file() and log.read_text().count(text) >= count:
            return
        time.sleep(0.2)
    os.killpg(command.pid, signal.SIGKILL)
    pytest.fail(f"no {count} x {text!r} in {log}: {command.communicate()[1][-2000:]}")


@pytest.mark.slow
def test_ctrl_c_during_a_tunes_estimates_is_one_line_and_the_resumed_tune_traces_again(tmp_path: Path) -> None:
    """The tracing processes leave Ctrl-C to the tune: no traceback of theirs, no setup said
    to be untraceable; nothing of the interrupted traces is recorded, so the tune resumed in
    the same directory traces each setup again."""
    run_dir = tmp_path / "tune"
    command = start(tmp_path, *TUNE, f"hydra.run.dir={run_dir}")
    wait_for_lines(command, run_dir / "fsdp_exp.log", "started in", 2)
    time.sleep(2)  # the traces are under way (each takes about 9 s here)
    os.killpg(command.pid, signal.SIGINT)
    out, err = command.communicate(timeout=120)
    assert command.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "could not trace" not in out + err and "estimate: batch" not in (run_dir / "fsdp_exp.log").read_text()
    assert len(err.splitlines()) <= 3, err

    again = start(tmp_path, *TUNE, f"hydra.run.dir={run_dir}")
    wait_for_lines(again, run_dir / "fsdp_exp.log", "estimate: batch 1 ", 2)  # traced, not reused as failed
    os.killpg(again.pid, signal.SIGINT)
    again.communicate(timeout=120)
