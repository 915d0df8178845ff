"""Each of fsdp_exp's calls into torch.cuda, run on a CPU with that call stubbed as torch
documents it, so that the GPU-only lines run in the suite (`bench/gpu_lines.py` measures
the share; docs/gpu.md). What the GPU itself does with them only a GPU shows
(`make gpu-session`)."""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fsdp_exp import distributed
from fsdp_exp.commands.check_gpu import gpus_here
from fsdp_exp.checkpoint.dcp import staging_for
from fsdp_exp.checkpoint.state import _rng_state, _set_rng_state
from fsdp_exp.memory import apply_limit
from fsdp_exp.metrics.environment import rank_environment
from fsdp_exp.metrics.flops import device_peak
from fsdp_exp.precision import Precision
from fsdp_exp.rank.peak_settled import judged_peak_gb

GB = 2**30
GPU = torch.device("cuda", 1)


def properties(total_gb: float) -> SimpleNamespace:
    return SimpleNamespace(total_memory=int(total_gb * GB), name="NVIDIA H100 80GB HBM3")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """torch.cuda's calls, recorded: two GPUs of 79.19 and 39.39 GB."""
    made: list[tuple] = []
    sizes = {0: 79.19, 1: 39.39}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: properties(sizes[torch.device(device).index if not isinstance(device, int)
                                                             else device]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: made.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: made.append(("fraction", round(fraction, 4), device)))
    return made


def test_a_rank_takes_the_gpu_of_its_local_rank(calls: list[tuple], monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    # the process group is up already (a launcher met through its store), so only the device is chosen
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        for key, value in {"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("FSDP_EXP_DEVICE", raising=False)
        ranks = distributed.init("cuda")
    finally:
        dist.destroy_process_group()
    assert ranks.device == GPU and calls == [("set_device", GPU)]


def test_a_timer_waits_for_the_gpus_queue_and_a_cpus_has_none(calls: list[tuple]) -> None:
    distributed.synchronize(torch.device("cpu"))
    distributed.synchronize(GPU)
    assert calls == [("synchronize", GPU)]


def test_a_limit_caps_the_allocator_as_a_fraction_of_the_ranks_own_gpu(calls: list[tuple]) -> None:
    apply_limit(20.0, GPU)  # cuda:1 holds 39.39 GB
    apply_limit(60.0, GPU)  # past the GPU: the whole of it
    assert calls == [("fraction", round(20 / 39.39, 4), GPU), ("fraction", 1.0, GPU)]


def test_the_smallest_gpu_is_the_one_the_checks_size_for(calls: list[tuple]) -> None:
    gpus, smallest = gpus_here()
    assert gpus == 2 and smallest == pytest.approx(39.39)


def test_a_gpu_ranks_environment_names_its_gpu_nccl_and_memory(calls: list[tuple],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    seen = rank_environment(GPU)
    assert (seen["device"], seen["nccl"], seen["device_count"]) == ("NVIDIA H100 80GB HBM3", "2.21.5", 2)
    assert seen["device_memory_gb"] == pytest.approx(39.39)  # the rank's own GPU, not cuda:0


def test_a_gpus_mfu_peak_comes_from_the_table_by_its_name(calls: list[tuple]) -> None:
    found = device_peak(GPU, "bf16", None)
    assert found.tflops == 989.5 and found.source.startswith("H100 SXM")  # H100 datasheet: 1,979 sparse
    assert device_peak(torch.device("cpu"), "bf16", None).tflops is None


def test_tf32_is_set_for_a_gpu_run_both_ways() -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert Precision(tf32=False).apply_tf32("cuda") is False
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        assert Precision(tf32=True).apply_tf32("cuda") is True
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        assert Precision(tf32=True).apply_tf32("cpu") is False  # the CPU's oneDNN matmuls are left alone
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_gpu_ranks_random_state_is_saved_and_restored_with_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = {"state": torch.arange(16, dtype=torch.uint8)}  # the GPU generator's state: a byte tensor
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": generator.__setitem__("state", state.clone()))
    saved = _rng_state(GPU)
    generator["state"] = torch.zeros(16, dtype=torch.uint8)
    _set_rng_state(saved, GPU)
    assert torch.equal(generator["state"], torch.arange(16, dtype=torch.uint8))


def test_a_gpu_rank_stages_pinned_checkpoints_on_torchs_stager_and_a_cpu_rank_on_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # the stager's own look for a GPU
    monkeypatch.setattr(torch, "Stream", lambda: "the staging stream")  # and the stream it takes on it
    on_gpu = staging_for(GPU)
    try:
        assert isinstance(on_gpu, DefaultStager)
        assert on_gpu._config.use_pinned_memory and on_gpu._config.use_async_staging
        assert on_gpu._staging_stream == "the staging stream"  # copies beside the compute stream
    finally:
        on_gpu.close()
    assert not isinstance(staging_for(torch.device("cpu")), DefaultStager)


def test_a_gpu_probe_judges_its_windows_allocated_peak() -> None:
    assert judged_peak_gb(GPU, lambda: 3.5) == 3.5
