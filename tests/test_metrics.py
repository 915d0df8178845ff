"""The figures a run reports are real: throughput, memory, FLOPs, the environment, wandb."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_exp.data.images import SyntheticImages
from fsdp_exp.distributed import Ranks
from fsdp_exp.metrics.sinks import Progress, record_line
from fsdp_exp.metrics.summary import NAMES, Summary, summary_table
from fsdp_exp.models.vit import build_vit
from fsdp_exp.batch import Batches
from fsdp_exp.metrics.peaks import MemoryMonitor
from fsdp_exp.metrics.startup import MARKS
from fsdp_exp.rank.trainer import Hooks, OptimizerStep, Trainer, TrainerSettings
from tests.conftest import SMALL_VIT, names, read_json, read_jsonl, refused_here, run_cli

@pytest.fixture(scope="module")
def one_rank_group():
    """A real 1-rank gloo process group in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield Ranks(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    dist.destroy_process_group()


def test_samples_per_s_agrees_with_wall_time(one_rank_group: Ranks) -> None:
    """The steady figure is the samples of the steps after warm-up over the wall time they
    took: the logged records' wall clocks bound those steps."""
    torch.manual_seed(0)
    model = build_vit(28, 7, 4, 2, 128, 128, 10)
    batches = SyntheticImages(num_samples=2048).batches(64, 0, 1, seed=0)
    records: list[dict] = []

    class Kept:
        def log(self, record: dict) -> None:
            records.append(record)

    trainer = Trainer(TrainerSettings(steps=12, batch_size=64, log_every=4, warmup_steps=4), one_rank_group, model,
                      OptimizerStep(torch.optim.AdamW(model.parameters())), batches=Batches(batches),
                      hooks=Hooks(sinks=[Kept()]))
    summary = trainer.fit()
    assert [r["step"] for r in records] == [4, 8, 12] and records[0].get("warmup") is True
    steady_wall = records[-1]["time"] - records[0]["time"]
    assert summary.samples_per_s == pytest.approx(8 * 64 / steady_wall, rel=0.05)
    assert 0 <= summary.host_data_wait_share < 1
    assert summary.warmup_only is False


@pytest.mark.parametrize("phase_peaks", [True, False])
def test_each_phase_has_its_peak_unless_turned_off(one_rank_group: Ranks, phase_peaks: bool) -> None:
    """metrics.phase_peaks: on a GPU each phase costs a read of the allocator's stats."""
    torch.manual_seed(0)
    model = build_vit(28, 7, 4, 2, 128, 128, 10)
    batches = SyntheticImages(num_samples=512).batches(64, 0, 1, seed=0)
    summary = Trainer(TrainerSettings(steps=3, batch_size=64, log_every=3), one_rank_group, model,
                      OptimizerStep(torch.optim.AdamW(model.parameters())), batches=Batches(batches),
                      memory=MemoryMonitor(one_rank_group.device, phase_peaks=phase_peaks)).fit().as_dict()
    phases = {k: v for k, v in summary.items() if k.startswith("peak_") and k.endswith("_gb")
              and k not in ("peak_mem_gb", "peak_resident_gb", "peak_in_use_gb")}
    if phase_peaks:
        assert phases.keys() == {"peak_forward_gb", "peak_backward_gb", "peak_optimizer_step_gb"}
        assert all(0 < v <= summary["peak_mem_gb"] for v in phases.values()), (phases, summary["peak_mem_gb"])
        # what the allocations held where the phases end: the activations at the forward's end at least
        assert 0 < summary["peak_in_use_gb"] <= summary["peak_mem_gb"]
    else:
        assert phases == {} and summary["peak_mem_gb"] > 0 and "peak_in_use_gb" not in summary


def test_in_use_is_what_the_allocations_hold_where_a_phase_ends() -> None:
    """peak_in_use_gb on CPU: glibc's count of what malloc handed out and was not freed,
    less what the rank held before its model, read where each phase starts and ends; a
    tensor freed within the phase it was made in is not seen."""
    from fsdp_exp.metrics import peaks as memory

    cpu = torch.device("cpu")
    monitor = memory.MemoryMonitor(cpu, runtime=memory.mark_runtime(cpu))
    monitor.start_run()
    monitor.start_phase("forward")
    held = torch.ones(16 * 2**20)  # 64 MiB, held past the phase's end
    monitor.start_phase("backward")
    passing = torch.ones(32 * 2**20)  # 128 MiB, made and freed within the phase
    del passing
    monitor.end_phase()
    peaks = monitor.window_peaks()
    assert peaks["peak_in_use_gb"] == pytest.approx(1 / 16, abs=0.01), peaks
    del held
    monitor.start_window()
    monitor.start_phase("forward")
    monitor.end_phase()
    assert monitor.window_peaks()["peak_in_use_gb"] < 0.01


def on_two_ranks(task: Callable[[int, str, dict], None], tmp_path: Path) -> dict:
    """What `task(rank, init_dir, found)` put in `found` on each of 2 spawned ranks."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        found = manager.dict()
        mp.spawn(task, args=(str(tmp_path), found), nprocs=2)
        return dict(found)


def _reduce_scatters(rank: int, init_dir: str, found: dict) -> None:
    """60 reduce-scatters of 4 MiB on gloo, and what the allocations hold after each as a
    rank's phase boundary reads it, on a core this rank shares with the other, with one
    thread for torch's ops as a rank on a 2-core machine has."""
    from fsdp_exp.metrics.peaks import GlooWorkers

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before gloo starts its threads: they inherit it
    dist.init_process_group("gloo", init_method=f"file://{init_dir}/group", rank=rank, world_size=2)
    try:
        workers = GlooWorkers()
        whole, shard = torch.ones(2**20), torch.empty(2**19)
        dist.reduce_scatter_tensor(shard, whole)
        before = workers.settled_heap_in_use_bytes()
        held = []
        for _ in range(60):
            dist.reduce_scatter_tensor(shard, whole)
            held.append(workers.settled_heap_in_use_bytes() - before)
        found[rank] = (len(workers.workers), max(held))
    finally:
        dist.destroy_process_group()


def test_what_gloo_frees_after_a_collective_returns_is_not_counted_where_a_phase_ends(tmp_path: Path) -> None:
    """gloo's reduce-scatter copies its whole input, and the worker thread that ran it frees
    the copy after the rank's call has returned: on a busy core (two ranks on one here),
    about one call in ten, the rank reads before it is freed. A rank's boundary reads
    wait until gloo's workers are idle."""
    found = on_two_ranks(_reduce_scatters, tmp_path)
    for rank in (0, 1):
        workers, most = found[rank]
        assert workers >= 1, "no thread named as gloo's workers are"
        assert most < 2**20, f"rank {rank}: {most} bytes held after a reduce-scatter of 4 MiB returned"


def test_a_running_thread_of_gloos_workers_name_does_not_hold_up_a_read() -> None:
    """OpenMP's threads started by a gloo worker carry its name and spin, runnable, after
    their work: a read does not wait for them (here a thread of that name that keeps a core
    busy outside the GIL, in libc's memset)."""
    import ctypes
    import threading

    from fsdp_exp.metrics.peaks import GLOO_WORKER, GlooWorkers

    libc = ctypes.CDLL("libc.so.6")
    buffer, stop, named = ctypes.create_string_buffer(8 * 2**20), threading.Event(), threading.Event()
    tid: list[str] = []

    def spin() -> None:
        libc.prctl(15, GLOO_WORKER.encode(), 0, 0, 0)  # PR_SET_NAME, as the thread gloo starts names itself
        tid.append(str(threading.get_native_id()))
        named.set()
        while not stop.is_set():
            libc.memset(buffer, 0, len(buffer))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    named.wait()
    try:
        workers = GlooWorkers()
        workers.settled_heap_in_use_bytes()
    finally:
        stop.set()
        thread.join()
    assert tid[0] in workers.workers and workers.spinning == set(tid), (workers.workers, workers.spinning, tid)
    assert workers.settled  # the read ended once it saw the thread spin, not at its deadline of SETTLE_S


def _collectives(rank: int, init_dir: str, found: dict) -> None:
    """600 all-reduces on a CPU rank's group, and how much more the allocations hold after."""
    from fsdp_exp import distributed
    from fsdp_exp.metrics.peaks import GlooWorkers

    from fsdp_exp.memory import set_for_measuring

    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    set_for_measuring("cpu", None, estimated=True)  # as a rank that an estimate measures
    distributed.init("cpu", store=dist.FileStore(f"{init_dir}/store", 2))
    try:
        workers, values = GlooWorkers(), torch.ones(1000)
        dist.all_reduce(values)
        before = workers.settled_heap_in_use_bytes()
        for _ in range(600):
            dist.all_reduce(values)
        found[rank] = workers.settled_heap_in_use_bytes() - before
    finally:
        dist.destroy_process_group()


def test_a_cpu_ranks_collectives_grow_nothing_it_holds(tmp_path: Path) -> None:
    """torch's flight recorder keeps the last 2,000 collectives for debugging a hang, 0.9 MB
    by the 600th here; a measured CPU rank's group keeps none unless TORCH_FR_BUFFER_SIZE asks."""
    found = on_two_ranks(_collectives, tmp_path)
    assert all(grown < 100_000 for grown in found.values()), found


def test_the_primary_peak_leaves_out_what_the_rank_held_before_its_model() -> None:
    """peak_mem_gb on CPU: the resident peak less the runtime marked before the model is
    built; the whole process's peak is peak_resident_gb."""
    from fsdp_exp.metrics import peaks as memory

    runtime = torch.ones(48 * 2**20)  # 192 MiB held before the "model", as torch's own memory is
    cpu = torch.device("cpu")
    marked = memory.mark_runtime(cpu)
    held_gb = marked.gb
    monitor = memory.MemoryMonitor(cpu, runtime=marked)
    monitor.start_run()
    run = torch.ones(64 * 2**20)  # the run's own 256 MiB
    peaks = monitor.window_peaks()
    assert peaks["peak_mem_gb"] == pytest.approx(0.25, abs=0.03), peaks
    assert peaks["peak_resident_gb"] >= held_gb + 0.24 and held_gb > 0.18, (peaks, held_gb)
    del runtime, run


@pytest.mark.slow
def test_the_primary_peak_is_the_same_whatever_started_the_ranks(tmp_path: Path) -> None:
    """One config under launcher=local (ranks forked from a process that imported torch
    once), torchrun and SLURM's local executor: their runtimes differ by hundreds of MB, the
    run's own peak by less than 5%."""
    from tests.test_launch_torchrun import free_port

    launchers = {"local": [], "torchrun": ["launcher=torchrun", f"launcher.rdzv_endpoint=localhost:{free_port()}"],
                 "slurm": ["launcher=slurm", "launcher.cluster=local"]}
    summaries = {}
    for name, args in launchers.items():
        result = run_cli(*args, "train.steps=8", "train.log_every=4", f"hydra.run.dir={tmp_path / name}",
                         cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        summaries[name] = read_json(tmp_path / name / "summary.json")
    runtimes = [s["runtime_gb"] for s in summaries.values()]
    assert max(runtimes) - min(runtimes) > 0.1, runtimes  # the launchers do differ
    local = summaries["local"]["peak_mem_gb"]
    for name, summary in summaries.items():
        assert summary["peak_mem_gb"] == pytest.approx(local, rel=0.05), {n: s["peak_mem_gb"] for n, s in summaries.items()}
        # the whole process: the runtime, the run's own, and library code paged in while training
        assert summary["peak_resident_gb"] >= summary["peak_mem_gb"] + summary["runtime_gb"]


@pytest.mark.parametrize("warmup_steps, warned", [(1, True), (2, False)])
def test_a_compiled_run_whose_warmup_ends_before_compiling_is_warned(one_rank_group: Ranks, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture,
                                                                     warmup_steps: int, warned: bool) -> None:
    """Step 1 runs eagerly while its FLOPs are counted, so step 2 compiles: a warm-up of one
    step leaves the compiler in the summary's throughput. Building compiles nothing yet."""
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.driver.plan import prepare
    from fsdp_exp.rank.build import build_experiment
    from fsdp_exp.run_context import RunContext

    exp = prepare(compose_checked([*SMALL_VIT, "sharding=none", "train.compile=true",
                                   f"metrics.warmup_steps={warmup_steps}"]), 0).exp
    with caplog.at_level("WARNING", logger="fsdp_exp"):
        build_experiment(exp, one_rank_group, tmp_path, RunContext()).jsonl.close()
    warnings = [r.getMessage() for r in caplog.records if "train.compile=true" in r.getMessage()]
    assert len(warnings) == warned
    for line in warnings:
        names(line, "metrics.warmup_steps=1", "train.compile=true", "metrics.warmup_steps=2")


@pytest.mark.slow
def test_warmup_steps_are_left_out_of_the_averages(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT, "train.steps=6", "train.log_every=1", "metrics.warmup_steps=2",
                     f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out / "metrics.jsonl")
    assert [r.get("warmup", False) for r in records] == [True, True, False, False, False, False]
    steady = records[2:]
    expected = 64 * len(steady) / sum(r["step_time_s"] for r in steady)  # 2 ranks x 32
    summary = read_json(out / "summary.json")
    assert summary["samples_per_s"] == pytest.approx(expected, rel=1e-6)
    assert summary["peak_mem_gb"] == max(r["peak_mem_gb"] for r in records)
    assert len(summary["peak_mem_gb_per_rank"]) == 2
    env = summary["environment"]
    assert env["torch"] == torch.__version__ and env["world_size"] == 2
    assert env["overrides"] == summary["overrides"] and "git_commit" in env
    seen = read_json(out / "device.json")  # written by rank 0, not by the driver
    assert env["device_seen_by"] == "rank 0" and {k: env[k] for k in seen} == seen
    assert seen["device_memory_gb"] > 0 and seen["host"] == env["driver_host"]
    assert summary.get("mfu") is None, "a CPU has no known peak: no MFU rather than a wrong one"
    assert summary["tflops_per_device"] > 0
    # every start-up mark, the driver's and rank 0's; rank 0's in the order it passed them
    startup = summary["startup"]
    assert list(startup) == list(MARKS)
    ranks = [startup[mark] for mark in ("rank_ready", "process_group", "built", "ready")]
    assert ranks == sorted(ranks), startup
    assert set(summary) <= NAMES, set(summary) - NAMES  # every figure under a name the record knows


def test_a_summary_is_written_and_read_back_as_one_record(tmp_path: Path) -> None:
    """summary.json through `Summary`: a figure not known is left out, a key it has no field for
    (an older summary's) is kept, and a name that is no field cannot be set, nor added as a figure."""
    with pytest.raises(KeyError, match="Summary has no field for estimated_peak_gb"):
        Summary(status="ok").with_figures({"estimated_peak_gb": 1.4, "steps": 4})
    written = Summary.of({"status": "ok", "steps": 4, "peak_mem_gb": 1.5, "mfu": None, "estimated_peak_gb": 1.4})
    written.write(tmp_path)
    on_disk = read_json(tmp_path / "summary.json")
    assert on_disk == {"status": "ok", "steps": 4, "peak_mem_gb": 1.5, "estimated_peak_gb": 1.4}
    read = Summary.read(tmp_path)
    assert read == written and read.peak_mem_gb == 1.5 and read.mfu is None
    assert read.more == {"estimated_peak_gb": 1.4} and read.get("estimated_peak_gb") == 1.4
    with pytest.raises(AttributeError):
        read.peak_mem = 1.0  # type: ignore[attr-defined]
    assert Summary.read(tmp_path / "none") is None


# 300 MiB of 1 MiB blocks freed before training: after a large free, glibc serves such
# blocks from its heap, which keeps the pages once they are freed.
FREED_BEFORE_TRAINING = """
import ctypes, json, torch
from fsdp_exp.metrics.peaks import MemoryMonitor
monitor = MemoryMonitor(torch.device("cpu"))
# Blocks of 1 MiB from the heap, as after glibc has raised its mmap threshold by itself.
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: free() alone gives nothing back
blocks = [torch.ones(2**20, dtype=torch.uint8) for _ in range(300)]
kept = torch.ones(2**10)  # above the blocks in the heap
del blocks
before = monitor.held_gb()
monitor.start_run()
print(json.dumps({"before": before, "held": monitor.held_gb(), "peak": monitor.window_peaks()["peak_mem_gb"]}))
"""


def test_memory_freed_before_training_is_not_counted_in_the_peak() -> None:
    out = subprocess.run([sys.executable, "-c", FREED_BEFORE_TRAINING], capture_output=True, text=True, check=True)
    gb = json.loads(out.stdout)
    assert gb["before"] - gb["held"] > 0.25, gb
    assert gb["peak"] < gb["before"] - 0.25, gb


@pytest.mark.slow
def test_peak_memory_rises_with_batch_size(tmp_path: Path) -> None:
    peaks = {}
    for batch in (4, 512):
        out = tmp_path / str(batch)
        result = run_cli(*SMALL_VIT, "sharding=none", "launcher.nproc_per_node=1", "train.steps=3",
                         f"train.batch_size={batch}", "data.num_samples=1024", f"hydra.run.dir={out}",
                         cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        peaks[batch] = read_json(out / "summary.json")["peak_mem_gb"]
    assert peaks[512] > peaks[4] + 0.05, peaks


@pytest.mark.slow
def test_flops_are_counted_and_match_the_analytic_count_for_gpt(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("model=gpt", "model.vocab_size=256", "data=synthetic_tokens", "data.seq_len=64",
                     "train.batch_size=4", "train.steps=2", "metrics.peak_tflops=2.0",
                     "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = read_json(out / "summary.json")
    assert summary["flops_source"] == "counted" and "flops_uncounted_ops" not in summary
    assert summary["flops_per_step"] == pytest.approx(summary["flops_per_step_analytic"], rel=0.1)
    assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] / 2.0)
    assert summary["peak_tflops"] == 2.0 and summary["peak_tflops_source"] == "metrics.peak_tflops"


def test_analytic_flops_come_from_the_built_model_and_match_the_counted_ones_on_cpu() -> None:
    """At 128 tokens attention is a fifth of the tiny GPT's FLOPs: FlopCounterMode alone
    does not count the CPU attention kernel (torch 2.14), and the ratio would be 0.79."""
    import torch.nn.functional as F

    from fsdp_exp.metrics.flops import flops_per_token, gpt_flops_per_token
    from fsdp_exp.models.gpt import build_gpt
    from tests.counting import count_step_flops

    model = build_gpt("tiny", vocab_size=256, block_size=128)
    analytic = flops_per_token(model, 128)
    assert analytic == pytest.approx(gpt_flops_per_token(2, 64, 256, 128), rel=0.02)  # + biases, norms
    assert flops_per_token(build_vit(28, 7, 2, 2, 128, 128, 10), 49) is None  # not a language model
    x = torch.randint(0, 256, (2, 128))
    counted = count_step_flops(model, lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
    assert counted.uncounted == [] and counted.hardware == counted.model
    assert counted.model / (analytic * 2 * 128) == pytest.approx(1, abs=0.1)


def test_wandb_offline_run_holds_the_metric_keys(tmp_path: Path) -> None:
    """The project comes from WANDB_PROJECT, as the config leaves it open."""
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT, "wandb.mode=offline", "train.steps=4", "train.log_every=2",
                     f"hydra.run.dir={out}", cwd=tmp_path, extra_env={"WANDB_PROJECT": "project_from_env"})
    assert result.returncode == 0, result.stderr
    (log_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = log_file.read_bytes()  # wandb's record log: protobuf strings are stored as-is
    metric_keys = (b"samples_per_s", b"peak_mem_gb", b"step_time_s", b"host_data_wait_share", b"loss")
    summary_and_config = (b"final_loss", b"environment", b"model.num_layers=2")  # the tag too
    for key in metric_keys + summary_and_config + (b"project_from_env",):
        assert key in data, key
    folder = log_file.parent  # the console said where, and how to upload it
    assert f"wandb: offline, in {folder} (wandb sync {folder} uploads it)" in result.stdout + result.stderr


WANDB_THREADS = """
import threading, sys
from pathlib import Path
from fsdp_exp.memory import set_for_measuring
from fsdp_exp.metrics.wandb_sink import Wandb
set_for_measuring("cpu", 1.0, estimated=False)  # as rank 0 of a run under a CPU limit
sink = Wandb(mode="offline", project="p", entity=None, group=None, tags=[], config={}, run_dir=Path(sys.argv[1]),
             job_type="train")
before = {t.name for t in threading.enumerate()}
sink.log({"step": 1, "loss": 1.0})
sink.log({"step": 2, "loss": 0.5})
print(sorted({t.name for t in threading.enumerate()} - before))
sink.finish({"final_loss": 0.5})
"""


def test_a_wandb_run_starts_no_thread_once_training_logs(tmp_path: Path) -> None:
    """Rank 0's wandb run, offline, in a measured run: logging starts no thread (wandb's error
    reporting would start two OpenTelemetry exporters at the first log, each stack counted
    under memory.limit_gb on rank 0 alone)."""
    result = subprocess.run([sys.executable, "-c", WANDB_THREADS, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env={k: v for k, v in os.environ.items() if k != "WANDB_ERROR_REPORTING"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


@pytest.mark.slow
def test_wandb_mode_from_the_environment_disables_wandb(tmp_path: Path) -> None:
    """wandb.mode=auto (the default) with WANDB_MODE=disabled: no wandb run, not even offline."""
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT[:1], "train.steps=2", f"hydra.run.dir={out}", cwd=tmp_path,
                     extra_env={"WANDB_MODE": "disabled", "WANDB_API_KEY": ""})
    assert result.returncode == 0, result.stderr
    assert read_json(out / "summary.json")["status"] == "ok"
    assert not (out / "wandb").exists()


WANDB_ENV = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_API_KEY")


@pytest.mark.parametrize(
    "overrides, env, expected",
    [
        ([], {}, ("offline", "fsdp_exp", None)),
        ([], {"WANDB_API_KEY": "k" * 40}, ("online", "fsdp_exp", None)),
        ([], {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e"}, ("disabled", "p", "e")),
        ([], {"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, ("offline", "fsdp_exp", None)),
        ([], {"WANDB_MODE": "dryrun"}, ("offline", "fsdp_exp", None)),  # wandb's older name
        (["wandb.mode=offline", "wandb.project=mine", "wandb.entity=team"],  # the config wins
         {"WANDB_MODE": "online", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e"}, ("offline", "mine", "team")),
    ],
)
def test_wandb_settings_the_config_leaves_open_come_from_the_environment(
        overrides: list[str], env: dict, expected: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver resolves them once (prepare), and every rank gets the result."""
    from fsdp_exp.commands.experiment import compose_config
    from fsdp_exp.driver.plan import prepare

    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    wandb = prepare(compose_config(overrides), 0).exp.wandb
    assert (wandb.mode, wandb.project, wandb.entity) == expected


def test_a_bad_wandb_mode_in_the_environment_is_one_line(tmp_path: Path) -> None:
    result = refused_here("train.steps=1", cwd=tmp_path, extra_env={"WANDB_MODE": "loud"})  # refused before it trains
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
    assert result.stderr.strip().splitlines() == [
        "fsdp_exp: WANDB_MODE=loud: with wandb.mode=auto, choose one of: online, offline, disabled"]


@pytest.mark.slow
def test_a_wandb_failure_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT[:1], "wandb.mode=online", "train.steps=2", f"hydra.run.dir={out}",
                     cwd=tmp_path, extra_env={"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9",
                                            "WANDB_INIT_TIMEOUT": "10"})
    assert result.returncode == 0, result.stderr
    assert read_json(out / "summary.json")["status"] == "ok"
    assert (result.stdout + result.stderr).count("wandb (online) failed") == 1


@pytest.mark.slow
def test_memory_profile_writes_a_timeline_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli(*SMALL_VIT, "profile=memory", "train.steps=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        html = (out / f"memory_timeline_rank{rank}.html").read_text()
        assert "<html" in html.lower() and len(html) > 1000


def test_progress_bar_and_summary_table(capsys: pytest.CaptureFixture) -> None:
    bar = Progress(total_steps=4, live=True)
    for step in (1, 2):
        bar.after_step(step)
    bar.log({"step": 2, "loss": 1.5, "samples_per_s": 100.0, "peak_mem_gb": 1.25})
    bar.close()
    out = capsys.readouterr().out
    assert "2/4" in out and "loss 1.5000" in out and "100.0 samples/s" in out and "1.25 GB" in out
    table = summary_table(Summary(status="ok", steps=4, final_loss=1.5, samples_per_s=100.0, peak_mem_gb=1.25,
                                  peak_mem_gb_per_rank=[1.25, 1.0], mfu=None))
    assert "samples/s" in table and "1.25, 1.00 GB" in table and "MFU" not in table


def test_a_run_of_warmup_steps_only_says_so_where_its_throughput_is_shown() -> None:
    """train.steps=3 with the default 3 warm-up steps: no step was measured, and the
    figures shown are the warm-up's."""
    figures = {"status": "ok", "steps": 3, "final_loss": 1.5, "samples_per_s": 226.1, "step_time_s": 0.25,
               "peak_mem_gb": 1.25}
    rows = {line.split("  ")[1].strip(): line.strip() for line in summary_table(
        Summary.of({**figures, "warmup_only": True})).splitlines()}
    assert rows["samples/s"].split(None, 1)[1].strip() == (
        "226.1 (warm-up steps only: raise train.steps above metrics.warmup_steps to measure)")
    assert rows["step time"].endswith("0.2500 s (warm-up)")
    assert "warm-up" not in summary_table(Summary.of({**figures, "warmup_only": False}))
    record = {"step": 3, "loss": 1.5, "samples_per_s": 226.1, "peak_mem_gb": 1.25}
    assert record_line({**record, "warmup": True}, 3).endswith("(warm-up)")
    assert "warm-up" not in record_line(record, 3)


def test_progress_says_how_long_is_left_from_the_steps_after_the_first(
        capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """The first step (30 s: FLOPs counted, memory touched) is left out; the next ones take
    10 s each. Both the bar and the plain lines say what is left."""
    ends = iter([0.0, 30.0, 40.0, 50.0])

    def run(progress: Progress) -> Progress:
        progress.before_step(1)
        for step in (1, 2, 3):
            progress.after_step(step)
        progress.log({"step": 3, "loss": 1.5, "samples_per_s": 100.0, "peak_mem_gb": 1.25})
        return progress

    caplog.set_level(logging.INFO, logger="fsdp_exp")
    plain = run(Progress(total_steps=10, live=False, clock=lambda: next(ends)))
    assert plain.step_time_s() == 10.0 and plain.time_left_s() == 70.0
    lines = [r.getMessage() for r in caplog.records if r.name == "fsdp_exp"]
    assert lines == ["step 2/10: 10 s a step, 1 min 20 s left",  # records are train.log_every steps apart
                     "step  3/10  loss 1.5000  100.0 samples/s  peak 1.25 GB  1 min 10 s left"]

    ends = iter([0.0, 30.0, 40.0, 50.0])
    run(Progress(total_steps=10, live=True, clock=lambda: next(ends))).close()
    last_drawn = capsys.readouterr().out.split("\r")[-1]
    assert "3/10 [" in last_drawn and "1 min 10 s left, loss 1.5000  100.0 samples/s" in last_drawn


def test_allocation_timeline_from_a_real_trace(tmp_path: Path) -> None:
    """The fallback view, used when torch's categorised timeline trips on an op."""
    from fsdp_exp.profile import write_allocation_timeline

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.randn(512, 512)
        b = a @ a
        del a, b
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    write_allocation_timeline(tmp_path / "trace.json", tmp_path / "t.html", rank=0, reason="why")
    html = (tmp_path / "t.html").read_text()
    assert "allocator events" in html and "why" in html and "data:image/png;base64," in html
    assert " 0 allocator events" not in html


def test_a_gpu_ranks_allocation_timeline_plots_its_gpus_events_alone(tmp_path: Path) -> None:
    """Each [memory] event carries the running total of its own device; a GPU rank's trace
    holds the host's events beside the GPU's. The events here are a real CPU trace's,
    with a GPU's events written in as the CUDA profiler writes them."""
    import json
    import re

    from fsdp_exp.profile import write_allocation_timeline

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.randn(256, 256)
        del a
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    host = [e for e in trace["traceEvents"] if e.get("name") == "[memory]"]
    assert host and all(e["args"]["Device Type"] == 0 for e in host)
    gpu = [{**e, "args": {**e["args"], "Device Type": 1, "Device Id": 1, "Total Allocated": 2**30}} for e in host]
    trace["traceEvents"] += gpu
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    counts = {}
    for device in ("cpu", "cuda:1", "cuda:0"):
        write_allocation_timeline(tmp_path / "trace.json", tmp_path / "t.html", rank=0, reason="why",
                                  device=torch.device(device))
        counts[device] = int(re.search(r"from (\d+) allocator events", (tmp_path / "t.html").read_text()).group(1))
    assert counts == {"cpu": len(host), "cuda:1": len(host), "cuda:0": 0}


@pytest.mark.parametrize(("device", "limit_gb", "estimated", "changed"), [
    ("cpu", 1.0, False, True), ("cpu", None, True, True), ("cpu", None, False, False), ("cuda", 1.0, True, False)])
def test_the_environment_is_changed_only_where_a_cpu_measurement_needs_it_and_never_what_the_user_set(
        monkeypatch, device: str, limit_gb: float | None, estimated: bool, changed: bool) -> None:
    from fsdp_exp.memory import MEASURING_ENVIRONMENT, set_for_measuring

    for key in MEASURING_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")  # the user's
    assert set_for_measuring(device, limit_gb, estimated) is changed
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500"
    assert os.environ.get("WANDB_ERROR_REPORTING") == ("false" if changed else None)
