"""Ranks are started by torch's elastic launcher, or by an external torchrun."""

from __future__ import annotations

import re

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_exp.launcher.core import RunFailed, rank_threads
from fsdp_exp.launcher.local import LocalLauncher
from tests import rank_tasks
from tests.conftest import REPO, SMALL_VIT, names, read_json, read_jsonl, run_cli

def test_local_launcher_returns_rank0_result(tmp_path: Path) -> None:
    result = LocalLauncher().launch(rank_tasks.report_rank, {"x": 1}, tmp_path, nproc=2)
    assert result == {"rank": 0, "world_size": 2, "x": 1}
    assert not (tmp_path / "launcher.log").exists(), "torch elastic said nothing worth a file"


def test_a_failing_rank_stops_the_run_within_seconds(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """... and torch elastic's own record of it (exit code, pid, traceback) is kept in the
    run's launcher.log, not shown on the console beside the run's one line."""
    start = time.perf_counter()
    with pytest.raises(RunFailed) as err:
        LocalLauncher().launch(rank_tasks.rank1_raises_while_rank0_waits, {}, tmp_path, nproc=2)
    assert time.perf_counter() - start < 30, "rank 0 stayed blocked in its collective"
    message = str(err.value)
    assert err.value.rank == 1 and err.value.log == tmp_path / "rank1.log" and "ValueError: boom on rank 1" in message
    assert str(err.value.log) in message and "\n" not in message
    elastic = (tmp_path / "launcher.log").read_text()
    assert "[torch.distributed.elastic." in elastic and "failed (exitcode: 1) local_rank: " in elastic
    assert "torch/distributed/elastic" not in capfd.readouterr().err


STUCK = """
import threading
from fsdp_exp.rank.worker import exit_if_stuck
exit_if_stuck(0.5)
threading.Event().wait()  # as a failed rank whose teardown blocks for good (gloo's destructor)
"""


def test_a_failed_rank_whose_teardown_blocks_ends_itself() -> None:
    """exit_if_stuck: a process that never returns ends with exit code 1 once the time is up."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", STUCK], timeout=60)
    assert done.returncode == 1 and time.perf_counter() - start < 30


OUT_OF_ROOM = """
import os, resource, sys, threading
from fsdp_exp import linux
from fsdp_exp.rank.worker import run_rank

before = resource.getrlimit(resource.RLIMIT_DATA)

def at_the_limit(cfg, run_dir):  # as a rank out of memory under its CPU limit
    linux.cap_data_segment(linux.proc_status()["VmData:"] * 1024 + 2**20)
    if cfg == "returns":
        return "its result"
    try:
        threading.Thread(target=print).start()
    except RuntimeError as err:
        print("no room:", err, flush=True)
    raise MemoryError("the rank's own error")

os.environ["RANK"] = "0"
try:
    run_rank(at_the_limit, "fails", sys.argv[1])
except MemoryError as err:
    room = threading.Thread(target=print, args=("room again",), kwargs={"flush": True})
    room.start()
    room.join()
    print("kept:", err, flush=True)
print("lifted:", resource.getrlimit(resource.RLIMIT_DATA) == before, flush=True)
print(run_rank(at_the_limit, "returns", sys.argv[1]), flush=True)
print("lifted:", resource.getrlimit(resource.RLIMIT_DATA) == before, flush=True)
"""


def test_a_rank_at_its_cpu_memory_limit_gets_its_error_and_result_out(tmp_path: Path) -> None:
    """Under a CPU memory.limit_gb a rank can end at the limit, with no room for what carries
    its error or result out: a thread (exit_if_stuck's), Ray's reply from its worker (without
    room, Ray reported the worker as dead: "killed by a signal"). run_rank lifts the limit, which
    has done its work, once its task ends, failed or not, in a process that no launcher of
    ours started (as Ray's and SLURM's)."""
    done = subprocess.run([sys.executable, "-c", OUT_OF_ROOM, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.stdout.splitlines() == ["no room: can't start new thread", "room again", "kept: the rank's own error",
                                        "lifted: True", "its result", "lifted: True"], done.stdout + done.stderr[-2000:]
    assert done.returncode == 0


def test_a_rank_ended_by_a_fatal_signal_is_named_and_its_log_keeps_its_python_stack(tmp_path: Path) -> None:
    with pytest.raises(RunFailed) as err:
        LocalLauncher().launch(rank_tasks.rank1_aborts, {}, tmp_path / "local", nproc=2)
    assert err.value.rank == 1 and "Signal 6 (SIGABRT)" in str(err.value), err.value
    assert "in rank1_aborts" in (tmp_path / "local" / "rank1.log").read_text()
    # A rank that no elastic agent started (an outside torchrun's, SLURM's, Ray's) alike
    script = ("import os, sys; from pathlib import Path; from fsdp_exp.rank.worker import setup_rank; "
              "from tests.rank_tasks import rank1_aborts; setup_rank(Path(sys.argv[1]), 1); rank1_aborts({}, None)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "plain")], env={**os.environ, "RANK": "1"},
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == -6 and done.stderr == ""
    log = (tmp_path / "plain" / "rank1.log").read_text()
    assert "Fatal Python error: Aborted" in log and "in rank1_aborts" in log, log


@pytest.mark.slow
def test_under_external_torchrun_each_process_is_one_rank(tmp_path: Path) -> None:
    """Rank 0 composes the config once and hands it to the other: a run directory named to
    the microsecond (${now:...} resolved at composition) is one directory, not one a rank."""
    result = run_cli(
        "--nproc_per_node=2", "-m", "fsdp_exp", *SMALL_VIT, "train.steps=3", "train.log_every=1",
        "memory.estimate=false", f"hydra.run.dir={tmp_path / 'run'}" + "-${now:%H-%M-%S-%f}",
        cwd=tmp_path, module=("-m", "torch.distributed.run"),
    )
    assert result.returncode == 0, result.stderr
    (out,) = tmp_path.glob("run-*")
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps"] == 3
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / ".hydra" / "config.yaml").exists()
    assert (out / "rank0.log").exists() and (out / "rank1.log").exists()
    assert [p.name for p in tmp_path.iterdir()] == [out.name], "both ranks must write one run directory"
    # The same driver code as a run the launcher starts: the same records in summary.json.
    ours = tmp_path / "ours"
    result = run_cli(*SMALL_VIT, "train.steps=3", "train.log_every=1", "memory.estimate=false",
                     f"hydra.run.dir={ours}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    launched = read_json(ours / "summary.json")
    assert set(summary) == set(launched) and set(summary["environment"]) == set(launched["environment"])
    assert summary["environment"]["device_seen_by"] == "rank 0" and summary["wall_s"] > 0
    assert summary["final_loss"] == pytest.approx(launched["final_loss"], abs=1e-6)


class DamagedAfterTheFirst(torch.utils.data.Dataset):
    """A user's data set whose first item loads (the driver checks it) and the rest do not."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple:
        if i:
            raise ValueError(f"sample {i} is damaged")
        return torch.zeros(1, 28, 28), 0


def damaged() -> DamagedAfterTheFirst:
    return DamagedAfterTheFirst()


def test_a_failing_run_exits_nonzero_with_one_error_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(
        *SMALL_VIT, "data=custom", f"data._target_={__name__}.damaged", f"hydra.run.dir={out}", cwd=tmp_path,
        extra_env={"PYTHONPATH": str(REPO)},
    )  # only a rank, reading its batches, finds out
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert re.search(r"rank \d failed: ValueError: .*sample \d+ is damaged", result.stderr + result.stdout)
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and "is damaged" in summary["error"]
    failed = re.search(r"rank (\d) failed", summary["error"]).group(1)
    assert "Traceback" in (out / f"rank{failed}.log").read_text(), "the rank's log keeps the traceback"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_start_from_the_rank_server_or_fresh_and_never_inherit_a_launch(tmp_path: Path, method: str) -> None:
    """Forked ranks come from the rank server, which imported torch once and never trains:
    a launch after one whose ranks filled memory starts as small as the first. Each rank
    gets its share of the cores either way."""
    import multiprocessing.forkserver
    import os

    launcher = LocalLauncher(start_method=method)
    first = launcher.launch(rank_tasks.report_process, {"hold_mb": 300}, tmp_path / "a", nproc=2)
    second = launcher.launch(rank_tasks.report_process, {}, tmp_path / "b", nproc=2)
    assert first["anon_mb_holding"] > first["anon_mb"] + 250  # the first launch really held it
    assert abs(second["anon_mb"] - first["anon_mb"]) < 50, (first, second)
    parent = multiprocessing.forkserver._forkserver._forkserver_pid if method == "forkserver" else os.getpid()
    assert first["parent"] == second["parent"] == parent
    assert first["threads"] == second["threads"] == rank_threads(2)


WORKER = """
import os, sys
from pathlib import Path
from fsdp_exp.commands import EndAtOnce
ending = EndAtOnce()  # as `python -m fsdp_exp` ends
from fsdp_exp.commands.experiment import compose_config
from fsdp_exp.driver.external_torchrun import run_as_worker

def counted(argv):
    Path(sys.argv[1], "composed_by_rank" + os.environ["RANK"]).touch()
    return compose_config(argv)

ending.code = run_as_worker(sys.argv[2:], counted)
sys.exit(ending.code)
"""


def two_ranks_of_an_outside_launcher(tmp_path: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """`python -m fsdp_exp ARGS` as two processes that an outside launcher (srun, mpirun, a
    torchrun without its agent's store) gave RANK, WORLD_SIZE and a MASTER_ADDR:PORT; each
    counts its own composing of the config in tmp_path."""
    (tmp_path / "worker.py").write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(tmp_path), *args], cwd=tmp_path,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "PYTHONPATH": os.pathsep.join(sys.path)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_outside_launched_ranks_compose_once_and_run_rank_0s_plan(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rank0, rank1 = two_ranks_of_an_outside_launcher(tmp_path, *SMALL_VIT, "train.steps=2", "train.log_every=1",
                                                    f"hydra.run.dir={out}")
    logs = "".join(p.read_text()[-2000:] for p in sorted(out.glob("rank*.log")))  # rank 1's stderr goes there
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr[-2000:] + rank1.stderr[-2000:] + logs
    assert sorted(p.name for p in tmp_path.glob("composed_by_rank*")) == ["composed_by_rank0"]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps"] == 2
    assert (out / "rank1.log").exists(), "rank 1 ran in rank 0's run directory"


def test_outside_launched_ranks_refuse_bad_input_in_one_line_from_rank_0(tmp_path: Path) -> None:
    rank0, rank1 = two_ranks_of_an_outside_launcher(tmp_path, *SMALL_VIT, "train.steps=0")
    assert (rank0.returncode, rank1.returncode) == (2, 2)
    names(rank0.stderr, "train.steps=0", "at least 1")
    assert rank1.stderr.strip() == "" and not list(tmp_path.glob("outputs"))
    assert sorted(p.name for p in tmp_path.glob("composed_by_rank*")) == ["composed_by_rank0"]


def ranks_handler_after_its_task(run_dir: str, sent) -> None:  # noqa: ANN001 - a multiprocessing child
    import signal

    from fsdp_exp.rank.worker import run_rank

    os.environ["RANK"] = "0"
    # Ctrl-C raising KeyboardInterrupt, as in a rank forked from the rank server: a forkserver
    # passes on how SIGINT was handled where it was started, which another test may have left
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_rank(lambda cfg, path: None, None, run_dir)
    sent.send(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


def test_a_rank_whose_work_is_done_ignores_a_second_ctrl_c(tmp_path: Path) -> None:
    """A rank of launcher=local waits, once its task has returned, for the launcher to read
    what it returned; the user's Ctrl-C passed on again then must not print multiprocessing's
    KeyboardInterrupt traceback (seen once in test_interrupt under load)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    received, sent = context.Pipe(duplex=False)
    process = context.Process(target=ranks_handler_after_its_task, args=(str(tmp_path), sent))
    process.start()
    assert received.recv() is True
    process.join(30)
    assert process.exitcode == 0
