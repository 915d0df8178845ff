"""The launch core every launcher shares: which rank's failure explains a launch, the
console echo, the watchdog, the rank count and a rank's restart count. The launchers' own
tests (test_launch*.py) start real ranks that fail for real; here the outcomes are the ones
they turn their native results into."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from fsdp_exp.launcher.core import (
    CPU_RANKS,
    Alongside,
    Echo,
    RankOutcome,
    alongside,
    explain,
    ranks_per_node,
    watch,
)
from fsdp_exp.rank import worker

RUN = Path("/runs/one")
OOM = "OutOfMemory: ran out of memory under memory.limit_gb=0.6: DefaultCPUAllocator: can't allocate memory"
PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
BOOM = "ValueError: boom on rank 1"


def test_an_out_of_memory_explains_the_launch_before_anything_else() -> None:
    failed = explain([RankOutcome(0, error=BOOM, ended=10.0), RankOutcome(1, error=OOM, ended=12.0),
                      RankOutcome(2, signal="SIGKILL", ended=9.0)], RUN)
    assert str(failed) == f"rank 1 failed: {OOM} (log: /runs/one/rank1.log)"
    assert failed.out_of_memory and not failed.timed_out and failed.killed_by is None


def test_the_earliest_error_of_its_own_comes_before_a_signal_and_before_a_lost_peer() -> None:
    failed = explain([RankOutcome(0, error=PEER, ended=5.0), RankOutcome(1, error=BOOM, ended=7.0),
                      RankOutcome(2, error="KeyError: 'x'", ended=8.0), RankOutcome(3, signal="SIGTERM", ended=6.0)], RUN)
    assert str(failed) == f"rank 1 failed: {BOOM} (log: /runs/one/rank1.log)"
    assert not failed.out_of_memory and failed.killed_by is None


def test_a_rank_killed_from_outside_explains_the_errors_of_the_peers_it_left() -> None:
    killed = "died: its process ended without an error (killed by a signal, or its node was lost)"
    failed = explain([RankOutcome(0, error=PEER), RankOutcome(1, signal="signal", how=killed)], RUN)
    assert failed.rank == 1 and failed.log == RUN / "rank1.log" and killed in str(failed)
    assert failed.killed_by == "signal" and not failed.timed_out
    plain = explain([RankOutcome(0, signal="SIGKILL")], RUN)
    assert (plain.rank, plain.killed_by, plain.log) == (0, "SIGKILL", RUN / "rank0.log")
    only_peers = explain([RankOutcome(1, error=PEER, ended=3.0), RankOutcome(0, error=PEER, ended=2.0)], RUN)
    assert str(only_peers).startswith("rank 0 failed: RuntimeError: ")
    # torch elastic reports one failure: a rank left by a peer that was killed, the peer unseen
    assert only_peers.killed_by == "signal" and not only_peers.timed_out


def test_a_rank_past_the_time_limit_is_timed_out_unless_an_error_came_first() -> None:
    # torch elastic: the rank's own SIGALRM, no start time known
    alarm = explain([RankOutcome(1, signal="SIGALRM", ended=20.0)], RUN, time_limit_s=5)
    assert alarm.rank == 1 and alarm.log == RUN / "rank1.log" and str(alarm).startswith("rank 1 ") and "5 s" in str(alarm)
    assert alarm.timed_out and alarm.killed_by == "SIGALRM"
    # submitit: no result from a rank that ran longer than the limit
    late = RankOutcome(0, signal="signal", started=100.0)
    assert explain([late], RUN, time_limit_s=5, now=106.0).timed_out
    assert not explain([late], RUN, time_limit_s=5, now=103.0).timed_out  # ended sooner: killed, not late
    # an error before the limit ran out is the cause; one after it is not
    before = RankOutcome(1, error=BOOM, ended=103.0)
    after = RankOutcome(1, error=BOOM, ended=107.0)
    assert str(explain([late, before], RUN, time_limit_s=5, now=108.0)).startswith("rank 1 failed: ValueError")
    assert explain([late, after], RUN, time_limit_s=5, now=108.0).timed_out


def test_a_rank_the_driver_had_to_stop_says_so() -> None:
    failed = explain([RankOutcome(0, signal="SIGKILL", started=1.0)], RUN, time_limit_s=2, stopped_for_time=True)
    assert failed.rank == 0 and failed.log == RUN / "rank0.log" and "the driver stopped it" in str(failed)
    assert failed.timed_out and failed.killed_by == "SIGKILL"


def test_explain_needs_a_failed_rank() -> None:
    with pytest.raises(AssertionError):
        explain([RankOutcome(0), RankOutcome(1)], RUN)


def test_the_echo_shows_rank_0s_console_lines_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = tmp_path / "rank0.log"
    log.write_bytes(b"old line, before the launch\n")
    echo = Echo(log, log.stat().st_size)
    with open(log, "ab") as f:
        f.write(b"[10:00:00][rank0][INFO] rank 0 is pid 42 on host\n"
                b"[10:00:01][rank0][INFO] step 1 loss 2.3\n"
                b"[10:00:01][rank0][WARNING] torch warned: /x/torch/autograd/graph.py:829: UserWarning: Grad strides\n"
                b"  return Variable._execution_engine.run_backward(\n"
                b"submitit INFO (2026-11-23) - Starting with JobEnvironment\n"
                b"[10:00:02][rank0][ERROR] this rank failed\n"
                b"Traceback (most recent call last):\n"
                b"ValueError: boom\n"
                b"[10:00:03][rank0][WARNING] step 2 slow\n"
                b"half a li")
    echo.poll()
    assert capsys.readouterr().out == "[10:00:01][rank0][INFO] step 1 loss 2.3\n[10:00:03][rank0][WARNING] step 2 slow\n"
    with open(log, "ab") as f:
        f.write(b"ne")
    echo.poll(final=True)
    assert capsys.readouterr().out == "half a line\n"


def test_the_watchdog_stops_ranks_past_the_limit_and_on_ctrl_c(tmp_path: Path) -> None:
    stops: list[str] = []
    echo = Echo(tmp_path / "rank0.log")
    # started long ago, past limit and grace: stopped at once
    assert watch(lambda: False, echo, lambda: time.time() - 100, lambda: stops.append("time"), time_limit_s=1,
                 state=str)
    # still within the limit: watched until done
    polls = iter([False, False, True])
    assert not watch(lambda: next(polls), echo, lambda: time.time(), lambda: stops.append("never"), time_limit_s=60,
                     state=str)

    def interrupted() -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        watch(interrupted, echo, lambda: None, lambda: stops.append("ctrl-c"), time_limit_s=None, state=str)
    assert stops == ["time", "ctrl-c"]


def test_a_run_beside_others_logs_its_state_changes_and_stops_with_the_sweep(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    log = tmp_path / "rank0.log"
    log.write_text("[10:00:01][rank0][INFO] step 1 loss 2.3\n")
    run = Alongside("run 1 (sharding=full)", threading.Event())
    states = iter(["job 7 PENDING", "job 7 PENDING", "job 7 RUNNING", "job 7 RUNNING"])
    polls = iter([False, False, False, True])
    token = alongside.set(run)
    try:
        with caplog.at_level(logging.INFO, logger="fsdp_exp"):
            assert not watch(lambda: next(polls), Echo(log), lambda: None, lambda: None, None, lambda: next(states))
        assert [r.getMessage() for r in caplog.records] == ["job 7 PENDING", "job 7 RUNNING"]
        assert capsys.readouterr().out == "", "no rank lines: they would interleave with the other runs'"
        stops: list[str] = []
        run.stop.set()  # Ctrl-C on the command
        with pytest.raises(KeyboardInterrupt):
            watch(lambda: False, Echo(log), lambda: None, lambda: stops.append("stopped"), None, lambda: "running")
        assert stops == ["stopped"]
    finally:
        alongside.reset(token)


def test_auto_is_one_rank_per_gpu_or_two_on_cpu() -> None:
    assert ranks_per_node("auto", 0) == CPU_RANKS == 2
    assert ranks_per_node("auto", 8) == 8
    assert ranks_per_node(3, 8) == 3


def test_a_rank_knows_its_restarts_from_any_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FSDP_EXP_RESTARTS", "FSDP_EXP_RESTORED", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert worker.restarts() == (0, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # torch elastic's agent
    assert worker.restarts() == (2, None)
    variables = worker.rank_variables(1, 1, 2, 2, master_addr="node0", master_port=29500, restarts=3,
                                      restored="/ray/step_4")
    assert variables == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "FSDP_EXP_RESTARTS": "3",
                         "FSDP_EXP_RESTORED": "/ray/step_4"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert worker.restarts() == (3, "/ray/step_4")  # the launcher's own count wins
