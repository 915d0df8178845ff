"""How each check of `python -m fsdp_exp.check_gpu` is judged (fsdp_exp.commands.gpu_checks):
a judge reads finished runs (their summary.json, the loss at each step from metrics.jsonl,
the exported weights) and says pass or fail, with one line of what it saw."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_exp.metrics.summary import PEAK_GB, SUMMARY, Summary


@dataclass
class RunResult:
    dir: Path
    summary: Summary | None  # None: the run wrote no summary.json (a bad config, a killed run)
    losses: dict[int, float]  # step -> loss
    records: list[dict]
    error: str = ""  # the run's error, or the last line it printed to stderr
    weights: dict[str, torch.Tensor] | None = None  # model.safetensors, when exported


def not_ok(run: RunResult, name: str = "") -> str | None:
    """Why a run cannot be judged (it did not end ok), or None."""
    status = run.summary.status if run.summary is not None else "no summary.json"
    if status == "ok":
        return None
    return f"{name + ': ' if name else ''}{status}: {run.error or '(no error recorded)'}"[:300]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def same_losses(reference: dict[int, float], losses: dict[int, float], tolerance: float) -> tuple[float, str | None]:
    """The largest relative difference at the reference's steps, and the first step past
    the tolerance (or a missing step), if any."""
    worst, problem = 0.0, None
    for step, ref in sorted(reference.items()):
        if step not in losses:
            return math.inf, f"no loss at step {step}"
        diff = relative(losses[step], ref)
        worst = max(worst, diff)
        if problem is None and not diff < tolerance:  # a NaN fails too
            problem = f"step {step}: loss {losses[step]:.6g}, the reference {ref:.6g}"
    return worst, problem


def parity(reference: RunResult, run: RunResult, tolerance: float) -> tuple[bool, str]:
    """As tests/test_parity.py: the loss at every step and every final weight within
    `tolerance` of the unsharded run on the same global batch."""
    if problem := not_ok(reference, "sharding=none") or not_ok(run):
        return False, problem
    ref = reference.losses
    if len(ref) < 2 or not ref[max(ref)] < ref[min(ref)]:
        return False, f"the unsharded run did not learn (losses {[round(v, 4) for v in ref.values()]})"
    worst_loss, problem = same_losses(ref, run.losses, tolerance)
    if problem:
        return False, f"{problem} (tolerance {tolerance:g})"
    if reference.weights is None or run.weights is None:
        return False, "no model.safetensors to compare"
    if reference.weights.keys() != run.weights.keys():
        return False, "the exported weights have other names than the unsharded run's"
    worst_weight, name = max((((run.weights[k].float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item(), k)
                             for k, w in reference.weights.items())
    if not worst_weight < tolerance:
        return False, f"weight {name} differs by {worst_weight:.1e} (tolerance {tolerance:g})"
    ranks = run.summary.world_size
    alone = " (1 rank: nothing is sharded across ranks; parity across ranks needs 2 GPUs)" if ranks == 1 else ""
    return True, (f"{len(ref)} steps on {ranks} rank(s): losses within {worst_loss:.1e}, weights within "
                  f"{worst_weight:.1e} of sharding=none{alone}")


def trains(run: RunResult) -> tuple[bool, str]:
    """Every loss finite, the last below the first; fp16 reports its loss scale."""
    if problem := not_ok(run):
        return False, problem
    steps = sorted(run.losses)
    if not steps or not all(math.isfinite(run.losses[s]) for s in steps):
        return False, f"a loss is not finite: {[run.losses[s] for s in steps]}"
    first, last = run.losses[steps[0]], run.losses[steps[-1]]
    scale = [r["loss_scale"] for r in run.records if "loss_scale" in r]
    detail = f"loss {first:.4f} at step {steps[0]}, {last:.4f} at step {steps[-1]}"
    if (run.summary.choices or {}).get("precision") == "fp16":
        if not scale or not (math.isfinite(scale[-1]) and scale[-1] > 0):
            return False, f"{detail}; no usable loss scale recorded ({scale[-1:] or 'none'})"
        detail += f"; loss scale {scale[-1]:g}"
    return last < first, detail if last < first else f"did not learn: {detail}"


def trains_on_every_gpu(run: RunResult, gpus: int) -> tuple[bool, str]:
    """fp16 + offload as `trains`, on every GPU the check sees. With offload the gradients
    sit on the CPU, and the loss scaler agrees on inf/NaN across ranks: a collective that
    one rank skips, so only a run on 2 or more GPUs shows that it works."""
    passed, detail = trains(run)
    ranks = run.summary.world_size if run.summary is not None else None
    if passed and gpus >= 2 and ranks != gpus:
        return False, f"ran on {ranks} rank(s), not the {gpus} GPUs visible: {detail}"
    if passed and ranks == 1:
        detail += " (1 rank: the ranks' agreement on inf/NaN needs 2 GPUs)"
    return passed, detail


def resumes(uninterrupted: RunResult, first_half: RunResult, resumed: RunResult, tolerance: float) -> tuple[bool, str]:
    """The run resumed from the first half's checkpoint logs the uninterrupted run's loss at
    every step after it."""
    if problem := (not_ok(uninterrupted, "uninterrupted") or not_ok(first_half, "first half")
                   or not_ok(resumed, "resumed")):
        return False, problem
    saved_at = first_half.summary.steps
    if resumed.summary.resumed_from_step != saved_at:
        return False, f"resumed from step {resumed.summary.resumed_from_step}, not {saved_at}"
    after = {s: v for s, v in uninterrupted.losses.items() if s > saved_at}
    worst, problem = same_losses(after, resumed.losses, tolerance)
    if problem or not after:
        return False, f"{problem or 'no steps after the checkpoint'} (tolerance {tolerance:g})"
    return True, f"saved at step {saved_at}, resumed: steps {min(after)}-{max(after)} within {worst:.1e} of the uninterrupted run"


def mfu(run: RunResult) -> tuple[bool, str]:
    """MFU within (0, 1), and the FLOPs counted by FlopCounterMode within 10% of 6N."""
    if problem := not_ok(run):
        return False, problem
    s = run.summary
    counted = s.get("flops_per_step_counted", s.flops_per_step)
    analytic = s.flops_per_step_analytic
    ratio = counted / analytic if counted and analytic else None
    flops = f"counted FLOPs {ratio:.3f} x 6N" if ratio else "no 6N count to compare with"
    if s.mfu is None:
        return False, (f"no MFU: no peak TFLOP/s for {(s.environment or {}).get('device')}; rerun with "
                       f"--peak-tflops <its dense bf16 peak>; {flops}")
    detail = f"MFU {s.mfu:.1%} of {s.peak_tflops:g} TFLOP/s ({s.peak_tflops_source}); {flops}"
    return 0 < s.mfu < 1 and ratio is not None and abs(ratio - 1) <= 0.1, detail


ESTIMATE_ERROR = 0.10  # the estimate's goal: within 10% of what a run measures


def estimated(run: RunResult, estimate: RunResult) -> tuple[bool, str]:
    """task=estimate's figures for the run beside what the run measured: the run's own peak
    (allocated, on a GPU) and, on a GPU, what the caching allocator reserved; within 10%;
    and what the whole device held (torch.cuda.mem_get_info), shown beside its estimate. On
    the CPU development run only the figures are checked for: the CPU's accuracy is
    bench/estimate_accuracy.py's (docs/BENCHMARKS.md), and its tiny model misses by a constant."""
    if problem := not_ok(run, "run") or not_ok(estimate, "estimate"):
        return False, problem
    s, e = run.summary, estimate.summary
    pairs = [("peak", e.peak_mem_gb, s.peak_mem_gb)]
    if s.device == "cuda":
        pairs.append(("reserved", e.peak_reserved_gb, s.peak_reserved_gb))
    missing = [name for name, guess, seen in pairs if guess is None or not seen]
    if missing:
        return False, f"no {' or '.join(missing)} figure in summary.json to compare"
    if s.device == "cuda":  # the run's own check (memory.estimate) took its GPU path
        own = [k for k in ("device_used_gb", "estimated_device_used_gb") if not s.get(k)]
        if own:
            why = f" ({s.estimate_failed})" if s.estimate_failed is not None else ""
            return False, f"the run's summary.json has no {' or '.join(own)}{why}"
    errors = [(name, guess, seen, guess / seen - 1) for name, guess, seen in pairs]
    shown = list(errors)
    if e.device_used_gb and s.device_used_gb:  # what the whole device held: shown, not judged
        shown.append(("device (not judged)", e.device_used_gb, s.device_used_gb, e.device_used_gb / s.device_used_gb - 1))
    detail = "; ".join(f"{name}: estimated {guess:.2f} GB, measured {seen:.2f} GB ({err:+.0%})"
                       for name, guess, seen, err in shown)
    if s.device != "cuda":
        return True, f"{detail} (on CPU not judged)"
    return all(abs(err) <= ESTIMATE_ERROR for *_, err in errors), detail


def limited_peak(summary: Summary) -> tuple[float | None, str]:
    """The peak that memory.limit_gb caps, as task=max_batch reads it: the limit's own count
    on CPU, the allocator's reserved memory on a GPU."""
    for key, what in (("peak_under_limit_gb", "as the limit counts it"), ("peak_reserved_gb", "reserved"),
                      (PEAK_GB, "the run's own")):
        if summary.get(key) is not None:
            return summary.get(key), what
    return None, ""


def under_limit(run: RunResult, limit_gb: float) -> tuple[bool, str]:
    if problem := not_ok(run):
        return False, problem
    peak, what = limited_peak(run.summary)
    if peak is None:
        return False, "no peak memory in summary.json"
    return 0 < peak <= limit_gb, f"peak {peak:.3f} GB ({what}) under memory.limit_gb={limit_gb:g}"


def same_training(reference: RunResult, run: RunResult, tolerance: float,
                  of: str = "the plain build") -> tuple[bool, str]:
    """The run logs the reference's (`of`) loss at every step, and learns."""
    if problem := not_ok(reference, "reference") or not_ok(run):
        return False, problem
    worst, problem = same_losses(reference.losses, run.losses, tolerance)
    if problem:
        return False, f"{problem} (tolerance {tolerance:g})"
    learned, detail = trains(run)
    return learned, f"{len(reference.losses)} steps within {worst:.1e} of {of}; {detail}"


def answer_trains(search: RunResult, run: RunResult, limit_gb: float) -> tuple[bool, str]:
    """task=max_batch found a size bounded by memory (oom, noise, or a verification run that ran out of it),
    and training at it fits under the limit."""
    if problem := not_ok(search, "task=max_batch"):
        return False, problem
    size, bounded_by = search.summary.max_batch_size, search.summary.bounded_by
    if not size:
        return False, f"task=max_batch found no size that fits under memory.limit_gb={limit_gb:g}"
    if problem := not_ok(run, f"train.batch_size={size}"):
        return False, problem
    fits, detail = under_limit(run, limit_gb)
    # bounded by memory: the next size ran out of it, or fit only inside the noise band
    return fits and bounded_by in ("oom", "noise", "verification"), f"max batch {size} (bounded by {bounded_by}); trained at it: {detail}"


OUTSIDE_AT_LEAST_GB = 0.2  # a CUDA context alone takes more (fsdp_exp.estimate.gpu.CONTEXT_GB: 0.3 to 0.6)


def device_memory_search(run: RunResult) -> tuple[bool, str]:
    """task=max_batch without memory.limit_gb on a GPU: its first probe learns the device's
    memory less what its ranks held outside the caching allocator (the CUDA context, NCCL,
    cuBLAS: at least OUTSIDE_AT_LEAST_GB), which is then the limit, and the search ends at a
    size bounded by memory."""
    if problem := not_ok(run, "task=max_batch"):
        return False, problem
    s = run.summary
    size, bounded_by, limit = s.max_batch_size, s.bounded_by, s.limit_gb
    device_gb = (s.environment or {}).get("device_memory_gb")
    if not limit or (device_gb and not 0.5 * device_gb <= limit <= device_gb - OUTSIDE_AT_LEAST_GB):
        return False, f"limit_gb {limit} for a device of {device_gb} GB (not its allocator's share)"
    detail = f"max batch {size} (bounded by {bounded_by}) under the {limit:.1f} GB the device leaves its allocator"
    return bool(size) and bounded_by in ("oom", "noise", "verification"), detail


def cap_holds(capped: RunResult, free: RunResult, limit_gb: float) -> tuple[bool, str]:
    """The cap bites: a batch that trains without memory.limit_gb, reserving more than it,
    runs out of memory under it. (A peak under the limit cannot show it: the allocator
    enforces the cap on what it reserves, so reserved <= limit holds whether the cap works
    or not.)"""
    if problem := not_ok(free, "without the limit"):
        return False, problem
    reserved = free.summary.peak_reserved_gb or 0.0
    capped_status = capped.summary.status if capped.summary is not None else "no summary.json"
    detail = (f"batch without the limit: ok, {reserved:.2f} GB reserved; under memory.limit_gb={limit_gb:g}: "
              f"{capped_status}")
    return capped_status == "oom" and reserved > limit_gb, detail


def out_of_memory(run: RunResult) -> tuple[bool, str]:
    status = run.summary.status if run.summary is not None else "no summary.json"
    return status == "oom", f"status {status}: {run.error}"[:300]


def device(run: RunResult, expected: str) -> tuple[bool, str]:
    """The device rank 0 trained on, and the peak TFLOP/s MFU was measured against."""
    if run.summary is None:
        return False, f"no summary.json: {run.error}"[:300]
    s, env = run.summary, run.summary.environment or {}
    memory = env.get("device_memory_gb")
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "nccl") if env.get(k))
    peak = (f"peak {s.peak_tflops:g} TFLOP/s ({s.peak_tflops_source})" if s.peak_tflops
            else "no peak TFLOP/s")
    detail = (f"{s.device}: {env.get('device')} (x{env.get('device_count')}"
              f"{f', {memory:.0f} GB' if memory else ''}), seen by {env.get('device_seen_by')}; {versions}; {peak}")
    return s.device == expected and env.get("device_seen_by") == "rank 0", detail


def limit_recorded(run: RunResult, limit_gb: float) -> tuple[bool, str]:
    """Under memory.limit_gb the summary holds the limit and the peak it caps, per rank too;
    on a GPU that peak is the reserved one (set_per_process_memory_fraction caps it)."""
    if problem := not_ok(run):
        return False, problem
    s = run.summary
    peak, per_rank = s.peak_under_limit_gb, s.peak_under_limit_gb_per_rank or []
    if s.limit_gb != limit_gb or peak is None or len(per_rank) != s.world_size:
        return False, (f"summary.json: limit_gb {s.limit_gb}, peak_under_limit_gb {peak}, "
                       f"{len(per_rank)} rank(s) of {s.world_size} in peak_under_limit_gb_per_rank")
    detail = f"limit_gb {limit_gb:g}, peak_under_limit_gb {peak:.3f} GB (per rank {', '.join(f'{p:.3f}' for p in per_rank)})"
    if s.device == "cuda" and peak != s.peak_reserved_gb:
        return False, f"{detail}: not the reserved peak, {s.peak_reserved_gb} GB"
    return True, detail


def compiled_probe(run: RunResult) -> tuple[bool, str]:
    """A probe with train.compile=true times training, not the compiler: compiling falls in
    its warm-up, so a measured step is a small part of the probe's wall time."""
    if problem := not_ok(run):
        return False, problem
    summaries = [Summary.read(f.parent) for f in sorted((run.dir / "probes").glob(f"*/{SUMMARY}"))]
    ok = [p for p in summaries if p is not None and p.ok]
    if not ok:
        return False, f"no probe trained ({[p.error for p in summaries if p is not None]})"[:300]
    lines = [f"batch {p.batch_size}: {p.step_time_s:.3f} s a step after {p.steps} steps in "
             f"{p.wall_s:.0f} s" for p in ok]
    slow = [p for p in ok if not p.step_time_s < 0.05 * p.wall_s]
    if slow:
        return False, f"the compiler is in the measured steps: {'; '.join(lines)}"
    return True, f"{'; '.join(lines)} (compiling in the warm-up)"
