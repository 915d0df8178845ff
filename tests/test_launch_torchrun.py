"""launcher=torchrun: two "nodes" on this machine, one rank each, meet at a loopback
rendezvous and train the same as the local launcher's two ranks, also across a restart."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL_VIT, precheck, read_json, read_jsonl, run_cli, signal_at_step
from fsdp_exp.errors import ConfigError

RUN = [*SMALL_VIT, "train.steps=4", "train.log_every=1", "train.batch_size=8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_meet_and_train_like_the_local_launcher(tmp_path: Path) -> None:
    nodes = [*RUN, "launcher=torchrun", "launcher.nnodes=2", "launcher.nproc_per_node=1",
             f"launcher.rdzv_endpoint=localhost:{free_port()}", "launcher.rdzv_id=two_nodes",
             "checkpoint=dcp", "checkpoint.every=2"]
    procs = [subprocess.Popen([sys.executable, "-m", "fsdp_exp", *nodes, f"hydra.run.dir={tmp_path / f'node{n}'}"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # The rendezvous decides which node holds rank 0: that node's directory has the run.
    main = [tmp_path / f"node{n}" for n in (0, 1) if (tmp_path / f"node{n}" / "metrics.jsonl").is_file()]
    assert len(main) == 1, "exactly one node writes metrics.jsonl"
    other = ({tmp_path / "node0", tmp_path / "node1"} - set(main)).pop()
    assert (other / "rank1.log").is_file() and not (other / "checkpoints").exists()
    assert sorted(p.name for p in (main[0] / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert read_json(main[0] / "summary.json")["world_size"] == 2

    local = tmp_path / "local"
    result = run_cli(*RUN, f"hydra.run.dir={local}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    want = [r["loss"] for r in read_jsonl(local / "metrics.jsonl")]
    got = [r["loss"] for r in read_jsonl(main[0] / "metrics.jsonl")]
    assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.slow
def test_a_node_left_alone_gives_up_after_the_rendezvous_timeout(tmp_path: Path) -> None:
    result = run_cli(*RUN, "launcher=torchrun", "launcher.nnodes=2", "launcher.rdzv_timeout=5",
                     f"launcher.rdzv_endpoint=localhost:{free_port()}", cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no rendezvous of launcher.nnodes=2 within launcher.rdzv_timeout=5 s" in result.stdout + result.stderr


@pytest.mark.parametrize("args,message", [
    (["launcher.nnodes=0"], "launcher.nnodes=0: a node count, or min:max"),
    (["launcher.nnodes=3:1"], "launcher.nnodes=3:1: a node count, or min:max"),
    (["launcher.rdzv_endpoint=nohost"], "launcher.rdzv_endpoint=nohost: must be host:port"),
    (["launcher.nnodes=2", "task=max_batch", "memory.limit_gb=1"],
     "launcher.nnodes=2: with launcher=torchrun each node's command would search on its own"),
])
def test_bad_torchrun_settings_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        precheck([*SMALL_VIT, "launcher=torchrun", *args])


@pytest.mark.slow
def test_a_killed_rank_on_one_node_restarts_both_nodes_from_the_latest_checkpoint(tmp_path: Path) -> None:
    """Only the killed rank's agent counts a restart; the other node's agent joins the new
    round. Both nodes' ranks must meet in a fresh store, not in the one of the old ranks."""
    run = [*SMALL_VIT, "train.steps=24", "train.log_every=1", "train.batch_size=8", "checkpoint=dcp",
           "checkpoint.every=6"]
    nodes = [*run, "launcher=torchrun", "launcher.nnodes=2", "launcher.nproc_per_node=1", "launcher.max_restarts=1",
             f"launcher.rdzv_endpoint=localhost:{free_port()}", "launcher.rdzv_id=restart"]
    dirs = [tmp_path / f"node{n}" for n in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "fsdp_exp", *nodes, f"hydra.run.dir={d}"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for d in dirs]
    try:
        killed_at = signal_at_step(procs, dirs, 8, {1: signal.SIGKILL})
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert killed_at is not None and killed_at < 24, f"rank 1 was not killed mid-run: {killed_at}"
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outputs]
    main = next(d for d in dirs if (d / "metrics.jsonl").is_file())
    events = [r for r in read_jsonl(main / "metrics.jsonl") if r.get("event") == "resumed"]
    assert len(events) == 1 and events[0]["step"] in range(6, killed_at + 1, 6), events

    local = tmp_path / "local"
    result = run_cli(*run, f"hydra.run.dir={local}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_json(main / "summary.json")["final_loss"] == pytest.approx(
        read_json(local / "summary.json")["final_loss"], abs=1e-6)
