"""The CUDA caching allocator's sizes, as the estimate counts them (torch's
c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

import math

# The CUDA caching allocator: every block a multiple of 512 bytes; blocks up to 1 MiB come
# from 2 MiB segments, larger ones from segments rounded up to 2 MiB.
CUDA_BLOCK = 512
CUDA_SMALL = 2**20
CUDA_SEGMENT = 2 * 2**20


def cuda_block(nbytes: int) -> int:
    return max(CUDA_BLOCK, math.ceil(nbytes / CUDA_BLOCK) * CUDA_BLOCK) if nbytes else 0


def cuda_segment(nbytes: int) -> int:
    """The reserved memory a live block of this size takes when it does not share a segment."""
    block = cuda_block(nbytes)
    return block if block <= CUDA_SMALL else math.ceil(block / CUDA_SEGMENT) * CUDA_SEGMENT
