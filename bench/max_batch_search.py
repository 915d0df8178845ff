"""Max-batch search efficiency: the project's search against the two policies users know,
on the same model and memory limit, every policy reading the same real probes.

- fsdp_exp: `fsdp_exp.tasks.batch_search.BatchSearch`, as `task=max_batch` runs it.
- doubling then bisection (Lightning's `scale_batch_size(mode="binsearch")`, from its
  default start of 2): double until a size fails, then bisect to a gap of 1.
- shrink by 10% (Accelerate's `find_executable_batch_size`): start at the top of the
  range and take 90% after every failure; the first size that fits is its answer.

A probe is a real short training run on fresh ranks under the memory limit (what
`task=max_batch` runs). Each batch size is probed once and its outcome shared by every
policy that asks for it, so they all see the same boundary; a policy's cost is the number
of sizes it asks for and the sum of their probes' wall times.

    python bench/max_batch_search.py [--limit-gb 0.6] [--up-to 4096] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from machine import header

from fsdp_exp.cli import compose_checked
from fsdp_exp.plan import prepare
from fsdp_exp.tasks.batch_search import BatchSearch, Outcome
from fsdp_exp.tasks.probe import Probe, run_probe


def ours(limit_gb: float, up_to: int, outcome: Callable[[int], Outcome]) -> int:
    search, seen = BatchSearch(limit_gb, 1, up_to), []
    while (size := search.next_size(seen)) is not None:
        seen.append(outcome(size))
    return search.bracket(seen)[0]


def doubling_then_bisection(fits: Callable[[int], bool], up_to: int, start: int = 2) -> int:
    size = start
    while size <= up_to and fits(size):
        size *= 2
    if size > up_to:
        return up_to if fits(up_to) else bisect(fits, size // 2, up_to)
    if size == start:
        return bisect(fits, 0, size)
    return bisect(fits, size // 2, size)


def bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """`lo` fits (or is 0), `hi` does not; the largest size that fits."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def shrink_by_ten_percent(fits: Callable[[int], bool], start: int) -> int:
    size = start
    while size > 0 and not fits(size):
        size = int(size * 0.9)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-gb", type=float, default=0.6)
    parser.add_argument("--up-to", type=int, default=4096)
    parser.add_argument("overrides", nargs="*", default=["model.num_layers=2"])
    args = parser.parse_args()
    overrides = ["task=max_batch", f"memory.limit_gb={args.limit_gb}", f"max_batch.search_up_to={args.up_to}",
                 "wandb.mode=disabled", *args.overrides]
    plan = prepare(compose_checked(overrides), torch.cuda.device_count(), overrides)
    steps, timeout = plan.exp.max_batch.steps_per_probe, plan.exp.max_batch.probe_timeout
    probes: dict[int, Probe] = {}

    with tempfile.TemporaryDirectory() as tmp:
        def probe(size: int) -> Probe:
            if size not in probes:
                probes[size] = run_probe(plan.exp, size, Path(tmp) / f"b{size}", plan.launcher, plan.nproc,
                                         steps, timeout)
                print(f"  probe {len(probes):>2}: {probes[size].line()}", flush=True)
            return probes[size]

        def asked(policy: Callable[[Callable[[int], Outcome]], int]) -> tuple[int, list[int]]:
            """The policy's answer, and the sizes it asked for."""
            sizes: list[int] = []

            def outcome(size: int) -> Outcome:
                sizes.append(size)
                return probe(size).outcome()
            return policy(outcome), sizes

        print(header(plan.nproc, plan.exp.device == 'cuda'))
        print(f"overrides: {' '.join(overrides)}")
        start = time.perf_counter()
        results = {
            "fsdp_exp": asked(lambda outcome: ours(args.limit_gb, args.up_to, outcome)),
            "doubling then bisection": asked(
                lambda outcome: doubling_then_bisection(lambda s: outcome(s).fits, args.up_to)),
            "shrink by 10% from the top": asked(
                lambda outcome: shrink_by_ten_percent(lambda s: outcome(s).fits, args.up_to)),
        }
        boundary = max(size for size, p in probes.items() if p.status == "ok" and
                       all(q.status == "ok" for s, q in probes.items() if s < size))
        exact = boundary + 1 in probes and probes[boundary + 1].status != "ok"
        print(f"\n{len(probes)} distinct probes in {time.perf_counter() - start:.0f} s; the boundary is {boundary}"
              f"{'' if exact else ' (not bracketed to 1 by the probes)'}\n")
        print("| policy | answer | exact | probes | probe wall time s | sizes asked |")
        print("| --- | ---: | --- | ---: | ---: | --- |")
        for name, (answer, sizes) in results.items():
            wall = sum(probes[s].wall_s for s in set(sizes))
            print(f"| {name} | {answer} | {'yes' if answer == boundary else 'no'} | {len(set(sizes))} | {wall:.0f} | "
                  f"{', '.join(map(str, sizes))} |")


if __name__ == "__main__":
    main()
