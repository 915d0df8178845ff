"""launcher=ray: the ranks as Ray Train workers, on a real local Ray with 2 CPU workers.

The fast tests start their own local Ray (`launcher.address=null`, the default) or none;
the slow ones join one Ray cluster that this module starts once (`cluster`), as a
user's `launcher.address=host:port` would, which saves a Ray start per test.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from fsdp_exp.checkpoint.files import step_name
from tests.conftest import SMALL_VIT, names, rank_pid, read_json, read_jsonl, refused_here, run_cli

RAY = ["launcher=ray"]
# 4 steps, a record and a checkpoint every 2: the Ray run reports 4 records and 2 checkpoints.
SHORT = [*SMALL_VIT, "train.steps=4", "train.log_every=1", "checkpoint=dcp", "checkpoint.every=2"]
# Ray's clients must present the cluster's token (Ray enables token authentication on the
# clusters ray.init starts; it keeps the token in ~/.ray/auth_token).
AUTH = {"RAY_AUTH_MODE": "token"}


def losses(run: Path) -> dict[int, float]:
    """Step -> loss; a resumed run's later record of a step wins."""
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def ray_copies(run: Path) -> list[str]:
    """The checkpoints Ray holds in its storage (<run>/ray/<run name>/step_*), complete ones."""
    return sorted(p.parent.name for p in (run / "ray").glob("*/step_*/.metadata"))


def ray_registered(run: Path) -> list[str]:
    """The checkpoints Ray Train's controller has registered (what `get_checkpoint` offers)."""
    names = []
    for snapshot in (run / "ray").glob("*/checkpoint_manager_snapshot.json"):
        try:
            names += [r["checkpoint_dir_name"] for r in read_json(snapshot)["checkpoint_results"]]
        except ValueError:  # being rewritten
            pass
    return sorted(names)


# Probes of 500 steps, whatever their size: each runs past a 1 s task.probe_timeout (a probe of the
# default 3 steps, forked from the rank server, can end inside it)
LONG_PROBES = ("task.steps_per_probe=500", "task.settle_steps=500")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray cluster with 2 CPUs, held by a process of its own, for the tests that
    join one; its address. It ends when that process's stdin closes, however the tests end."""
    script = textwrap.dedent("""
        import logging, sys, ray
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        print(ray.get_runtime_context().gcs_address, flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd=tmp_path_factory.mktemp("cluster"),
                              env={**os.environ, **AUTH})
    try:
        address = holder.stdout.readline().strip()
        assert re.fullmatch(r"[\w.\-]+:\d+", address), f"no Ray cluster started: {address!r}"
        yield address
    finally:
        holder.stdin.close()  # ray.shutdown() at its exit stops the cluster's processes
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


@pytest.mark.slow
def test_a_run_matches_launcher_local_and_fills_the_run_directory(tmp_path: Path) -> None:
    """Same seed, same data, same losses; the Ray run is a run like any other."""
    with ThreadPoolExecutor(2) as pool:  # both at once: a local Ray takes tens of seconds to start
        on_ray = pool.submit(run_cli, *SHORT, *RAY, f"hydra.run.dir={tmp_path / 'ray'}", cwd=tmp_path, timeout=280)
        local = pool.submit(run_cli, *SHORT, f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path, timeout=280)
        on_ray, local = on_ray.result(), local.result()
    assert local.returncode == 0, local.stderr[-3000:]
    assert on_ray.returncode == 0, on_ray.stdout[-3000:] + on_ray.stderr[-3000:]
    run = tmp_path / "ray"
    summary = read_json(run / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps"] == 4
    assert sorted(losses(run)) == [1, 2, 3, 4]
    want = losses(tmp_path / "local")
    for step, loss in losses(run).items():
        assert abs(loss - want[step]) <= 1e-6, (step, loss, want[step])
    assert abs(summary["final_loss"] - read_json(tmp_path / "local" / "summary.json")["final_loss"]) <= 1e-6
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "rank0.log").is_file() and (run / "rank1.log").is_file()
    assert "rank 1 is pid" in (run / "rank1.log").read_text()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    # Every committed checkpoint went through Ray: its copies in Ray's storage, complete.
    assert ray_copies(run) == ray_registered(run) == ["step_00000002", "step_00000004"]
    assert not (run / "checkpoints" / ".ray_upload").exists(), "the upload snapshots are removed"
    # The console shows rank 0's lines as launcher=local does, without Ray's own.
    assert "step 4/4" in on_ray.stdout and "summary.json" in on_ray.stdout
    assert "Reporting training result" not in on_ray.stdout + (run / "rank0.log").read_text()
    assert "Traceback" not in on_ray.stdout + on_ray.stderr


def test_without_ray_installed_launcher_ray_names_the_extra(tmp_path: Path) -> None:
    """`import ray` fails as when the package is not installed."""
    out = tmp_path / "run"
    result = refused_here(*RAY, *SMALL_VIT, f"hydra.run.dir={out}", cwd=tmp_path, missing=("ray",))
    assert result.returncode == 2, result.stdout + result.stderr
    names(result.stderr, "launcher=ray", "ray[train]", "pip install -e .[ray]")
    assert not out.exists(), "refused before any output directory"


@pytest.mark.slow
def test_an_address_where_no_ray_answers_fails_within_start_timeout(tmp_path: Path) -> None:
    """A port that accepts connections and never answers: Ray itself would retry for minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        out = tmp_path / "run"
        start = time.monotonic()
        result = run_cli(*RAY, *SMALL_VIT, f"launcher.address={address}", "launcher.start_timeout=3",
                         f"hydra.run.dir={out}", cwd=tmp_path, timeout=120)
        elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    message = f"launcher.address={address}: no Ray cluster answered within launcher.start_timeout=3 s"
    assert message in result.stdout + result.stderr
    assert elapsed < 45, f"{elapsed:.0f} s: the start timeout was not kept"
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and summary["error"].startswith(message)
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_with_its_error(tmp_path: Path, cluster: str) -> None:
    out = tmp_path / "run"
    result = run_cli(*RAY, f"launcher.address={cluster}", *SMALL_VIT, "data=fashion_mnist",
                     f"data.root={tmp_path / 'empty'}", f"hydra.run.dir={out}", cwd=tmp_path, extra_env=AUTH)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "rank 0 failed: ConfigError: data.root=" in result.stdout + result.stderr
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and "data.download=true" in summary["error"]
    assert f"(log: {out / 'rank0.log'})" in summary["error"]
    assert "Traceback" in (out / "rank0.log").read_text(), "the rank's log keeps the traceback"


STEPS, HOLD = 24, 10
# A checkpoint at every step; the ranks' data set (16 samples a step, and a few read before
# training) holds them in step HOLD + 1 until the test opens its gate: the window for the
# kill, whatever the machine's speed.
RESTART = [*SMALL_VIT, f"train.steps={STEPS}", "train.log_every=1", "train.batch_size=16", "train.lr_schedule=cosine",
           "checkpoint=dcp", "checkpoint.every=1", "checkpoint.keep=30", "data=custom", "data._target_=gate.Gated",
           f"+data.hold_after={HOLD * 16 + 8}", "data.num_workers=0"]
GATE = '''
    """A user's own data set: fsdp_exp's synthetic images, read through a gate. A process
    that has read `hold_after` items waits, before the next, until the file `gate` is there."""
    import os, time
    from torch.utils.data import Dataset
    from fsdp_exp.data.images import SyntheticImages

    class Gated(Dataset):
        def __init__(self, hold_after: int, gate: str):
            self.images = SyntheticImages(num_samples=2000).dataset()
            self.hold_after, self.gate, self.read = hold_after, gate, 0

        def __len__(self):
            return len(self.images)

        def __getitem__(self, index):
            while self.read >= self.hold_after and not os.path.exists(self.gate):
                time.sleep(0.05)
            self.read += 1
            return self.images[index]
    '''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_restarts_from_rays_latest_checkpoint_and_ends_the_same(
        tmp_path: Path, cluster: str) -> None:
    """The ranks commit a checkpoint at each of steps 1-10, then wait at the gate. Ray must
    register the newest (step 10) while they wait, having skipped some of those training
    outran (one report per round of Ray's 2 s poll). Rank 1 is killed there; the gate opens;
    Ray restarts the workers from its step 10 and the run ends as one never killed."""
    (tmp_path / "gate.py").write_text(textwrap.dedent(GATE))
    gate = tmp_path / "open"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run, with launcher=local meanwhile
        (tmp_path / "always_open").touch()
        reference = pool.submit(run_cli, *RESTART, f"+data.gate={tmp_path / 'always_open'}",
                                f"hydra.run.dir={tmp_path / 'reference'}", cwd=tmp_path, timeout=300)
        out = tmp_path / "killed"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
        run = subprocess.Popen(
            [sys.executable, "-m", "fsdp_exp", *RAY, f"launcher.address={cluster}", "launcher.max_failures=1",
             *RESTART, f"+data.gate={gate}", f"hydra.run.dir={out}"],
            cwd=tmp_path, env={**env, **AUTH}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        registered: list[str] = []
        newest = step_name(HOLD)
        try:
            deadline = time.monotonic() + 300
            while newest not in registered and time.monotonic() < deadline and run.poll() is None:
                time.sleep(0.1)
                registered = ray_registered(out)
            steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
            reported = re.findall(r"checkpoint (step_\d+) reported to Ray Train", (out / "rank0.log").read_text())
            if newest in registered:
                os.kill(rank_pid(out / "rank1.log"), signal.SIGKILL)
            gate.touch()
            output = run.communicate(timeout=300)[0]
        finally:
            run.kill()
        reference = reference.result()
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert newest in registered, f"Ray registered {registered} while the ranks waited after step {HOLD}"
    assert max(steps) == HOLD, steps  # the gate held them
    assert len(reported) < HOLD, f"every checkpoint was reported in turn: {reported}"
    assert run.returncode == 0, output[-3000:]
    assert "restart 1 of the ranks" in (out / "rank0.log").read_text()
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "resumed"]
    assert len(events) == 1, events
    resumed = Path(events[0]["checkpoint"])  # Ray's copy of step 10
    assert resumed.parent.parent == out / "ray" and resumed.name == newest and events[0]["step"] == HOLD, events
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    want = losses(tmp_path / "reference")
    for step, loss in losses(out).items():
        assert abs(loss - want[step]) <= 1e-6, (step, loss, want[step])
    final = read_json(out / "summary.json")
    assert final["status"] == "ok" and final["resumed_from_step"] == HOLD
    assert abs(final["final_loss"] - read_json(tmp_path / "reference" / "summary.json")["final_loss"]) <= 1e-6


@pytest.mark.slow
def test_a_rank_out_of_memory_under_a_cpu_limit_makes_the_run_an_oom(tmp_path: Path, cluster: str) -> None:
    """The worker ran out of memory at its CPU limit, with no room left for Ray's reply: the
    rank lifts the limit once it failed, so that its own error reaches the driver (before, Ray
    reported the worker as dead, "killed by a signal", and a search tried the size again)."""
    out = tmp_path / "run"
    result = run_cli(*RAY, f"launcher.address={cluster}", "launcher.num_workers=1", "model=cnn", "sharding=grad_op",
                     "memory.limit_gb=0.6", "train.batch_size=127", "train.steps=2", "wandb.mode=disabled",
                     f"hydra.run.dir={out}", cwd=tmp_path, extra_env=AUTH)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "oom", summary
    assert summary["error"].startswith("rank 0 failed: OutOfMemory: ran out of memory under memory.limit_gb=0.6")
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_probe_past_its_timeout_is_ended_and_recorded_as_timed_out(tmp_path: Path, cluster: str) -> None:
    """run_rank's SIGALRM ends the Ray worker although Ray runs the task in a thread."""
    run_dir = tmp_path / "search"
    start = time.monotonic()
    result = run_cli(*RAY, f"launcher.address={cluster}", "task=max_batch", "memory.limit_gb=0.6", *SMALL_VIT,
                     "task.probe_timeout=1", *LONG_PROBES, f"hydra.run.dir={run_dir}", cwd=tmp_path, extra_env=AUTH)
    assert time.monotonic() - start < 200
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "batch 1 does not train: ran past task.probe_timeout=1 s" in result.stdout
    # The estimate's first size, then the smallest, which ran past it. A Ray worker holds some
    # 70 MB that the estimate does not count (docs/clusters.md, "Known limits"): at the
    # estimate's size a rank can reach memory.limit_gb before its second has passed, an oom,
    # as a run of it would.
    *first, smallest = read_json(run_dir / "max_batch.json")["probes"]
    assert smallest["batch_size"] == 1 and smallest["status"] == "failed" and smallest["timed_out"]
    assert "task.probe_timeout=1" in smallest["reason"] and len(first) <= 1
    for probe in first:
        timed_out = probe["status"] == "failed" and probe["timed_out"] and "task.probe_timeout=1" in probe["reason"]
        assert timed_out or (probe["status"] == "oom" and not probe["timed_out"]), probe
    assert read_json(run_dir / "summary.json")["status"] == "failed"


@pytest.mark.slow
def test_workers_the_cluster_cannot_place_fail_the_run_instead_of_waiting(tmp_path: Path, cluster: str) -> None:
    """3 workers of 1 CPU on a cluster of 2 CPUs: Ray Train would retry forever."""
    out = tmp_path / "run"
    result = run_cli(*RAY, f"launcher.address={cluster}", "launcher.num_workers=3", *SMALL_VIT,
                     f"hydra.run.dir={out}", cwd=tmp_path,
                     extra_env={**AUTH, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    message = "launcher=ray: the Ray cluster cannot place 3 worker(s) with {'CPU': 1.0} each"
    assert message in result.stdout + result.stderr
    assert read_json(out / "summary.json")["error"].startswith(message)
