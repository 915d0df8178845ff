"""What task=max_batch's probes say besides where the boundary is: how far the peak moves
between runs of one setup (the noise band), which probes fit with room for it, the batch
to train with, and the answer in one line (from the search's record, a `MaxBatchRecord`).
Pure functions of the probes; nothing here runs.

Why a noise band. A probe's peak, as the limit counts it, moves a little from one run of the
same setup to the next: on CPU with what a rank holds before its limit is set (torch, the
process group, thread stacks). A size that fit with less room than that to spare fits in some
runs and not in others, so the search counts it as not fitting, and the answer is a size that
fits in the user's run too. On GPU the peaks judged are allocated ones (Probe.judged_peak_gb):
reserved memory flattens just under the cap for sizes that still train, so the band would
turn sizes that train into sizes that do not; there the size that runs out of memory for real
sets the boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsdp_exp.tasks.max_batch.settings import VERIFY_WINDOW

if TYPE_CHECKING:
    from fsdp_exp.tasks.max_batch.probe import Probe
    from fsdp_exp.tasks.max_batch.record import MaxBatchRecord

# The noise band is at least this share of the limit. The spreads a search sees in a few
# probes understate what a fresh set of ranks can hold: an answer 0.13% under the limit has run
# out of memory when run again.
NOISE_FLOOR = 0.002
# A run's peak counts as settled once it rose by at most this share of the limit over a window.
SETTLE_FLOOR = 0.001
NEAR_FASTEST = 0.05  # the batch to use: the smallest whose samples/s is within this of the fastest
SPACING = 2.0  # the fastest batch is placed to within this factor, with one more probe if need be
MB = 2**20 / 2**30


def noise_band_gb(probes: Sequence[Probe], limit_gb: float, rank0_alike: bool = True) -> float:
    """How far the counted peak of one setup at one batch size moves between runs, seen in
    the probes already run: the spread between the ranks of one probe (ranks of one setup
    hold the same, bar the noise), between probes of the same size, and between what ranks
    held when their limit was set (CPU), which moves the room left under it. At least
    NOISE_FLOOR of the limit. `rank0_alike`: False where rank 0 alone holds more (wandb's
    run, under the CPU limit), which is no noise: rank 0 is then left out of the ranks' spreads."""
    spreads = [NOISE_FLOOR * limit_gb]
    ok = [p for p in probes if p.status == "ok"]
    first = 0 if rank0_alike else 1
    for p in ok:
        peaks = p.judged_peak_gb_per_rank()[first:]
        if len(peaks) > 1:
            spreads.append(max(peaks) - min(peaks))
    by_size: dict[int, list[float]] = {}
    for p in ok:
        peak = p.judged_peak_gb()
        if peak is not None:
            by_size.setdefault(p.batch_size, []).append(peak)
    spreads += [max(peaks) - min(peaks) for peaks in by_size.values()]
    held = [h for p in probes for h in (p.held_before_limit_gb_per_rank or [])[first:]]
    if held:
        spreads.append(max(held) - min(held))
    return max(spreads)


def margin_gb(probe: Probe, limit_gb: float) -> float | None:
    """The room a probe that trained left under the limit, by the peak the search judges it
    by (None for one that did not)."""
    peak = probe.judged_peak_gb()
    return None if probe.status != "ok" or peak is None else limit_gb - peak


def fits_with_room(probe: Probe, limit_gb: float, noise_gb: float) -> bool:
    """Trained, with at least the noise band to spare under the limit."""
    room = margin_gb(probe, limit_gb)
    return probe.status == "ok" and (room is None or room >= noise_gb)


def speeds(probes: Sequence[Probe], up_to: int) -> dict[int, float]:
    """Mean samples/s per batch size, over the probes that trained at sizes up to `up_to`."""
    seen: dict[int, list[float]] = {}
    for p in probes:
        if p.status == "ok" and p.samples_per_s and p.batch_size <= up_to:
            seen.setdefault(p.batch_size, []).append(p.samples_per_s)
    return {b: sum(s) / len(s) for b, s in sorted(seen.items())}


def fastest(probes: Sequence[Probe], up_to: int) -> tuple[int | None, float | None, int | None]:
    """(the fastest batch, its samples/s, the smallest batch within NEAR_FASTEST of it)."""
    by_size = speeds(probes, up_to)
    if not by_size:
        return None, None, None
    best = max(by_size, key=by_size.__getitem__)
    near = min(b for b, s in by_size.items() if s >= (1 - NEAR_FASTEST) * by_size[best])
    return best, by_size[best], near


def probe_to_place_fastest(probes: Sequence[Probe], up_to: int, resolution: int) -> int | None:
    """When the probes next to the fastest batch are more than SPACING times away from it,
    the size halfway (in log scale) across the wider gap; else None."""
    by_size = speeds(probes, up_to)
    best, _, _ = fastest(probes, up_to)
    if best is None:
        return None
    sizes = list(by_size)
    i = sizes.index(best)
    gaps = [(a, b) for a, b in ((sizes[i - 1] if i else None, best), (best, sizes[i + 1] if i + 1 < len(sizes) else None))
            if a is not None and b is not None and b / a > SPACING]
    if not gaps:
        return None
    a, b = max(gaps, key=lambda gap: gap[1] / gap[0])
    size = round(math.sqrt(a * b) / resolution) * resolution
    return size if a < size < b else None


def answer_line(record: MaxBatchRecord, limit_gb: float | None) -> str:
    """The search's answer in one line, for the log. Only a size that ran out of memory is
    said to fail under the limit: a probe that failed otherwise is named with its reason."""
    under = f"memory.limit_gb={limit_gb:g}" if limit_gb else f"the {record.limit_gb:.1f} GB the device leaves its allocator"
    count = record.probe_count
    cost = f"{count} probe{'s' if count != 1 else ''}, {record.probe_wall_s:.0f} s of probing"
    check = record.verification or {}
    if any(not run.get("as_command") for run in check.get("runs", [])):  # a probe run as the command is probing
        cost += f", {record.verify_wall_s:.0f} s verifying"
    size, ranks, step = record.max_batch_size, record.world_size, record.resolution
    small = too_small_words(record)
    if not size and check.get("status") == "none completed":
        return "; ".join([f"max batch: none verified under {under}: the probes found {record.searched_max_batch_size}"
                          f", but {run_words(check)} of the command ran out of memory at "
                          f"{sizes_words(check['ran_out_of_memory_at'])}, down to the smallest size tried", cost])
    if not size:
        return "; ".join([f"max batch: none fits under {under}: {needs(record)}", *small, cost])
    noise = f"{record.noise_band_gb / MB:.1f} MB"
    samples = record.noise_band_samples
    band = noise + (f" ({samples:.1f} samples)" if samples else "")
    if record.bounded_by == "data":
        left = record.limit_gb - record.peak_under_limit_gb
        head = (f"max batch: {size} per rank on {ranks} rank(s), bounded by the data "
                f"({record.data_share_per_rank} samples a rank); {left:.1f} GB of {record.limit_gb:g} left")
    elif record.bounded_by == "verification":
        head = (f"max batch: {size} per rank on {ranks} rank(s) (the probes found {record.searched_max_batch_size}, "
                f"but {run_words(check)} of the command ran out of memory at "
                f"{sizes_words(check['ran_out_of_memory_at'])} under {under})")
    else:
        why = {"search_up_to": f"fits at task.search_up_to={record.search_up_to} under {under}",
               "oom": f"{size + step} ran out of memory under {under}",
               "noise": f"{size + step} fit with less than the {noise} that runs of this setup vary by to spare "
                        f"under {under}",
               }.get(record.bounded_by, f"{size + step} did not train, not for lack of memory: "
                                        f"{failure(record, size + step)}")
        head = f"max batch: {size} per rank on {ranks} rank(s) ({why})"
    parts = [head, verified_words(record), f"peak {record.peak_under_limit_gb:.3f} GB as the limit counts it, "
             f"noise band {band}" + length_words(record)]
    if record.alloc_retries:
        parts.append(f"at {size} the allocator freed its cache to allocate {record.alloc_retries:.0f} time(s), "
                     "which slows a step")
    if record.recommended_keeps_margin is not False:
        parts.append(f"recommended {record.recommended_batch_size} ({record.margin:.0%} margin)")
    else:
        parts.append(f"no size keeps {record.margin:.0%} of the limit free (batch {record.searched_from} "
                     f"already takes more), so none is recommended below the max")
    if record.fastest_batch_size:
        parts.append(f"fastest {record.fastest_batch_size} ({record.fastest_samples_per_s:,.1f} samples/s), "
                     f"within {NEAR_FASTEST:.0%} of it from {record.near_fastest_batch_size}")
    return "; ".join([*parts, *small, cost])


def verified_words(record: MaxBatchRecord) -> str:
    """Whether a run of the command at the answer, or above it, completed
    (fsdp_exp.tasks.max_batch.verify)."""
    check, size = record.verification or {}, record.max_batch_size
    status = check.get("status", "not run")
    if status in ("completed", "stepped down"):
        done = next(r for r in check["runs"] if r["status"] == "ok")
        above = "" if done["batch_size"] <= size else \
            f" (above {size}: what it held beyond its probe, counted, brought the probes' boundary down)"
        if not check.get("until_settled"):
            return f"verified: a {check['steps']}-step run of the command at {done['batch_size']} completed{above}"
        held = f"verified: a run of the command at {done['batch_size']} held for {done['steps']} steps{above}"
        if done.get("as_command"):  # the search's probe there (MaxBatchSearch.answers_at)
            above = "" if done["batch_size"] <= size else f" (above {size}: it left less than the noise band free)"
            held = (f"verified: the probe at {done['batch_size']}, run as the command, held for {done['steps']} "
                    f"steps{above}")
        if done.get("settled_at_step") is not None:
            return f"{held}, its peak settled (no new high over its last {VERIFY_WINDOW} steps)"
        return (f"{held}, its peak still rising at the end (task.verify_steps=<the run's steps> runs the "
                "whole length)")
    if status == "failed":
        return (f"NOT VERIFIED: {run_words(check)} of the command at {size} failed, not for lack of memory "
                f"({check['runs'][-1]['reason']})")
    return ("NOT VERIFIED (task.verify_steps=0): a run's memory can grow past a probe's first steps; "
            "leave task.verify_steps unset to verify until the peak settles")


def length_words(record: MaxBatchRecord) -> str:
    """What a run of the command held beyond a probe over its length, as the search counted it."""
    length = record.length_check or {}
    if length.get("beyond_probe_gb") is None:
        return ""
    return (f", {run_words(record.verification)} holds {length['counted_gb'] / MB:.1f} MB more than a "
            f"probe (measured at batch {length['batch_size']}, counted)")


def run_words(check: dict) -> str:
    """A recorded verification's runs, in words (fsdp_exp.tasks.max_batch.verify.Verification.run_words)."""
    return f"a run of up to {check['steps']} steps" if check.get("until_settled") else f"a {check['steps']}-step run"


def sizes_words(sizes: list[int]) -> str:
    return ", ".join(str(s) for s in sizes)


def failure(record: MaxBatchRecord, size: int) -> str:
    """Why the probe at `size` failed, in its own words."""
    return next((p["reason"] for p in record.probes if p["batch_size"] == size
                 and p["status"] == "failed"), "see its probe's rank logs")


def too_small_words(record: MaxBatchRecord) -> list[str]:
    """The sizes the search started above, as not training (never as out of memory)."""
    small = record.too_small_to_train
    if not small:
        return []
    sizes = ", ".join(str(p["batch_size"]) for p in small)
    return [f"batch {sizes} did not train, not for lack of memory ({small[0]['reason']}), so the search started "
            f"at {record.searched_from}"]


def needs(record: MaxBatchRecord) -> str:
    """What the smallest batch needs, in words (for a search where none fits)."""
    need, size = record.smallest_batch_needs_gb, record.searched_from or record.resolution
    if need is None:
        return f"batch {size} needs more than this device gives each rank"
    return f"batch {size} needs {need:.2f} GB per rank"
