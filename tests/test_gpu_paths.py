"""What the code does on a GPU, checked on CPU: the logic around torch.cuda, with torch.cuda's
own calls replaced by fakes that follow their documented behaviour.

No GPU runs here. What only a GPU can show is listed under "Not tested here" in docs/ (docs/gpu.md and the page of each topic).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fsdp_exp import distributed
from fsdp_exp import profile
from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.config import Device
from fsdp_exp.driver.plan import prepare
from fsdp_exp.errors import ConfigError
from fsdp_exp.launcher.core import RunFailed
from fsdp_exp.memory import allocation_failure, is_out_of_memory
from fsdp_exp.metrics.environment import DEVICE_RECORD, read_device_record
from fsdp_exp.metrics.peaks import GB, MemoryMonitor, device_used_gb
from fsdp_exp.batch import Batches
from fsdp_exp.metrics.summary import Summary
from fsdp_exp.rank.report import DeviceUsed
from fsdp_exp.rank.trainer import Hooks, OptimizerStep, Trainer, TrainerSettings
from tests.conftest import names

# ---- a CPU tensor in a GPU run's process group --------------------------------------------

def _cuda_only_backend(store, rank, size, timeout):  # noqa: ANN001, ANN202 (torch's creator signature)
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


def _unscale_cpu_gradients(rank: int, backends: list[str], init_dir: str, found: object) -> None:
    """fp16 loss scaling of offloaded (CPU) gradients, rank 1's with an inf, in each of
    `backends` in turn, whose GPU half serves only `cuda` tensors, as NCCL does."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dist.Backend.register_backend("cudaonly", _cuda_only_backend, devices=["cuda"])
    for backend in backends:
        store = dist.FileStore(f"{init_dir}/{backend}", 2)
        dist.init_process_group(backend, store=store, rank=rank, world_size=2)
        try:
            weight = torch.nn.Parameter(torch.ones(4))
            weight.grad = torch.full((4,), float("inf") if rank == 1 else 1.0)
            optimizer = torch.optim.SGD([weight], lr=0.1)
            scaler = ShardedGradScaler(device="cpu")  # as a CPU flag would meet the group
            scaler.scale(torch.ones(()))
            try:
                scaler.unscale_(optimizer)
                flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
                found[(backend, rank)] = f"found_inf={sum(float(f) for f in flags):g}"
            except RuntimeError as err:
                found[(backend, rank)] = str(err).splitlines()[0]
        finally:
            # The plain group's error comes without a word between the ranks: a rank that left
            # at once closed its connections while the other's were still being made.
            if store.add("left", 1) == 2:
                store.set("both left", "")
            store.wait(["both left"])
            dist.destroy_process_group()


def test_a_cpu_tensor_meets_an_offloading_gpu_runs_group(tmp_path: Path) -> None:
    """pytorch#148532's mechanism, on CPU: a group with a backend for `cuda` tensors only, as
    plain "nccl" is, fails on a CPU tensor on every rank. With offload the group
    `distributed.backend_for` gives has gloo for them, and the ranks agree on the inf."""
    import torch.multiprocessing as mp

    plain, offload = (distributed.backend_for("cuda", o).replace("nccl", "cudaonly") for o in (False, True))
    assert (plain, offload) == ("cudaonly", "cpu:gloo,cuda:cudaonly")
    found = mp.Manager().dict()
    mp.spawn(_unscale_cpu_gradients, args=([plain, offload], str(tmp_path), found), nprocs=2)
    assert [found[(offload, rank)] for rank in (0, 1)] == ["found_inf=1", "found_inf=1"]
    for rank in (0, 1):
        assert "No backend type associated with device type cpu" in found[(plain, rank)], dict(found)


# ---- out of memory outside the caching allocator ------------------------------------------

# As torch words them (ATen's TORCH_CUDABLAS_CHECK and C10_CUDA_CHECK, ProcessGroupNCCL with
# NCCL's last error appended; NCCL >= 2.19 puts the CUDA error code before the text).
GPU_OUT_OF_MEMORY = [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, "
     "so the stacktrace below might be incorrect."),
    ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error "
     "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA "
     "function failed.\nLast error:\nCuda failure 'out of memory'"),
    ("NCCL error in: ProcessGroupNCCL.cpp:2027, unhandled cuda error, NCCL version 2.27.3\n"
     "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 2 'out of memory'"),
]

NOT_OUT_OF_MEMORY = [
    "CUDA error: device-side assert triggered",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm(...)`",
    "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error\nLast error:\nCuda failure 'invalid argument'",
    "Expected all tensors to be on the same device",
]


@pytest.mark.parametrize("message", GPU_OUT_OF_MEMORY)
def test_a_gpu_out_of_memory_outside_the_caching_allocator_is_out_of_memory(message: str) -> None:
    assert is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("message", NOT_OUT_OF_MEMORY)
def test_other_gpu_errors_are_not_out_of_memory(message: str) -> None:
    assert not is_out_of_memory(RuntimeError(message))


def test_the_failure_line_keeps_what_ran_out() -> None:
    assert allocation_failure(RuntimeError(GPU_OUT_OF_MEMORY[3])) == "NCCL: Cuda failure 'out of memory'"
    assert allocation_failure(RuntimeError(GPU_OUT_OF_MEMORY[0])).startswith("CUBLAS_STATUS_ALLOC_FAILED when")
    cpu = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried " \
          "to allocate 800 bytes. Error code 12 (Cannot allocate memory)"
    assert allocation_failure(RuntimeError(cpu)) == \
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 800 bytes"


# ---- the caching allocator's figures per window -------------------------------------------


class FakeCachingAllocator:
    """torch.cuda's memory calls as the docs of torch/cuda/memory.py describe them: a peak
    reset leaves the retry and OOM counts alone, an accumulated-stats reset zeroes them,
    empty_cache hands the free cached blocks back."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.retries = self.ooms = 0
        self.calls: list[str] = []

    def alloc(self, nbytes: int, retry: bool = False) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.retries += retry

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def reset_accumulated_memory_stats(self, device: object = None) -> None:
        self.calls.append("reset_accumulated_memory_stats")
        self.retries = self.ooms = 0

    def memory_stats(self, device: object = None) -> dict:
        self.calls.append("memory_stats")  # builds the whole dict of the allocator's stats
        return {"allocated_bytes.all.peak": self.peak_allocated, "active_bytes.all.peak": self.peak_allocated,
                "reserved_bytes.all.peak": self.peak_reserved, "num_alloc_retries": self.retries,
                "num_ooms": self.ooms}

    def max_memory_allocated(self, device: object = None) -> int:
        return self.memory_stats(device)["allocated_bytes.all.peak"]  # torch reads it from memory_stats

    def memory_allocated(self, device: object = None) -> int:
        self.calls.append("memory_stats")
        return self.allocated


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCachingAllocator:
    fake = FakeCachingAllocator()
    for name in ("empty_cache", "reset_peak_memory_stats", "reset_accumulated_memory_stats", "memory_stats",
                 "max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_the_model_built_before_sharding_is_not_in_the_reserved_peak(fake_gpu: FakeCachingAllocator) -> None:
    monitor = MemoryMonitor(torch.device("cuda", 0))
    fake_gpu.alloc(4 * GB)  # the whole model, moved to the GPU (model.init_device=cpu) ...
    fake_gpu.free(3 * GB)  # ... then sharded: its blocks stay cached
    monitor.start_run()
    assert fake_gpu.calls.index("empty_cache") < fake_gpu.calls.index("reset_peak_memory_stats")
    fake_gpu.alloc(GB // 2)
    peaks = monitor.window_peaks()
    assert peaks["peak_reserved_gb"] == pytest.approx(1.5)
    assert peaks["peak_mem_gb"] == pytest.approx(1.5)


def test_allocator_retries_and_ooms_are_counted_per_window(fake_gpu: FakeCachingAllocator) -> None:
    monitor = MemoryMonitor(torch.device("cuda", 0))
    fake_gpu.alloc(GB, retry=True)  # before training: not in any window
    monitor.start_run()
    for phase in ("forward", "backward", "optimizer_step"):  # one retry in each phase: 3 in the window
        monitor.start_phase(phase)
        fake_gpu.alloc(GB // 8, retry=True)
    monitor.end_phase()
    first = monitor.window_peaks()
    assert first["alloc_retries"] == 3 and first["ooms"] == 0
    assert first["peak_forward_gb"] == pytest.approx(1.125)
    monitor.start_window()
    monitor.start_phase("forward")
    fake_gpu.alloc(GB // 8, retry=True)
    fake_gpu.ooms += 1
    second = monitor.window_peaks()
    assert second["alloc_retries"] == 1 and second["ooms"] == 1


# ---- allocation history for the out-of-memory snapshot -----------------------------------


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """A machine with a GPU, as torch.cuda would see it; the history and snapshot calls are recorded."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kwargs: calls.append(("record", enabled, kwargs)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(profile, "_recording_history", False)
    return calls


def test_a_cpu_rank_on_a_gpu_host_records_no_history_and_dumps_no_snapshot(gpu_host: list[tuple],
                                                                            tmp_path: Path) -> None:
    assert not profile.record_allocation_history(torch.device("cpu"))
    profile.dump_cuda_snapshot(tmp_path / "oom_snapshot_rank0.pickle", torch.device("cpu"))
    profile.stop_allocation_history(torch.device("cpu"))
    assert gpu_host == []


class FakeProfiler:
    """torch.profiler.profile without a GPU to profile: it writes an empty timeline."""

    def __init__(self, **kwargs: object) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *args: object) -> None:
        pass

    def export_memory_timeline(self, path: str, device: str) -> None:
        Path(path).write_text("")


@pytest.mark.parametrize("from_the_start", [True, False])
def test_a_memory_profile_keeps_the_runs_allocation_history_on(gpu_host: list[tuple], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               from_the_start: bool) -> None:
    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    gpu = torch.device("cuda", 0)
    if from_the_start:  # profile=memory: the run recorded from its start
        assert profile.record_allocation_history(gpu)
    memory_profile = profile.MemoryProfile(start_step=1, steps=1).start(tmp_path, 0, gpu)
    memory_profile.before_step(1)
    memory_profile.after_step(1)
    snapshot = str(tmp_path / "memory_snapshot_rank0.pickle")
    started = ("record", "all", {"max_entries": profile.HISTORY_ENTRIES, "stacks": "python"})
    stopped = ("record", None, {})
    assert gpu_host == ([started, ("dump", snapshot)] if from_the_start else [started, ("dump", snapshot), stopped])
    assert not profile.record_allocation_history(gpu) if from_the_start else profile.record_allocation_history(gpu)


def test_a_snapshot_that_cannot_be_written_does_not_hide_the_failure(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    def broken(path: str) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", broken)
    profile.dump_cuda_snapshot(tmp_path / "oom_snapshot_rank0.pickle", torch.device("cuda", 0))


def test_history_is_recorded_only_where_the_memory_profile_is_asked_for() -> None:
    """The allocator's history costs host time at every allocation (about 2 us with Python
    stacks): a probe, whose samples/s the tune ranks by, and a run under a limit do not record
    it; profile=memory does, from the run's start, so an out-of-memory snapshot shows what led there."""
    from fsdp_exp.tasks.max_batch.probe import probe_config

    asked = prepare(compose_checked(["profile=memory", "wandb.mode=disabled"]), 0).exp
    assert asked.profile.records_history
    limited = prepare(compose_checked(["task=max_batch", "memory.limit_gb=1", "profile=memory",
                                       "wandb.mode=disabled"]), 0).exp
    assert limited.memory.limit_gb == 1 and not probe_config(limited, 8, 3, 2).profile.records_history
    plain = prepare(compose_checked(["memory.limit_gb=1", "wandb.mode=disabled"]), 0).exp
    assert not plain.profile.records_history


# ---- which GPU is a rank's ----------------------------------------------------------------


@pytest.mark.parametrize(("env", "visible", "index"), [
    ({"LOCAL_RANK": "3"}, 8, 3),  # every rank sees the node's 8 GPUs (local, torchrun)
    ({"LOCAL_RANK": "0"}, 1, 0),
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0"}, 1, 0),  # --gpus-per-task=1 with cgroups
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, 0),  # --gpu-bind, no cgroups
    ({"LOCAL_RANK": "1", "FSDP_EXP_DEVICE": "cuda:4", "CUDA_VISIBLE_DEVICES": "0,1,10,11,2,3,4,5"}, 8, 4),  # Ray
])
def test_each_rank_takes_its_own_gpu(env: dict, visible: int, index: int) -> None:
    assert distributed.gpu_index(env, visible) == index


@pytest.mark.parametrize(("env", "visible", "message"), [
    ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, 2, "local rank 2 sees only 2 GPUs (CUDA_VISIBLE_DEVICES=0,1)"),
    ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}, 0, "local rank 0 sees no GPU"),
])
def test_a_rank_without_a_gpu_of_its_own_is_one_line(env: dict, visible: int, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        distributed.gpu_index(env, visible)
    assert message in str(err.value)


def test_under_torchrun_more_ranks_a_node_than_its_gpus_are_refused_before_the_ranks_train(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`torchrun --nproc_per_node=2 -m fsdp_exp device=cuda` on a node that shows one GPU:
    both ranks inherit the one CUDA_VISIBLE_DEVICES, both would take cuda:0, and NCCL refuses
    a second rank on a device. Rank 0's plan refuses it in one line (every rank then exits 2);
    one rank a node on two nodes is fine."""
    from fsdp_exp.commands.experiment import compose_config
    from fsdp_exp.driver.external_torchrun import plan_here

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the one door: the GPUs this node shows
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    made, _ = plan_here(["device=cuda", "wandb.mode=disabled"], compose_config, world_size=2)
    names(made.refused, "torchrun --nproc_per_node=2", "1 GPU(s) (CUDA_VISIBLE_DEVICES=0)", "at most 1 rank(s)")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    made, _ = plan_here(["device=cuda", "wandb.mode=disabled"], compose_config, world_size=2)
    assert made.refused is None and made.plan.nproc == 2
    # a launcher that names each rank's GPU is trusted
    distributed.check_gpus_for_local_ranks(2, 1, {"FSDP_EXP_DEVICE": "cuda:0"})


def test_a_ray_worker_names_the_device_ray_train_gave_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.train.torch

    from fsdp_exp.launcher.ray_worker import trains_on, worker_variables

    # Ray Train's choice of the worker's GPU (its accelerator ids, not CUDA_VISIBLE_DEVICES' order)
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device("cuda", 3))
    assert trains_on("cpu") is None
    context = SimpleNamespace(get_world_rank=lambda: 5, get_local_rank=lambda: 1, get_world_size=lambda: 8,
                              get_local_world_size=lambda: 4)
    variables = worker_variables(context, trains_on("cuda"))
    assert variables == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                         "FSDP_EXP_RESTARTS": "0", "FSDP_EXP_DEVICE": "cuda:3"}
    assert distributed.gpu_index(variables, 4) == 3
    assert "FSDP_EXP_DEVICE" not in worker_variables(context)  # CPU workers


# ---- the device is rank 0's, not the driver's ---------------------------------------------


def test_a_limit_is_checked_against_the_smallest_gpu_the_ranks_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of mixed GPUs, an 80 GB one at cuda:0 and a 24 GB one at cuda:1, under
    launcher=local with 2 ranks: memory.limit_gb=30 fits the current GPU but not rank 1's,
    and is refused before any rank starts, naming it; one rank takes cuda:0 alone."""
    sizes = {0: 80 * GB, 1: 24 * GB}
    monkeypatch.setattr(torch.cuda, "get_device_properties",  # the one door: each GPU's memory
                        lambda device: SimpleNamespace(total_memory=sizes[torch.device(device).index or 0]))
    from fsdp_exp.commands.experiment import compose_config

    cfg = compose_config(["device=cuda", "memory.limit_gb=30", "launcher.nproc_per_node=2", "wandb.mode=disabled"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg, 2)
    names(str(err.value), "memory.limit_gb=30.0", "cuda:1", "24.0 GB")
    one = compose_config(["device=cuda", "memory.limit_gb=30", "launcher.nproc_per_node=1", "sharding=full",
                           "wandb.mode=disabled"])
    assert prepare(one, 2).nproc == 1


H200 = {"torch": "2.11.0", "cuda": "12.8", "nccl": "2.27.3", "device": "NVIDIA H200", "device_count": 8,
        "device_memory_gb": 8.0, "pytorch_cuda_alloc_conf": None, "python": "3.12.3", "host": "gpu-node-07"}


class ClusterLauncher:
    """A cluster's launcher, in this process: rank 0 reports the device (as train_rank
    does) and a probe's peak grows 0.01 GB a sample from 1 GB; each rank's device holds
    OUTSIDE_GB beyond its allocator (the CUDA context, NCCL), so about 570 fit in the 6.75 GB
    the 8 GB device leaves its allocator."""

    runs_here = False
    starts_all_ranks = True
    restarts = 0
    OUTSIDE_GB = 1.25

    def __init__(self) -> None:
        self.batches: list[int] = []

    def launch(self, task: object, cfg: object, run_dir: Path, nproc: int, time_limit_s: float | None = None) -> dict:
        (Path(run_dir) / DEVICE_RECORD).write_text(json.dumps(H200))
        batch = cfg.train.batch_size
        self.batches.append(batch)
        peak = 1 + 0.01 * batch
        if peak > H200["device_memory_gb"] - self.OUTSIDE_GB:
            raise RunFailed("rank 0 failed: OutOfMemory: ran out of memory: CUDA out of memory", out_of_memory=True)
        return {"peak_mem_gb": peak, "peak_mem_gb_per_rank": [peak] * nproc, "peak_reserved_gb": peak,
                "peak_reserved_gb_per_rank": [peak] * nproc, "held_mem_gb": 0.5, "samples_per_s": 100.0 * batch,
                "alloc_retries": 0.0, "device_used_gb_per_rank": [peak + self.OUTSIDE_GB] * nproc}


@pytest.mark.slow
def test_max_batch_on_a_cluster_fits_in_rank_0s_gpu_not_the_drivers(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    from fsdp_exp.tasks.max_batch import search as max_batch

    def login_node(device: object) -> float:
        raise AssertionError("the driver has no GPU")

    monkeypatch.setattr(max_batch, "device_memory_gb", login_node)
    exp = prepare(compose_checked(["task=max_batch", "memory.limit_gb=1", "wandb.mode=disabled"]), 0).exp
    exp.device, exp.memory.limit_gb = Device.cuda, None
    launcher = ClusterLauncher()
    search = max_batch.MaxBatchSearch(exp, tmp_path, launcher, 2)
    answer = search.run()
    assert launcher.batches[0] == exp.task.resolution
    assert answer.limit_gb == pytest.approx(8.0 - ClusterLauncher.OUTSIDE_GB)
    assert 560 <= answer.max_batch_size <= 575
    record = json.loads((tmp_path / "max_batch.json").read_text())
    assert record["device_name"] == "NVIDIA H200"
    assert read_device_record(tmp_path) == H200
    assert search.context.environment["device"] == "NVIDIA H200" and search.context.environment["host"] == "gpu-node-07"


def test_without_a_limit_a_gpu_search_fits_in_what_the_device_leaves_its_allocator(tmp_path: Path) -> None:
    """The device's total_memory holds the CUDA context, NCCL's and cuBLAS's memory too, which
    the allocator can never get: judged against all of it, the margin and the memory left
    were 1 to 2 GB too large. The first probe's ranks say what their device held beyond their
    reserved peak; the limit is the device's memory less that."""
    from fsdp_exp.tasks.max_batch.search import MaxBatchSearch

    exp = prepare(compose_checked(["task=max_batch", "memory.limit_gb=1", "task.estimate=false",
                                   "wandb.mode=disabled"]), 0).exp
    exp.device, exp.memory.limit_gb = Device.cuda, None
    search = MaxBatchSearch(exp, tmp_path, ClusterLauncher(), 2)
    search.start_or_resume()
    probe = search.probe(exp.task.resolution)
    assert probe.outside_allocator_gb == pytest.approx(ClusterLauncher.OUTSIDE_GB)
    assert search.limit_gb == pytest.approx(H200["device_memory_gb"] - ClusterLauncher.OUTSIDE_GB)


def test_the_summarys_environment_is_what_rank_0_saw(tmp_path: Path) -> None:
    from fsdp_exp.driver.run import device_seen

    exp = prepare(compose_checked([]), 0).exp
    exp.launcher = ClusterLauncher()
    assert device_seen(exp, tmp_path) == {"device_seen_by": None}  # rank 0 never got that far
    (tmp_path / DEVICE_RECORD).write_text(json.dumps(H200))
    assert device_seen(exp, tmp_path) == {**H200, "device_seen_by": "rank 0"}


# ---- timers wait for the GPU first ---------------------------------------------------------


def test_checkpoint_blocked_time_leaves_out_the_steps_queued_kernels(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    from fsdp_exp.checkpoint import DCPCheckpoint
    from fsdp_exp.checkpoint.files import METADATA, step_name

    queued_s = 1.0  # well above a small save's time, even on a busy machine

    def wait_for_queued_kernels(device: torch.device) -> None:
        time.sleep(queued_s)

    monkeypatch.setattr(distributed, "synchronize", wait_for_queued_kernels)
    ranks = distributed.Ranks(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    state = SimpleNamespace(ranks=ranks, write_small_state=lambda path, step, loss: path.mkdir(parents=True),
                            tensors=lambda: {"model": {"weight": torch.ones(4)}})
    checkpoint = DCPCheckpoint(dir=str(tmp_path)).start(state, tmp_path)
    checkpoint.save(1, torch.tensor(1.0))
    assert (tmp_path / step_name(1) / METADATA).is_file()
    assert checkpoint.blocked_s[0] < queued_s


def tiny_trainer(steps: int, log_every: int, hooks: tuple = (), sinks: tuple = (),
                 memory: MemoryMonitor | None = None) -> Trainer:
    """A few CPU steps of a linear classifier, without a process group."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    batches = [(torch.randn(2, 4), torch.randint(0, 3, (2,))) for _ in range(steps)]
    ranks = distributed.Ranks(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    return Trainer(TrainerSettings(steps=steps, batch_size=2, log_every=log_every), ranks, model,
                   OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1)), batches=Batches(batches),
                   memory=memory, hooks=Hooks(sinks=list(sinks), steps=list(hooks)))


def test_the_first_window_starts_after_the_gpu_has_finished_what_came_before(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[object] = []
    monkeypatch.setattr(distributed, "synchronize", lambda device: events.append("synchronize"))
    monkeypatch.setattr(MemoryMonitor, "start_run", lambda self: events.append("first window"))
    hook = SimpleNamespace(before_step=lambda step: events.append(step), after_step=lambda step: None)
    tiny_trainer(steps=2, log_every=2, hooks=(hook,)).fit()
    assert events[:3] == ["synchronize", "first window", 1]


def test_a_runs_retries_are_the_sum_of_its_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    window = {"peak_mem_gb": 1.0, "peak_reserved_gb": 1.5, "alloc_retries": 2.0, "ooms": 1.0}
    monkeypatch.setattr(MemoryMonitor, "window_peaks", lambda self: dict(window))
    records = SimpleNamespace(logged=[])
    records.log = records.logged.append
    trainer = tiny_trainer(steps=6, log_every=2, sinks=(records,))
    summary = trainer.fit()
    assert [r["alloc_retries"] for r in records.logged] == [2.0, 2.0, 2.0]
    assert summary.alloc_retries == 6.0 and summary.ooms == 3.0
    assert summary.peak_mem_gb == 1.0 and summary.peak_reserved_gb == 1.5


# ---- what measuring memory costs a step ---------------------------------------------------


def stats_reads_per_step(fake_gpu: FakeCachingAllocator, phase_peaks: bool, grad_accum: int = 1,
                         warmup_steps: int = 0) -> list[int]:
    """The reads of the allocator's stats (memory_stats, and the calls built on it) in each
    step of a short run, with the trainer's monitor watching the fake GPU."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    steps = 5
    batches = [(torch.randn(2, 4), torch.randint(0, 3, (2,))) for _ in range(steps * grad_accum)]
    ranks = distributed.Ranks(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    reads: list[int] = []
    hook = SimpleNamespace(before_step=lambda step: reads.append(-fake_gpu.calls.count("memory_stats")),
                           after_step=lambda step: reads.__setitem__(-1, reads[-1] + fake_gpu.calls.count("memory_stats")))
    settings = TrainerSettings(steps=steps, batch_size=2 * grad_accum, grad_accum=grad_accum, log_every=2,
                             warmup_steps=warmup_steps)
    trainer = Trainer(settings, ranks, model, OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1)),
                      batches=Batches(batches), memory=MemoryMonitor(torch.device("cuda", 0), phase_peaks=phase_peaks),
                      hooks=Hooks(steps=[hook]))
    summary = trainer.fit()
    assert summary.peak_reserved_gb >= 0 and summary.alloc_retries == 0  # the window's figures stay
    return reads


def test_a_step_reads_the_allocators_stats_once_per_phase_boundary(fake_gpu: FakeCachingAllocator) -> None:
    """Each read builds the allocator's whole dict of stats: on a small, launch-bound model that
    costs throughput. Per-phase peaks read once where a phase starts, and once after the
    optimizer step; with grad_accum, once more per micro-batch's forward and backward. Only in
    the warm-up steps, and at least the first two (the second holds the optimizer's state):
    the timed steps read none."""
    assert stats_reads_per_step(fake_gpu, phase_peaks=True) == [4, 4, 0, 0, 0]
    assert stats_reads_per_step(fake_gpu, phase_peaks=True, warmup_steps=3) == [4, 4, 4, 0, 0]
    assert stats_reads_per_step(fake_gpu, phase_peaks=True, grad_accum=2) == [6, 6, 0, 0, 0]


def test_without_phase_peaks_a_step_reads_no_stats_and_a_window_one(fake_gpu: FakeCachingAllocator) -> None:
    assert stats_reads_per_step(fake_gpu, phase_peaks=False) == [0] * 5
    monitor = MemoryMonitor(torch.device("cuda", 0), phase_peaks=False)
    monitor.start_run()
    fake_gpu.alloc(GB, retry=True)
    fake_gpu.calls.clear()
    for phase in ("forward", "backward", "optimizer_step"):
        monitor.start_phase(phase)
    monitor.end_phase()
    peaks = monitor.window_peaks()
    assert fake_gpu.calls.count("memory_stats") == 1
    assert peaks == {"peak_mem_gb": 1.0, "peak_active_gb": 1.0, "peak_reserved_gb": 1.0,
                     "alloc_retries": 1.0, "ooms": 0.0}


# ---- the peak memory.limit_gb caps, in the summary ----------------------------------------


def test_under_a_limit_a_gpu_run_records_the_reserved_peak_the_limit_caps(fake_gpu: FakeCachingAllocator) -> None:
    """set_per_process_memory_fraction caps the caching allocator's reserved memory, so under
    memory.limit_gb a GPU run's summary holds its reserved peak as `peak_under_limit_gb`;
    a CPU run's is the limit's own count, gathered from the ranks."""
    from fsdp_exp.memory import under_limit_figures

    def step_allocates(step: int) -> None:  # 1.5 GB in a step; freed after it, it stays reserved
        fake_gpu.alloc(3 * GB // 2)
        fake_gpu.free(3 * GB // 2)

    hook = SimpleNamespace(before_step=step_allocates, after_step=lambda step: None)
    trainer = tiny_trainer(steps=4, log_every=2, hooks=(hook,), memory=MemoryMonitor(torch.device("cuda", 0)))
    summary = trainer.fit()
    assert under_limit_figures(8.0, "cuda", summary.peak_reserved_gb_per_rank) == {
        "limit_gb": 8.0, "peak_under_limit_gb": 1.5, "peak_under_limit_gb_per_rank": [1.5]}
    assert under_limit_figures(None, "cuda", summary.peak_reserved_gb_per_rank) == {}
    assert under_limit_figures(1.0, "cpu", None, [0.7, 0.8], [0.4, 0.5]) == {
        "limit_gb": 1.0, "peak_under_limit_gb": 0.8, "peak_under_limit_gb_per_rank": [0.7, 0.8],
        "held_before_limit_gb_per_rank": [0.4, 0.5]}


def test_what_the_device_held_at_the_reserved_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """device_used_gb, beside the estimate's device figure: what torch.cuda.mem_get_info says
    every process holds on the device at the end (the CUDA context, NCCL and cuBLAS with the
    allocator's segments), plus how far the allocator's reserved memory then is below its
    peak (freed under pressure). The GPU's figures here are fakes of torch.cuda's calls."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GB, 80 * GB))  # 10 GB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8 * GB)
    assert device_used_gb(torch.device("cuda", 0), peak_reserved_gb=9.0) == pytest.approx(11.0)
    assert device_used_gb(torch.device("cuda", 0), peak_reserved_gb=8.0) == pytest.approx(10.0)
    assert device_used_gb(torch.device("cpu"), peak_reserved_gb=8.0) is None


def test_a_rank_reports_what_its_device_held_at_its_own_reserved_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeviceUsed, the after-fit hook: rank 1 of 2 adds how far below its own peak (9 GB, not
    rank 0's 3 GB) its allocator's reserve now is. One process here, so the gather returns this
    rank's figure alone; the gather itself runs on 2 real ranks in the CPU runs."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GB, 80 * GB))  # 10 GB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8 * GB)
    second = distributed.Ranks(rank=1, local_rank=1, world_size=2, device=torch.device("cuda", 1))
    summary = Summary(peak_reserved_gb_per_rank=[3.0, 9.0])
    assert DeviceUsed(second).figures(summary) == {"device_used_gb_per_rank": [pytest.approx(11.0)],
                                                   "device_used_gb": pytest.approx(11.0)}
    assert DeviceUsed(second).figures(Summary()) == {}  # nothing trained: no peak to add to
    on_cpu = distributed.Ranks(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))
    assert DeviceUsed(on_cpu).figures(summary) == {}
