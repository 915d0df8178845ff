"""A GPU's memory as the estimate models it, without a GPU: the replay of the CUDA caching
allocator on hand cases worked out from its rules (fsdp_exp/estimate/allocator.py names them;
torch's c10/cuda/CUDACachingAllocator.cpp), and what sits beside it (fsdp_exp/estimate/gpu.py)."""

from __future__ import annotations

import pytest
import torch

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.errors import ConfigError
from fsdp_exp.estimate.allocator import CachingAllocator, PastTheCap, replay, reserved_under, segment_size
from fsdp_exp.estimate.breakdown import estimate_batch
from fsdp_exp.estimate.gpu import allocator_cap_gb, cublas_workspaces, gpu_named, outside_allocator_gb
from fsdp_exp.estimate.predict import estimate, fits
from fsdp_exp.estimate.counting import LiveBytes
from fsdp_exp.estimate.trace import trace
from fsdp_exp.estimate.traced import StepTrace, TracedPeak
from fsdp_exp.sharding import FullyShard, HybridShard
from tests.counting import least_cap

MIB = 2**20


def test_a_small_request_is_a_512_byte_block_of_a_2_mib_segment() -> None:
    a = CachingAllocator()
    a.malloc("x", 1)
    assert (a.allocated, a.reserved) == (512, 2 * MIB)
    a.malloc("y", 513)  # rounds up to 1024, from the same segment's rest
    assert (a.allocated, a.reserved) == (512 + 1024, 2 * MIB)


def test_small_blocks_pack_into_2_mib_segments_and_the_third_mib_takes_a_new_one() -> None:
    a = CachingAllocator()
    for key in "abc":
        a.malloc(key, MIB)  # 1 MiB is still small: half a segment each
    assert (a.allocated, a.reserved) == (3 * MIB, 4 * MIB)


def test_a_request_between_1_and_10_mib_cuts_a_20_mib_segment_and_the_next_one_shares_it() -> None:
    a = CachingAllocator()
    a.malloc("a", MIB + 1)  # large pool: 1 MiB + 512 from a new 20 MiB segment, the rest stays free
    a.malloc("b", 5 * MIB)
    assert (a.allocated, a.reserved) == (6 * MIB + 512, 20 * MIB)


def test_freed_blocks_are_cached_per_stream() -> None:
    a = CachingAllocator()
    a.malloc("a", 5 * MIB, stream=0)
    a.malloc("b", 5 * MIB, stream=1)  # the first segment's rest is stream 0's
    assert a.reserved == 40 * MIB
    a.free("a")
    a.malloc("c", 5 * MIB, stream=1)  # stream 1's own segment still has room
    assert a.reserved == 40 * MIB


def test_requests_from_10_mib_take_a_segment_of_their_size_rounded_to_2_mib() -> None:
    assert [segment_size(s) for s in (512, MIB, MIB + 512, 10 * MIB - 512, 10 * MIB, 11 * MIB)] == \
        [2 * MIB, 2 * MIB, 20 * MIB, 20 * MIB, 10 * MIB, 12 * MIB]
    a = CachingAllocator()
    a.malloc("a", 11 * MIB)  # a 12 MiB segment; 1 MiB left is not more than 1 MiB: not split
    assert (a.allocated, a.reserved) == (12 * MIB, 12 * MIB)
    a.malloc("b", 12 * MIB + 1)  # 12 MiB + 512 in a 14 MiB segment: 1.5 MiB left is split off
    assert (a.allocated, a.reserved) == (24 * MIB + 512, 26 * MIB)


def test_a_freed_block_merges_with_its_free_neighbours_and_serves_a_larger_request() -> None:
    a = CachingAllocator()
    for key in "abc":
        a.malloc(key, 3 * MIB)  # one 20 MiB segment: a b c, 11 MiB free
    a.free("b")
    a.malloc("d", 4 * MIB)  # b's 3 MiB hole is too small: from the 11 MiB rest
    a.free("c")  # c merges with b's hole before it: 6 MiB; d, after it, is live
    a.free("d")  # d merges with both sides: b + c + d + the 7 MiB rest, 17 MiB free after a
    a.malloc("e", 17 * MIB)
    assert (a.allocated, a.reserved, a.peak_reserved) == (20 * MIB, 20 * MIB, 20 * MIB)


def test_a_new_segment_past_the_cap_first_releases_the_wholly_free_ones() -> None:
    events = [("a", 3 * MIB, 0), ("a", -1, 0), ("b", 12 * MIB, 1)]
    uncapped = replay(events)
    assert uncapped.reserved == 32 * MIB  # stream 1 cannot use stream 0's cached 20 MiB
    capped = replay(events, cap=20 * MIB)
    assert capped.reserved == 12 * MIB  # the cached segment went back first
    with pytest.raises(PastTheCap):
        replay(events, cap=10 * MIB)
    assert least_cap(events) == 20 * MIB


def test_a_segment_holding_a_live_block_is_not_released() -> None:
    events = [("a", 3 * MIB, 0), ("keep", 512, 0), ("a", -1, 0), ("b", 19 * MIB, 0)]
    # keep is small: its own 2 MiB segment; a's 20 MiB segment is free and on stream 0
    assert replay(events).reserved == 22 * MIB and least_cap(events) == 22 * MIB
    pinned = [("a", 3 * MIB, 0), ("keep", 2 * MIB, 0), ("a", -1, 0), ("b", 19 * MIB, 0)]
    # keep (2 MiB) shares a's segment and pins it: b needs a segment of its own
    assert replay(pinned).reserved == 40 * MIB and least_cap(pinned) == 40 * MIB


def test_each_allocation_goes_to_the_replay_on_the_stream_it_was_made_on() -> None:
    counts = LiveBytes(offloaded=("OptState",), workspaces=(32 * MIB,))
    assert counts.device.reserved == 32 * MIB  # cuBLAS's workspace, from the start
    with torch.cpu.stream(torch.cpu.Stream()):  # as FSDP2's all-gather copy-in stream
        counts.allocate("gathered", "Activation", 5 * MIB)  # a 20 MiB segment of that stream
    counts.release("gathered", "Activation", 5 * MIB)
    counts.allocate("activation", "Activation", 5 * MIB)  # the compute stream cannot take its cached block
    counts.allocate("state", "OptState", 5 * MIB)  # offloaded: in host memory, not on the device
    counts.allocate("freed storage", "Parameter", 0)  # FSDP2 resizes a freed parameter to 0 bytes: no block
    counts.see()
    assert counts.device.reserved == counts.peaks["segments"].bytes == 72 * MIB
    assert counts.peaks["blocks"].bytes == 5 * MIB and counts.peaks["cpu"].bytes == 10 * MIB
    assert len(counts.streams) == 2 and len(counts.device.live) == 2


def test_fsdp2_allocates_on_three_streams_and_ddp_on_one() -> None:
    plan = prepare(compose_checked(["model.num_layers=2", "wandb.mode=disabled", "sharding=full"]), 0)
    assert trace(plan.exp, 2, [4], on_gpu=True).steps[0].streams == 3  # compute, all-gather copy-in, reduce-scatter
    plan = prepare(compose_checked(["model.num_layers=2", "wandb.mode=disabled", "sharding=ddp"]), 0)
    assert trace(plan.exp, 2, [4], on_gpu=True).steps[0].streams == 1


def test_under_a_cap_a_steps_allocations_replay_with_the_cache_released_before_it_runs_out() -> None:
    counts = LiveBytes(offloaded=(), keep_events=True)  # as a trace under a cap keeps them
    with torch.cpu.stream(torch.cpu.Stream()):  # as FSDP2's all-gather copy-in stream
        counts.allocate("a", "Activation", 3 * MIB)  # a 20 MiB segment of that stream
    counts.release("a", "Activation", 3 * MIB)  # cached, wholly free, for that stream only
    counts.allocate("b", "Activation", 12 * MIB)  # a 12 MiB segment of the compute stream
    assert counts.device.peak_reserved == 32 * MIB  # uncapped, the cached segment stays
    assert reserved_under(counts.events, 24 * MIB) == 20 * MIB  # under 24 MiB it goes back before b's
    counts.allocate("c", "Activation", 14 * MIB)
    assert reserved_under(counts.events, 24 * MIB) is None  # 26 MiB with nothing cached: out of memory


def test_an_estimate_under_a_limit_holds_what_the_allocator_releases_near_it() -> None:
    """FSDP2's three streams leave cached segments that the compute stream cannot use: under a
    limit just below the uncapped replay's reserved peak the allocator gives them back and the
    step fits, as on a GPU (the replay used to run uncapped and say it did not)."""
    plan = prepare(compose_checked(["model.num_layers=2", "wandb.mode=disabled", "sharding=full"]), 0)
    over = estimate(plan.exp, 2, [64], on_gpu=True).peak_reserved_gb
    limit = over - 2 * MIB / 2**30
    limited = prepare(compose_checked(["model.num_layers=2", "wandb.mode=disabled", "sharding=full",
                                       f"memory.limit_gb={limit!r}"]), 0)
    record = estimate(limited.exp, 2, [64], on_gpu=True)
    assert record.largest_batch_fitting == 64 and record.peak_reserved_gb <= limit


def test_the_allocators_cap_is_the_limit_or_what_the_named_gpu_leaves_it() -> None:
    h100 = gpu_named("H100-SXM")
    assert allocator_cap_gb(None, None, 1.0) is None
    assert allocator_cap_gb(10.0, None, 1.0) == 10.0
    assert allocator_cap_gb(None, h100, 1.5) == pytest.approx(h100.memory_gb - 1.5)
    assert allocator_cap_gb(90.0, h100, 1.5) == pytest.approx(h100.memory_gb - 1.5)  # the device is the smaller


# --- what sits beside the allocator on a GPU, and the GPUs by name (fsdp_exp/estimate/gpu.py) ---

def test_a_gpu_is_named_as_the_table_has_it_or_by_its_memory() -> None:
    assert gpu_named("h100 sxm").name == "H100-SXM" and gpu_named("A100_40GB").memory_gb == 39.39
    assert gpu_named("24").memory_gb == 24 and gpu_named("24GB").name == "24 GB"
    with pytest.raises(ConfigError, match=r"task.gpu=H300: name a GPU \(B200, .*\) or its memory in GB"):
        gpu_named("H300")


def test_a_gpus_memory_is_what_torch_reports_not_the_datasheets() -> None:
    """The fit is judged against what torch.cuda.get_device_properties(i).total_memory says a
    GPU holds, which the driver keeps some of back from the datasheet's GB: an H100-SXM's
    81089 MiB is 79.19 GiB, not 80; an H200's 143156 MiB is 139.8, not 141."""
    from fsdp_exp.estimate.gpu import GPUS

    assert gpu_named("H100-SXM").memory_gb == 79.19 and gpu_named("H200-SXM").memory_gb == 139.8
    datasheet = {"B200": 180, "H200-SXM": 141, "H200-NVL": 141, "H100-SXM": 80, "H100-PCIe": 80, "H100-NVL": 94,
                 "A100-80GB": 80, "A100-40GB": 40, "L40S": 48, "L40": 48, "A10": 24, "A10G": 24, "L4": 24,
                 "RTX-4090": 24, "RTX-3090": 24, "V100-32GB": 32, "V100-16GB": 16, "T4": 16}
    assert {g.name for g in GPUS} == set(datasheet)
    for gpu in GPUS:  # below the datasheet by the driver's share (under 12%), or the datasheet where none was seen
        below = 1 - gpu.memory_gb / datasheet[gpu.name]
        assert 0.005 < below < 0.12 or ("datasheet" in gpu.source and "not seen" in gpu.source), gpu


def test_each_process_group_is_an_nccl_communicator_and_nvswitch_boards_add_nvls() -> None:
    full, hybrid = FullyShard(), HybridShard(replicate=2)
    assert outside_allocator_gb(1, full.groups(1), None) == {"cuda_context": 0.5, "nccl": 0.0}
    assert outside_allocator_gb(2, full.groups(2), None)["nccl"] == pytest.approx(0.544)  # nccl#964: 2 GPUs
    a100, h100 = gpu_named("A100-80GB"), gpu_named("H100-SXM")
    assert outside_allocator_gb(8, full.groups(8), a100)["nccl"] == pytest.approx(0.688)
    assert outside_allocator_gb(8, full.groups(8), h100)["nccl"] == pytest.approx(0.688 + 1.0)  # NVLS
    # HSDP on 8: the world, a replica group of 2 and a shard group of 4
    assert hybrid.groups(8) == (2, 4)
    assert outside_allocator_gb(8, hybrid.groups(8), h100)["nccl"] == pytest.approx(0.688 + 1.0 + 0.544 + 0.688 + 1.0)
    assert FullyShard(reshard_after_forward=4).groups(8) == (4,)  # FSDP2's post-forward mesh
    # cuBLAS: the forward's workspace and backward's (autograd's thread), by compute capability
    assert cublas_workspaces(h100) == cublas_workspaces(gpu_named("B200")) == (32 * MIB, 32 * MIB)
    assert cublas_workspaces(a100) == (4096 * 1024 * 2 + 16 * 1024 * 8,) * 2


def test_on_a_gpu_the_cap_counts_reserved_and_the_device_adds_what_sits_outside() -> None:
    peak = TracedPeak(3 * MIB, {"Parameter": 3 * MIB}, "forward")
    step = StepTrace(4, {"cpu": peak, "blocks": peak, "segments": TracedPeak(20 * MIB, {}, "forward")}, 0, 0, [])
    gb = 2**30
    made = estimate_batch(step, None, on_gpu=True, offload=False, baseline_gb=1.0, builds_whole_model=False,
                          workspace_bytes=32 * MIB)
    assert made.peak_reserved_gb * gb == 20 * MIB  # the replay's segments (cuBLAS's workspaces are in them)
    assert made.breakdown_gb["unsharded_and_buffers"] * gb == 32 * MIB  # allocated: the workspace counts
    assert made.peak_under_limit_gb == made.peak_reserved_gb and made.device_used_gb == pytest.approx(made.peak_reserved_gb + 1.0)
    batch = made.to_json()
    assert fits(batch, None, None) is None
    assert fits(batch, 0.02, None) and not fits(batch, 0.019, None)  # memory.limit_gb caps reserved, 0.0195 GB
    assert fits(batch, None, 1.02) and not fits(batch, None, 1.0)  # the GPU's memory holds reserved + 1 GB outside
