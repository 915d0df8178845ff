"""Checkpoints: exact resume, any world size, restart after a killed rank, a crash during
a save, export, eval, and the errors a user can cause.

The reference run trains 24 steps on 2 ranks and saves every 6 (with a cosine LR
schedule, so a lost schedule shows). Every resumed run must log the reference's loss at
each step it trains: to 1e-6 on the same world size, and to 1e-5 on another (the
reductions add in another order) with the same global batch.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fsdp_exp.checkpoint.files import latest, open_checkpoint
from fsdp_exp.checkpoint.resume import resolve_resume
from fsdp_exp.commands.experiment import compose_checked
from tests.conftest import SMALL_VIT, precheck, read_json, read_jsonl, refused_here, run_cli, signal_at_step
from fsdp_exp.driver.plan import prepare
from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.local import LocalLauncher
from fsdp_exp.models import build_model
from fsdp_exp.run_context import RunContext
from tests import rank_tasks
from tests.test_data import make_dataset

STEPS, EVERY = 24, 6
COMMON = [*SMALL_VIT, f"train.steps={STEPS}", "train.log_every=1", "train.lr_schedule=cosine",
          "train.lr_warmup_steps=3", f"checkpoint.every={EVERY}"]


def losses(run: Path) -> dict[int, float]:
    """Step -> loss; a resumed run's later record of a step wins."""
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def train(tmp: Path, name: str, *overrides: str, common: tuple[str, ...] = tuple(COMMON)) -> Path:
    out = tmp / name
    result = run_cli(*common, *overrides, f"hydra.run.dir={out}", cwd=tmp, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks x 8 samples, sync saves at 6, 12, 18, 24, and the full model at the end."""
    return train(tmp_path_factory.mktemp("ref"), "ref", "checkpoint=dcp", "train.batch_size=8",
                 "checkpoint.export_full=true")


def plain_small_vit() -> torch.nn.Module:
    """The model the runs train (SMALL_VIT), built plainly, without any sharding."""
    return build_model({"_target_": "fsdp_exp.models.vit.build_vit", "image_size": 28, "patch_size": 7,
                        "num_layers": 2, "num_heads": 2, "hidden_dim": 128, "mlp_dim": 128, "num_classes": 10,
                        "blocks": []})[0]


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def assert_same_losses(run: Path, reference: Path, first: int, tolerance: float) -> None:
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(first, STEPS + 1)), sorted(got)
    for step in got:
        assert abs(got[step] - want[step]) <= tolerance, (step, got[step], want[step])


def test_the_reference_keeps_every_checkpoint_and_marks_the_last(reference: Path) -> None:
    root = reference / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:08d}" for s in (12, 18, 24)]  # keep 3
    assert latest(root) == step_dir(reference, 24)
    state = read_json(step_dir(reference, 24) / "train_state.json")
    assert state["step"] == 24 and state["world_size"] == 2 and state["lr_schedule"]["last_epoch"] == 24
    summary = read_json(reference / "summary.json")
    assert summary["checkpoint_saves"] == 4 and summary["checkpoint_blocked_s"] > 0


@pytest.mark.parametrize("mode", ["dcp_async", pytest.param("dcp_async_pinned", marks=pytest.mark.slow)])
def test_a_run_resumed_with_async_saves_matches_the_uninterrupted_run(
        tmp_path: Path, reference: Path, mode: str) -> None:
    run = train(tmp_path, mode, f"checkpoint={mode}", "train.batch_size=8", f"resume={step_dir(reference, 12)}")
    assert_same_losses(run, reference, 13, 1e-6)
    assert latest(run / "checkpoints") == step_dir(run, 24)  # async saves were committed
    assert read_json(run / "summary.json")["resumed_from_step"] == 12
    if mode == "dcp_async_pinned":
        log = (run / "rank0.log").read_text()
        assert log.count("not pinned") == 1, log


def test_a_checkpoint_of_2_ranks_resumes_on_1(tmp_path: Path, reference: Path) -> None:
    run = train(tmp_path, "one", "checkpoint=dcp", "launcher.nproc_per_node=1", "train.batch_size=16",
                f"resume={step_dir(reference, 12)}")
    assert read_json(run / "summary.json")["world_size"] == 1
    assert_same_losses(run, reference, 13, 1e-5)


@pytest.mark.slow
def test_a_checkpoint_of_2_ranks_resumes_on_4_and_one_of_4_on_2(tmp_path: Path, reference: Path) -> None:
    four = train(tmp_path, "four", "checkpoint=dcp", "launcher.nproc_per_node=4", "train.batch_size=4",
                 f"resume={step_dir(reference, 12)}")
    assert read_json(four / "summary.json")["world_size"] == 4
    assert_same_losses(four, reference, 13, 1e-5)
    two = train(tmp_path, "two", "checkpoint=dcp", "train.batch_size=8", f"resume={step_dir(four, 18)}")
    assert_same_losses(two, reference, 19, 1e-5)


@pytest.mark.slow
def test_dropout_draws_the_same_masks_after_a_resume(tmp_path: Path) -> None:
    """The CNN's dropout draws from each rank's RNG: a resume must restore it."""
    args = ("model=cnn", "wandb.mode=disabled", "checkpoint=dcp", "train.batch_size=8", "train.steps=6",
            "train.log_every=1", "checkpoint.every=3")
    whole = train(tmp_path, "whole", common=args)
    resumed = train(tmp_path, "resumed", f"resume={step_dir(whole, 3)}", common=args)
    got, want = losses(resumed), losses(whole)
    assert sorted(got) == [4, 5, 6] and all(abs(got[s] - want[s]) <= 1e-6 for s in got), (got, want)


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_latest_checkpoint_and_ends_the_same(
        tmp_path: Path, reference: Path) -> None:
    out = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    run = subprocess.Popen(
        [sys.executable, "-m", "fsdp_exp", *COMMON, "checkpoint=dcp", "train.batch_size=8",
         "launcher.max_restarts=1", f"hydra.run.dir={out}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        killed_at = signal_at_step([run], [out], EVERY + 2, {1: signal.SIGKILL})
        output = run.communicate(timeout=240)[0]
    finally:
        run.kill()
    assert killed_at is not None and killed_at < STEPS, f"rank 1 was not killed mid-run: {killed_at}"
    assert run.returncode == 0, output[-3000:]
    assert "restart 1 of the ranks" in (out / "rank0.log").read_text()
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "resumed"]
    assert len(events) == 1 and events[0]["step"] in range(EVERY, killed_at + 1, EVERY), events
    final = read_json(out / "summary.json")["final_loss"]
    assert abs(final - read_json(reference / "summary.json")["final_loss"]) <= 1e-6


@pytest.mark.slow
def test_a_restart_after_the_final_checkpoint_trains_nothing_and_keeps_the_loss_and_the_wandb_run(
        tmp_path: Path) -> None:
    """Rank 1 dies after the last step, once its checkpoint is saved: the restarted ranks
    resume at train.steps, train no step, and report the loss saved with that checkpoint.
    Both attempts log to one wandb run id (offline: one run directory each)."""
    overrides = [*COMMON, "train.steps=4", "checkpoint.every=2", "checkpoint=dcp", "train.batch_size=8",
                 "launcher.max_restarts=1", "wandb.mode=offline"]
    plan = prepare(compose_checked(overrides), 0)
    out = tmp_path / "run"
    context = RunContext()
    plan.task.find_resume(plan.exp, context, out)
    summary = LocalLauncher(max_restarts=1).launch(partial(rank_tasks.train_then_rank1_dies_once, context=context),
                                                   plan.exp, out, plan.nproc)

    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("event") == "resumed"] == [4], records
    assert "nothing left to train" in (out / "rank0.log").read_text()
    assert summary["resumed_from_step"] == 4 and "samples_per_s" not in summary, summary
    assert summary["final_loss"] == [r["loss"] for r in records if r.get("step") == 4 and "loss" in r][-1]
    attempts = sorted((out / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and {a.name.rsplit("-", 1)[1] for a in attempts} == {plan.exp.wandb.id}, attempts


# One rank saving a 200 MB state (a 4096 x 4096 layer and its AdamW moments) twice.
TWO_SAVES = """
import os, sys, torch
from pathlib import Path
from torch import nn
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT=sys.argv[3])
from fsdp_exp import distributed
from fsdp_exp.checkpoint import DCPCheckpoint, TrainState
from fsdp_exp.checkpoint.files import latest
ranks = distributed.init("cpu")
model = nn.Linear(4096, 4096)
optimizer = torch.optim.AdamW(model.parameters())
checkpoint = DCPCheckpoint(mode=sys.argv[2], every=1, keep=None).start(
    TrainState(model, optimizer, ranks, {"_target_": "linear"}), Path(sys.argv[1]))
def newest():
    return getattr(latest(checkpoint.root), "name", None)
checkpoint.save(1)
print("saved 1", newest(), flush=True)
checkpoint.save(2)
print("saved 2", newest(), flush=True)
checkpoint.close()
print("closed", newest(), flush=True)
"""


def two_saves(root: Path, mode: str) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    return subprocess.Popen([sys.executable, "-c", TWO_SAVES, str(root), mode, str(port)],
                            stdout=subprocess.PIPE, text=True)


def test_an_async_save_first_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    saver = two_saves(tmp_path / "checkpoints", "async")
    lines = saver.communicate(timeout=120)[0].splitlines()
    assert saver.returncode == 0
    # Each save returns while its files are still being written, so `latest` lags one
    # save behind until the next save (or close) has waited for it and marked it.
    assert lines == ["saved 1 None", "saved 2 step_00000001", "closed step_00000002"], lines


# A CPU rank's checkpoint=dcp_async_pinned: which stager it built, and whether it stages in
# the background. DefaultStager (torch/distributed/checkpoint/staging.py, __init__) takes a
# torch.Stream exactly when it stages asynchronously itself and torch.accelerator.is_available():
# on a GPU machine, a CPU rank would open a CUDA context on GPU 0.
CPU_STAGING = """
import os, sys, torch
from pathlib import Path
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT=sys.argv[2])
from fsdp_exp import distributed
from fsdp_exp.checkpoint import DCPCheckpoint, TrainState
from fsdp_exp.checkpoint.files import latest
ranks = distributed.init("cpu")
model = nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters())
checkpoint = DCPCheckpoint(mode="async_pinned", every=1, keep=None).start(
    TrainState(model, optimizer, ranks, {"_target_": "linear"}), Path(sys.argv[1]))
stager = checkpoint.stager
parts = [stager, *vars(stager).values()]
print("would take a stream:", any(isinstance(p, DefaultStager) and p._config.use_async_staging for p in parts))
checkpoint.save(1)
print("staging in the background:", checkpoint.staging)
checkpoint.close()
print("saved:", latest(checkpoint.root).name, flush=True)
"""


def test_a_cpu_rank_stages_pinned_saves_in_the_background_without_a_device_stream(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, "-c", CPU_STAGING, str(tmp_path / "checkpoints"), str(port)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["would take a stream: False", "staging in the background: True",
                                          "saved: step_00000001"], result.stdout


@pytest.mark.slow
def test_a_crash_during_a_save_leaves_the_previous_checkpoint_the_latest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    saver = two_saves(root, "sync")
    try:
        assert saver.stdout.readline().strip() == "saved 1 step_00000001"
        second = root / "step_00000002"
        deadline = time.monotonic() + 60
        while not list(second.glob("*.distcp")) and time.monotonic() < deadline:
            time.sleep(0.002)
        saver.send_signal(signal.SIGKILL)
        assert saver.wait(timeout=30) == -signal.SIGKILL
    finally:
        saver.kill()
    assert list(second.glob("*.distcp")) and not (second / ".metadata").exists(), "the kill missed the save"
    assert latest(root) == root / "step_00000001"
    assert open_checkpoint(root).step == 1
    result = refused_here(*SMALL_VIT, f"resume={second}", cwd=tmp_path)
    assert result.returncode == 2
    assert f"resume={second}: half-written checkpoint (no .metadata" in result.stderr


def test_export_writes_the_plain_model_from_any_checkpoint(tmp_path: Path, reference: Path) -> None:
    final = load_file(reference / "model.safetensors")  # gathered at the end of training
    model = plain_small_vit()
    model.load_state_dict(final, strict=True)
    result = run_cli("-m", *SMALL_VIT, "task=export", f"task.checkpoint={reference / 'checkpoints'}",
                     "task.format=safetensors,pt", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for out, name in ((tmp_path / "sweep" / "0", "model.safetensors"), (tmp_path / "sweep" / "1", "model.pt")):
        exported = load_file(out / name) if name.endswith(".safetensors") else torch.load(out / name, weights_only=True)
        assert exported.keys() == final.keys()
        assert all(torch.equal(exported[k], final[k]) for k in final)


@pytest.mark.parametrize("launcher", [
    ["launcher=slurm", "launcher.cluster=local", "launcher.gpus_per_node=1"],
    pytest.param(["launcher=ray", "launcher.use_gpu=true", "launcher.address=ray://head:10001"],
                 marks=pytest.mark.slow),
])
def test_eval_on_a_gpu_cluster_runs_here_on_this_machines_device(tmp_path: Path, launcher: list[str]) -> None:
    """task=eval runs in the command's own process: typed on a login node without a GPU,
    it evaluates on that node's CPU, whatever GPUs the launcher would give its ranks."""
    from safetensors.torch import save_file

    make_dataset(tmp_path / "data", "FashionMNIST", n=32)
    weights = tmp_path / "model.safetensors"
    save_file(plain_small_vit().state_dict(), weights)
    task = [*SMALL_VIT, "data=fashion_mnist", f"data.root={tmp_path / 'data'}", "task=eval",
            f"task.weights={weights}", *launcher]
    plan = prepare(compose_checked(task), local_gpus=0)
    assert (str(plan.exp.device), plan.nproc) == ("cpu", 1)
    out = tmp_path / "eval"
    result = run_cli(*task, f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "eval in this process on cpu" in result.stdout + result.stderr
    assert read_json(out / "summary.json")["eval_samples"] == 32


def test_eval_with_device_cuda_on_a_machine_without_a_gpu_says_where_it_runs(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.touch()
    with pytest.raises(ConfigError, match="device=cuda: this machine has no GPU; .*task=eval runs on this machine"):
        prepare(compose_checked([*SMALL_VIT, "task=eval", f"task.weights={weights}", "device=cuda",
                                 "launcher=slurm", "launcher.cluster=local", "launcher.gpus_per_node=1"]), 0)


def test_eval_reports_loss_and_accuracy_on_the_test_split(tmp_path: Path, reference: Path) -> None:
    images, labels = make_dataset(tmp_path / "data", "FashionMNIST", n=96)
    data = ["data=fashion_mnist", f"data.root={tmp_path / 'data'}"]
    sources = (reference / "model.safetensors", reference / "checkpoints")
    result = run_cli("-m", *SMALL_VIT, *data, "task=eval", f"task.weights={','.join(map(str, sources))}", "task.show=4",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("predicted / label") == 2, result.stdout
    from_file, from_dcp = (read_json(tmp_path / "sweep" / str(n) / "summary.json") for n in range(2))
    assert from_file["eval_samples"] == 96 and len(from_file["examples"]) == 4
    # The same figures by hand, from the exported file and the IDX files.
    model = plain_small_vit()
    model.load_state_dict(load_file(reference / "model.safetensors"))
    x = ((images.float() / 255 - 0.2860) / 0.3530).unsqueeze(1)
    with torch.no_grad():
        logits = model.eval()(x)
    accuracy = (logits.argmax(-1) == labels.long()).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, labels.long()).item()
    for figures in (from_file, from_dcp):
        assert figures["eval_accuracy"] == pytest.approx(accuracy, abs=1e-6)
        assert figures["eval_loss"] == pytest.approx(loss, rel=1e-5)


# ---- bad input ---------------------------------------------------------------------------------
BAD = [*SMALL_VIT, f"train.steps={STEPS}"]


def damaged_copy(tmp_path: Path, reference: Path, damage: str) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(step_dir(reference, 24), copy)
    if damage == "half-written":
        (copy / ".metadata").unlink()
    elif damage == "truncated":
        shard = copy / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "garbage":
        (copy / ".metadata").write_bytes(b"not a pickle")
    return copy


@pytest.mark.parametrize("damage,message", [
    ("half-written", "half-written checkpoint (no .metadata: its save never finished)"),
    ("truncated", "corrupt checkpoint (__1_0.distcp 1000 bytes, needs"),
    ("garbage", "corrupt checkpoint (.metadata unreadable"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_path(
        tmp_path: Path, reference: Path, damage: str, message: str) -> None:
    copy = damaged_copy(tmp_path, reference, damage)
    with pytest.raises(ConfigError) as refused:
        precheck([*BAD, "train.steps=30", f"resume={copy}"])
    assert f"resume={copy}: {message}" in str(refused.value)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_RunsCode.marker}",))


def test_a_crafted_metadata_file_is_refused_and_never_runs(tmp_path: Path, reference: Path) -> None:
    copy = damaged_copy(tmp_path, reference, "none")
    _RunsCode.marker = tmp_path / "pwned"
    (copy / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(ConfigError, match="refusing to load posix.system"):
        precheck([*BAD, "train.steps=30", f"resume={copy}"])
    assert not _RunsCode.marker.exists()


def test_a_checkpoint_of_another_model_names_what_differs(tmp_path: Path, reference: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        precheck([*BAD, "train.steps=30", "model.hidden_dim=64", f"resume={step_dir(reference, 12)}"])
    line = str(refused.value)
    assert "saved from a different model: model.hidden_dim is 128 there, 64 here;" in line
    assert "class_token is [1, 1, 128] there, [1, 1, 64] here" in line


@pytest.mark.parametrize("args,message", [
    (["resume={missing}"], "resume={missing}: no such checkpoint"),
    (["resume={ref}"], "resume={ref}: already at step 24 of train.steps=24; raise train.steps"),
    (["checkpoint=dcp", "checkpoint.dir={root}"],
     "checkpoint.dir={root}: holds another run's checkpoints (latest step_00000024); set resume=auto"),
    (["checkpoint=dcp", "checkpoint.mode=later"], "checkpoint.mode=later: choose one of: sync, async, async_pinned"),
    (["checkpoint.every=5"], "checkpoint.every: unknown key; checkpoint has: export_full"),
    (["task=export"], "task.checkpoint: task=export needs a checkpoint"),
    (["task=eval", "task.weights={missing}"], "task.weights={missing}: no such file or checkpoint"),
    (["task=max_batch", "memory.limit_gb=1", "launcher.max_restarts=1"],
     "launcher.max_restarts=1: task=max_batch needs every probe to fail"),
])
def test_bad_checkpoint_input_is_refused_before_a_run(tmp_path: Path, reference: Path, args: list[str], message: str) -> None:
    names = {"missing": tmp_path / "nowhere", "ref": step_dir(reference, 24), "root": reference / "checkpoints"}
    with pytest.raises(ConfigError) as refused:
        precheck([*BAD, *[a.format(**names) for a in args]])
    assert message.format(**names) in str(refused.value)


def test_resume_auto_picks_the_latest_in_checkpoint_dir_and_nothing_in_an_empty_one(
        tmp_path: Path, reference: Path) -> None:
    exp = prepare(compose_checked([*BAD, "checkpoint=dcp", "train.steps=30", "resume=auto"]), 0).exp
    assert resolve_resume(exp, reference / "checkpoints") == str(step_dir(reference, 24))
    assert resolve_resume(exp, tmp_path / "empty") is None


@pytest.mark.slow
def test_resume_auto_continues_the_run_in_checkpoint_dir(tmp_path: Path, reference: Path) -> None:
    root = tmp_path / "shared_checkpoints"
    shutil.copytree(reference / "checkpoints", root)
    (root / "latest").write_text("step_00000018\n")  # as if the run had stopped after step 18
    run = train(tmp_path, "auto", "checkpoint=dcp", "train.batch_size=8", f"checkpoint.dir={root}", "resume=auto")
    assert_same_losses(run, reference, 19, 1e-6)
    assert json.loads((root / "step_00000024" / "train_state.json").read_text())["step"] == 24


def test_a_tied_head_is_exported_whole(tmp_path: Path) -> None:
    """A plain model's tied head and embedding share one tensor, which safetensors refuses
    to write (so sharding=none with checkpoint.export_full=true failed for gpt)."""
    from fsdp_exp.checkpoint.export import save_weights
    from fsdp_exp.models.gpt import build_gpt

    state = build_gpt("tiny", vocab_size=64, block_size=16).state_dict()
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()
    save_weights(state, tmp_path / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == state.keys()
    assert all(torch.equal(written[k], state[k]) for k in state)
