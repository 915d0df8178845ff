"""What a CPU rank's math libraries keep of their own after its first step.

MKL, torch's BLAS on x86, keeps the buffers it packs matrices into for the next
multiplication (6.6 MB after the CNN's 9216 x 128 layer at batch 32, 13% of that run's
`peak_in_use_gb`); oneDNN, which runs the convolutions, keeps the code it generates for each
shape and its scratch memory outside malloc (about 60 MB of data segment for a
MobileNetV3 on 64 x 64 images, which memory.limit_gb counts). No trace of tensors sees them,
and their size follows the shapes and the threads. So the trace records the library ops of
each step it counts (`LibraryOps`) and runs each once for real, on zeros, with a rank's
threads, and measures what stays allocated and how far the data segment grew
(`kept`). Past REPLAY_FLOPS the replay is left out (it would take minutes): such a step
holds far more than the libraries, and is given what the largest step replayed keeps.

The libraries keep their buffers and code per shape, so a replay after another holds both:
replayed one after another in one process, a GPT's batches 1 to 32 measured 4.0 to 11.9 MB
where each alone keeps 4.0 to 4.7. A rank runs one batch size, so a trace of several
(`kept_by_step`) replays its first here and its largest in a fresh process (`python -m
fsdp_exp.estimate.library`), and puts those between on the line through the two. What a
fresh process keeps after a set of ops is kept in fsdp_exp's cache folder (`library/`), by the
ops, the threads and this machine: a trace of the same shapes (a tune's setups that differ only
in how they shard, the same setup traced again) reads it back instead of replaying it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import pickle
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fsdp_exp.estimate.earlier import cache_dir, this_machine
from fsdp_exp.linux import heap_in_use_bytes, map_large_blocks, proc_status
from fsdp_exp.torch_private import op, op_name

aten = torch.ops.aten
# The ops that run in MKL or oneDNN on a CPU, by the positions of the two tensors whose
# sizes set their work: matrices, or (input, weight) of a convolution.
OPERANDS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2), aten.convolution.default: (0, 1),
            aten.convolution_backward.default: (1, 2)}
REPLAY_FLOPS = 2e10  # about a second on one core
log = logging.getLogger("fsdp_exp")


@dataclass
class Kept:
    in_use_bytes: int  # what stays allocated through malloc (peak_in_use_gb counts it)
    data_bytes: int  # how far the data segment grew (what memory.limit_gb counts on CPU)


class LibraryOps:
    """The library ops seen, each (op, its arguments: tensors as shape, strides and dtype) once."""

    def __init__(self) -> None:
        self.seen: dict[tuple, None] = {}

    def see(self, func: object, args: tuple) -> None:
        if func not in OPERANDS:
            return
        described = tuple((tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor)
                          else tuple(a) if isinstance(a, list) else a for a in args)
        self.seen.setdefault((func, described), None)

    def flops(self) -> float:
        """About their work: a multiplication's 2mkn; a convolution's 2 x (input positions) x
        (weight), a bound for stride 1."""
        total = 0.0
        for func, args in self.seen:
            first, second = (args[i][0] for i in OPERANDS[func])
            if func in (aten.convolution.default, aten.convolution_backward.default):
                total += 2 * math.prod(first) / first[1] * math.prod(second)
            else:
                *batch, m, k = first
                total += 2 * m * k * second[-1] * (batch[0] if batch else 1)
        return total


def kept(ops: LibraryOps, threads: int) -> Kept | None:
    """Each op run once, on zeros with `threads` threads: what the libraries keep (above what
    this process held before; their buffers only grow, so batch sizes replayed in order each
    get theirs when measured against the same start, as `Replay` does). None past
    REPLAY_FLOPS or without glibc to count with."""
    if ops.flops() > REPLAY_FLOPS or heap_in_use_bytes() is None:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for func, args in ops.seen:
                real = [torch.empty_strided(a[0], a[1], dtype=a[2]).zero_() if is_tensor(a) else a for a in args]
                func(*real)  # type: ignore[operator]
                del real
    finally:
        torch.set_num_threads(before)
    return Kept(heap_in_use_bytes() or 0, proc_status().get("VmData:", 0) * 1024)


def is_tensor(described: object) -> bool:
    return isinstance(described, tuple) and len(described) == 3 and isinstance(described[2], torch.dtype)


class Replay:
    """The replays of a trace's steps, in order, each measured from the same start: glibc
    returns every block over 64 KiB on free from here on (as under memory.limit_gb), so what
    the zeros took is given back and only what the libraries keep stays."""

    def __init__(self) -> None:
        map_large_blocks()
        self.start = Kept(heap_in_use_bytes() or 0, proc_status().get("VmData:", 0) * 1024)

    def kept(self, ops: LibraryOps, threads: int) -> Kept | None:
        now = kept(ops, threads)
        if now is None:
            return None
        return Kept(max(now.in_use_bytes - self.start.in_use_bytes, 0), max(now.data_bytes - self.start.data_bytes, 0))


def kept_by_step(batch_sizes: Sequence[int], ops: Sequence[LibraryOps], threads: int) -> list[Kept | None]:
    """What the libraries keep after a step at each batch size, as a rank that runs only it
    would keep: the first replayed here, the largest within REPLAY_FLOPS in a fresh process,
    those between on the line through the two by batch size, and those past REPLAY_FLOPS
    what the largest replayed keeps. (Their buffers grow with the batch, so that is a lower
    bound; leaving them out would make the step past REPLAY_FLOPS hold less than the one
    before it: a GPT's curve grew 0.25 MB a sample from batch 32 to 64 where a run's grew 0.43.)
    None where the first step is past REPLAY_FLOPS, or without glibc to count with."""
    if not ops:
        return []
    first = Replay().kept(ops[0], threads)
    if first is None:
        return [None] * len(ops)
    last = max((k for k in range(1, len(ops)) if ops[k].flops() <= REPLAY_FLOPS), default=0)
    largest = replayed_alone(ops[last], threads) if last else first
    if largest is None:  # the fresh process failed: the first's, for every step
        last, largest = 0, first
    kept = [first] * len(ops)
    for k in range(1, len(ops)):
        share = (batch_sizes[min(k, last)] - batch_sizes[0]) / max(batch_sizes[last] - batch_sizes[0], 1)
        kept[k] = Kept(*(round(a + share * (b - a)) for a, b in ((first.in_use_bytes, largest.in_use_bytes),
                                                                   (first.data_bytes, largest.data_bytes))))
    return kept


def replayed_alone(ops: LibraryOps, threads: int) -> Kept | None:
    """`Replay().kept(ops, threads)` in a fresh process (None where it fails), or what an earlier
    replay of the same ops kept (`library/` of the cache folder). Traces side by side that need
    the same replay take turns: the first replays it, the others read it."""
    described = [(op_name(func), args) for func, args in ops.seen]
    path = kept_at(described, threads)
    with one_at_a_time(path):
        with contextlib.suppress(OSError, ValueError, TypeError):
            return Kept(**json.loads(path.read_text()))
        kept = replay_in_a_fresh_process(described, threads)
        if kept is not None:
            with contextlib.suppress(OSError):
                path.write_text(json.dumps(asdict(kept)))
        return kept


def kept_at(described: list, threads: int) -> Path:
    """Where a replay is kept: named by the ops (by name and their arguments' shapes, strides and
    dtypes), the threads, this machine and this module's code."""
    digest = hashlib.sha256(repr((described, threads, this_machine())).encode())
    digest.update(Path(__file__).read_bytes())
    return cache_dir() / "library" / f"{digest.hexdigest()[:32]}.json"


@contextlib.contextmanager
def one_at_a_time(path: Path) -> Iterator[None]:
    """Held by one process at a time (a lock file beside `path`; none where the folder cannot be written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_suffix(".lock").open("a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # given back when the file closes, or the process ends
        yield


def replay_in_a_fresh_process(described: list, threads: int) -> Kept | None:
    try:
        done = subprocess.run([sys.executable, "-m", "fsdp_exp.estimate.library"], capture_output=True, timeout=300,
                              input=pickle.dumps((described, threads)), check=True)
        found = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as err:
        log.warning("the math libraries' buffers at the largest batch could not be measured: %s", err)
        return None
    return None if found is None else Kept(**found)


def main() -> None:
    described, threads = pickle.loads(sys.stdin.buffer.read())
    ops = LibraryOps()
    for (name, overload), args in described:
        func = op(name, overload)
        ops.seen.setdefault((func, args), None)
    kept = Replay().kept(ops, threads)
    print(json.dumps(None if kept is None else {"in_use_bytes": kept.in_use_bytes, "data_bytes": kept.data_bytes}))


if __name__ == "__main__":
    main()
