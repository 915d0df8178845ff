"""What a CPU rank's matrix multiplications keep allocated besides their tensors.

MKL, torch's BLAS on x86, keeps the buffers it packs matrices into for reuse by the next
multiplication: held from a rank's first step on, in what its allocations hold
(`peak_in_use_gb`), and seen by no trace of tensors (6.6 MB after the CNN's 9216 x 128 layer
at batch 32, which is 13% of that run's figure). Their size follows the shapes multiplied
and the threads, so the trace records the multiplications of each step it counts
(`Gemms`) and runs each once for real, on zeros, with a rank's threads, and measures what
stays allocated (`kept_bytes`). Past REPLAY_FLOPS the replay is left out: a step that
large holds far more than the buffers, and replaying it would take the trace's minutes.
"""

from __future__ import annotations

import torch

from fsdp_exp.metrics.peaks import heap_in_use_bytes

# The multiplications BLAS runs, by the positions of their two matrices among the arguments.
MATRICES = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2),
            torch.ops.aten.bmm.default: (0, 1), torch.ops.aten.baddbmm.default: (1, 2)}
REPLAY_FLOPS = 2e10  # about a second on one core


class Gemms:
    """The multiplications seen, each (op, its tensor arguments' shapes, strides and dtypes) once."""

    def __init__(self) -> None:
        self.seen: dict[tuple, None] = {}

    def see(self, func: object, args: tuple) -> None:
        if func not in MATRICES:
            return
        tensors = tuple((tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a
                        for a in args)
        self.seen.setdefault((func, tensors), None)

    def flops(self) -> float:
        total = 0.0
        for func, args in self.seen:
            first, second = (args[i] for i in MATRICES[func])
            *batch, m, k = first[0]
            total += 2 * m * k * second[0][-1] * (batch[0] if batch else 1)
        return total


def kept_bytes(gemms: Gemms, threads: int, since: int) -> int | None:
    """What stays allocated (`heap_in_use_bytes`) after running each multiplication once, on
    zeros with `threads` threads, above `since` (what this process held before the first
    replay: buffers only grow, so batch sizes replayed in order each get theirs); None when
    the replay is past REPLAY_FLOPS or there is no glibc to count with."""
    if gemms.flops() > REPLAY_FLOPS or heap_in_use_bytes() is None:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for func, args in gemms.seen:
                real = [torch.empty_strided(a[0], a[1], dtype=a[2]).zero_() if isinstance(a, tuple) else a
                        for a in args]
                func(*real)  # type: ignore[operator]
                del real
    finally:
        torch.set_num_threads(before)
    return max((heap_in_use_bytes() or 0) - since, 0)
