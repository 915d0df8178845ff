"""launcher=torchrun: two "nodes" on this machine, one rank each, meet at a loopback
rendezvous and train the same as the local launcher's two ranks."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_exp.cli import precheck
from fsdp_exp.config import ConfigError
from tests.conftest import SMALL_VIT, read_json, read_jsonl, run_cli

RUN = [*SMALL_VIT, "train.steps=4", "train.log_every=1", "train.batch_size=8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


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
