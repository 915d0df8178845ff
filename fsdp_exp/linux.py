"""The one door to the platform for a CPU's memory figures: Linux's /proc, glibc's malloc and
the process's resource limits. Nothing else in fsdp_exp reads /proc, calls the C library or
sets a limit; GPU figures come from torch.cuda and need none of this.

The contract. On Linux with glibc 2.33 or later, every figure. Where a part is missing
(macOS, a musl-based Linux such as Alpine), each function below still answers, with less:

- no /proc: `peak_mem_gb` and `peak_resident_gb` are the process's peak since it started
  (getrusage), not reset per window, so no per-phase peaks; no start-up marks of a process's
  own start; the estimate leaves out what a DataLoader worker copies; a CPU `memory.limit_gb`
  is refused (it counts by /proc/self/status);
- no glibc: no `peak_in_use_gb` (mallinfo2: what the allocations hold), and freed memory is
  not handed back before the first window (malloc_trim), so resident peaks read higher; the
  CPU limit's blocks are not mapped apart (mallopt), so its boundary moves by tens of MB.

`missing()` says which, in the one line a CPU run logs (fsdp_exp.rank.train).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import threading
import time
from pathlib import Path

GB = 2**30
PROC = Path("/proc/self/status").exists()


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():  # noqa: ANN202 - a ctypes function, or None
    function = getattr(_LIBC, "mallinfo2", None)  # glibc >= 2.33
    if function is not None:
        function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def missing() -> str | None:
    """What of the contract this platform lacks, as one line; None on Linux with glibc >= 2.33."""
    lacks = [what for what, present in (("/proc", PROC), ("glibc 2.33's mallinfo2", _MALLINFO2 is not None))
             if not present]
    if not lacks:
        return None
    left_out = ["per-phase peaks", "the CPU memory.limit_gb"] if not PROC else []
    if _MALLINFO2 is None:
        left_out.append("peak_in_use_gb")
    return (f"memory on this CPU ({os.uname().sysname}): no {' and no '.join(lacks)}, so peaks are the resident "
            f"ones{' since the process started' if not PROC else ''}, without {', '.join(left_out)} "
            "(docs/measurements.md)")


# --- what the process holds: /proc/self/status, getrusage ---

def proc_status() -> dict[str, int]:
    """/proc/self/status's figures in kB, read once; without /proc, the peak resident size
    from getrusage as both the peak and the current one."""
    if not PROC:
        peak_kb = resident_peak_bytes({}) // 1024
        return {"VmHWM:": peak_kb, "VmRSS:": peak_kb}
    figures = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition("\t")
        if value.strip().endswith("kB"):
            figures[key] = int(value.split()[0])
    return figures


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (what memory.limit_gb counts on CPU)."""
    return proc_status().get("RssAnon:", 0) * 1024


def file_bytes(status: dict[str, int]) -> int:
    """Resident pages of mapped files (library code) and shared memory."""
    return (status.get("RssFile:", 0) + status.get("RssShmem:", 0)) * 1024


def resident_peak_bytes(status: dict[str, int]) -> int:
    """The peak resident size: VmHWM (since the last `reset_resident_peak`), else getrusage's
    (since the process started; bytes on macOS, kB on Linux)."""
    if "VmHWM:" in status:
        return status["VmHWM:"] * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


def reset_resident_peak() -> bool:
    """Writing 5 to clear_refs resets VmHWM to the current resident size (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def private_dirty_bytes() -> int | None:
    """This process's private dirty pages (what a forked child copied on write and made),
    None without /proc/self/smaps_rollup."""
    try:
        rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    return sum(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Private_Dirty:"))


# --- glibc's malloc ---

def heap_in_use_bytes() -> int | None:
    """What this process's allocations hold now (glibc's mallinfo2: bytes handed out by
    malloc and not yet freed, mapped blocks included): on CPU what torch.cuda's
    memory_allocated is on a GPU, the tensors and the rest of what C and C++ code
    allocated, without the freed blocks glibc keeps for reuse, which resident memory
    counts. Python's small objects live in pools of their own and are not in it. None
    without glibc. Its cost grows with the heap's free blocks (about 0.1 ms at 2,000)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def trim_heap() -> None:
    """The heap's free pages back to the kernel (glibc's malloc_trim)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def map_large_blocks() -> None:
    """Make CPU peak memory a function of the work, not of the allocator's history.

    glibc's malloc raises its mmap threshold by itself each time a large block is freed, so
    later tensors come from a heap that keeps freed memory: resident memory, and where an
    allocation fails, then drift by tens of MB from run to run. A fixed threshold maps every
    block over 64 KiB from the kernel and returns it on free, which makes peak memory
    affine in the batch size and the out-of-memory boundary sharp. Only glibc has mallopt.
    """
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return
    m_mmap_threshold, m_arena_max = -3, -8
    mallopt(m_mmap_threshold, 64 * 1024)
    mallopt(m_arena_max, 2)


# --- limits ---

_uncapped: int | None = None  # RLIMIT_DATA's soft limit before cap_data_segment; None: not capped


def cap_data_segment(limit_bytes: int) -> None:
    """An allocation past `limit_bytes` of data segment fails for real (RLIMIT_DATA)."""
    global _uncapped
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if _uncapped is None:
        _uncapped = soft
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))


def lift_data_cap() -> None:
    """RLIMIT_DATA back to what it was before cap_data_segment (nothing to do where it was not
    capped): once a rank's work is done or has failed, what carries its result or error out
    (a thread, Ray's or submitit's serialising of it) needs room."""
    global _uncapped
    if _uncapped is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_uncapped, hard))
    _uncapped = None


def thread_stack_bytes() -> int:
    """What one thread's stack takes of the data segment: glibc's default, `ulimit -s` (8 MB)
    and a guard page, or where that is unlimited, what starting a thread here adds."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    if soft != resource.RLIM_INFINITY:
        return soft + resource.getpagesize()
    before = proc_status().get("VmData:", 0)
    stop = threading.Event()
    one = threading.Thread(target=stop.wait, daemon=True)
    one.start()
    stack = proc_status().get("VmData:", 0) - before
    stop.set()
    one.join()
    return max(stack, 0) * 1024


# --- threads and processes ---

def thread_ids() -> set[str]:
    """This process's threads' ids (/proc/self/task), empty without /proc."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def thread_count() -> int:
    """This process's threads (Linux; elsewhere Python's own)."""
    return len(thread_ids()) or threading.active_count()


def thread_file(tid: str, name: str) -> str:
    """/proc/self/task/<tid>/<name>, or "" once the thread has ended."""
    try:
        with open(f"/proc/self/task/{tid}/{name}") as file:
            return file.read()
    except OSError:
        return ""


def thread_cpu_ns(tid: str) -> int:
    """The thread's time on a CPU so far (schedstat's first figure; 0 where there is none)."""
    figures = thread_file(tid, "schedstat").split()
    return int(figures[0]) if figures else 0


def thread_runnable(tid: str) -> bool:
    """Whether the thread is running or waiting for a core (its state R)."""
    return thread_file(tid, "stat").rpartition(")")[2].split()[:1] == ["R"]


def process_started() -> float | None:
    """When this process started (Unix time), from /proc (to the kernel's clock tick);
    None where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def children() -> list[int]:
    """This process's child processes (each process's parent, from /proc), else none."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(stat.parent.name))
    return found


def process_running(pid: int) -> bool:
    """Whether process `pid` runs: it exists and has not ended (an ended child not yet waited
    for is a zombie, state Z). Without /proc, whether it exists at all."""
    if PROC:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1] != ["Z"]
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, and another user's
        pass
    return True


def command_line(pid: int) -> bytes:
    """A process's command line (/proc/<pid>/cmdline), empty where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
