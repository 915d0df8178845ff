"""The CUDA caching allocator, as the estimate counts a GPU's memory: its sizes, and a
replay of its rules on a rank's allocations and frees (`CachingAllocator`).

The rules are torch's (c10/cuda/CUDACachingAllocator.cpp, torch 2.x, with its default
settings: no max_split_size, no expandable segments, no power-of-two rounding):
- every block is rounded up to a multiple of 512 bytes (at least 512);
- blocks up to 1 MiB live in the small pool, larger ones in the large pool;
- a request takes the smallest free block of its pool, cached on the same stream, that
  holds it; with none, a new segment: 2 MiB for a small block, 20 MiB for a block under
  10 MiB, else the block rounded up to 2 MiB;
- the block taken is split when what is left is at least 512 bytes (small pool) or more
  than 1 MiB (large pool); the rest stays a free block of the segment;
- a freed block merges with the free blocks beside it in its segment and stays cached:
  reserved memory does not shrink;
- a new segment that would pass the cap (`torch.cuda.set_per_process_memory_fraction`, or
  the device's free memory) first releases every cached segment that is wholly free; if
  it still does not fit, the allocation fails (out of memory).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

CUDA_BLOCK = 512  # every block a multiple of this
CUDA_SMALL = 2**20  # the largest block of the small pool
MIB = 2**20
SMALL_BUFFER = 2 * MIB  # a small block's segment
LARGE_BUFFER = 20 * MIB  # the segment of a block over 1 MiB and under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB


def cuda_block(nbytes: int) -> int:
    return max(CUDA_BLOCK, math.ceil(nbytes / CUDA_BLOCK) * CUDA_BLOCK) if nbytes else 0


def segment_size(block: int) -> int:
    """The segment a new block of this (rounded) size is cut from."""
    if block <= CUDA_SMALL:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return math.ceil(block / ROUND_LARGE) * ROUND_LARGE


class PastTheCap(Exception):
    """A new segment does not fit under the cap, even with the cached ones released."""


@dataclass(eq=False)
class Block:
    """A stretch of one segment: allocated, or cached free in its pool."""

    size: int
    stream: int
    segment: int
    offset: int
    pool_small: bool  # the small pool's (blocks up to 1 MiB), or the large pool's
    allocated: bool = False

    def key(self) -> tuple[int, int, int, int]:
        """Where it sorts among a pool's free blocks: stream, then size, then address."""
        return (self.stream, self.size, self.segment, self.offset)


@dataclass
class CachingAllocator:
    """A replay: `malloc` and `free` as a rank's program makes them; `allocated` and
    `reserved` now and at their peaks, as torch.cuda.memory_stats counts them
    (allocated_bytes counts whole blocks, a block left unsplit included)."""

    cap: int | None = None  # bytes the segments may take in all
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    live: dict[object, Block] = field(default_factory=dict)
    _free: dict[bool, list[tuple[tuple[int, int, int, int], Block]]] = field(
        default_factory=lambda: {True: [], False: []})
    _segments: dict[int, list[Block]] = field(default_factory=dict)  # each segment's blocks, by address
    _ids: itertools.count = field(default_factory=itertools.count)

    def malloc(self, key: object, nbytes: int, stream: int = 0) -> Block:
        size = cuda_block(max(nbytes, 1))
        small = size <= CUDA_SMALL
        block = self._take_free(small, stream, size) or self._new_segment(small, stream, size)
        if self._should_split(block, size):
            self._split(block, size)
        block.allocated = True
        self.live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, key: object) -> None:
        block = self.live.pop(key)
        block.allocated = False
        self.allocated -= block.size
        blocks = self._segments[block.segment]
        at = blocks.index(block)
        for neighbour in (blocks[at + 1] if at + 1 < len(blocks) else None, blocks[at - 1] if at else None):
            if neighbour is not None and not neighbour.allocated:
                self._unlist(neighbour)
                blocks.remove(neighbour)
                block.offset = min(block.offset, neighbour.offset)
                block.size += neighbour.size
        self._list(block)

    def _take_free(self, small: bool, stream: int, size: int) -> Block | None:
        pool = self._free[small]
        at = bisect.bisect_left(pool, (stream, size, -1, -1), key=lambda entry: entry[0])
        if at == len(pool) or pool[at][1].stream != stream:
            return None
        return pool.pop(at)[1]

    def _new_segment(self, small: bool, stream: int, size: int) -> Block:
        bytes_ = segment_size(size)
        if self.cap is not None and self.reserved + bytes_ > self.cap:
            self._release_cached()
            if self.reserved + bytes_ > self.cap:
                raise PastTheCap(f"a segment of {bytes_} bytes over {self.reserved} reserved passes the cap {self.cap}")
        segment = next(self._ids)
        block = Block(bytes_, stream, segment, 0, small)
        self._segments[segment] = [block]
        self.reserved += bytes_
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    @staticmethod
    def _should_split(block: Block, size: int) -> bool:
        remaining = block.size - size
        return remaining >= CUDA_BLOCK if block.pool_small else remaining > CUDA_SMALL

    def _split(self, block: Block, size: int) -> None:
        rest = Block(block.size - size, block.stream, block.segment, block.offset + size, block.pool_small)
        block.size = size
        blocks = self._segments[block.segment]
        blocks.insert(blocks.index(block) + 1, rest)
        self._list(rest)

    def _list(self, block: Block) -> None:
        bisect.insort(self._free[block.pool_small], (block.key(), block), key=lambda entry: entry[0])

    def _unlist(self, block: Block) -> None:
        pool = self._free[block.pool_small]
        at = bisect.bisect_left(pool, block.key(), key=lambda entry: entry[0])
        assert pool[at][1] is block
        pool.pop(at)

    def _release_cached(self) -> None:
        """Every segment that is one free block goes back to the device."""
        for segment, blocks in list(self._segments.items()):
            if len(blocks) == 1 and not blocks[0].allocated:
                self._unlist(blocks[0])
                del self._segments[segment]
                self.reserved -= blocks[0].size


Event = tuple[object, int, int]  # (key, bytes, stream) allocates; (key, -1, 0) frees key


def replay(events: Iterable[Event], cap: int | None = None) -> CachingAllocator:
    """The allocator after `events`; PastTheCap if a segment passes `cap`."""
    allocator = CachingAllocator(cap)
    for key, nbytes, stream in events:
        if nbytes < 0:
            allocator.free(key)
        else:
            allocator.malloc(key, nbytes, stream)
    return allocator


def reserved_under(events: Iterable[Event], cap: int) -> int | None:
    """The reserved peak of `events` where the allocator may reserve `cap` bytes in all (it
    releases its cached segments before passing it, as torch's does); None where they pass it
    all the same: out of memory."""
    try:
        return replay(events, cap).peak_reserved
    except PastTheCap:
        return None
