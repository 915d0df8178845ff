"""The replay of the CUDA caching allocator, on hand cases worked out from its rules
(fsdp_exp/estimate/allocator.py names them; torch's c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

import pytest

from fsdp_exp.estimate.allocator import CachingAllocator, OutOfMemory, least_cap, replay, segment_size

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
    with pytest.raises(OutOfMemory):
        replay(events, cap=10 * MIB)
    assert least_cap(events) == 20 * MIB


def test_a_segment_holding_a_live_block_is_not_released() -> None:
    events = [("a", 3 * MIB, 0), ("keep", 512, 0), ("a", -1, 0), ("b", 19 * MIB, 0)]
    # keep is small: its own 2 MiB segment; a's 20 MiB segment is free and on stream 0
    assert replay(events).reserved == 22 * MIB and least_cap(events) == 22 * MIB
    pinned = [("a", 3 * MIB, 0), ("keep", 2 * MIB, 0), ("a", -1, 0), ("b", 19 * MIB, 0)]
    # keep (2 MiB) shares a's segment and pins it: b needs a segment of its own
    assert replay(pinned).reserved == 40 * MIB and least_cap(pinned) == 40 * MIB
