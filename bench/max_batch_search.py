"""Max-batch search on a corpus of real setups: the project's search against the two
policies users know, every policy reading the same real probes.

- fsdp_exp: `task=max_batch` itself (`fsdp_exp.tasks.max_batch.search.MaxBatchSearch`), into a scratch run
  directory, with the estimate's curve placing its probes (task.estimate=true).
- fsdp_exp without the estimate: the same search from the probes alone (task.estimate=false).
- doubling then bisection (Lightning's `scale_batch_size(mode="binsearch")`, from its
  default start of 2): double until a size fails, then bisect to a gap of 1.
- shrink by 10% (Accelerate's `find_executable_batch_size`): start at the top of the
  range and take 90% after every failure; the first size that fits is its answer.

A probe is a real short training run on 2 fresh ranks under the memory limit. The search
runs first; the search without the estimate and the two policies then reuse its probes, and a size they ask for that no probe
has run is probed for real, unless an outcome already run decides it (a size at or above one
that ran out of memory does too, one at or below one that trained trains). Such a decided
size counts as a probe of the policy, at the median wall time of the real probes with its
outcome, and the table says how many there were.

    python bench/max_batch_search.py                 # every setup (about an hour on 2 cores)
    python bench/max_batch_search.py vit-full cnn    # some of them
    python bench/max_batch_search.py --searches-only # with and without the estimate only
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from machine import header

from fsdp_exp.commands.experiment import compose_checked
from fsdp_exp.driver.plan import prepare
from fsdp_exp.tasks.max_batch.answer import noise_band_gb
from fsdp_exp.tasks.max_batch.policy import BatchSearch
from fsdp_exp.tasks.max_batch.search import MaxBatchSearch
from fsdp_exp.tasks.max_batch.probe import Probe, run_probe

HEAVY_VIT = ["model.num_layers=8", "model.hidden_dim=384", "model.mlp_dim=1536", "model.num_heads=4",
             "model.patch_size=28"]


@dataclass
class Setup:
    name: str
    limit_gb: float
    overrides: list[str]
    curve: str  # what the peak does as the batch grows


SETUPS = [
    Setup("vit-full", 0.6, ["model.num_layers=2"], "activations from the first sample"),
    Setup("vit-grad_op", 0.6, ["model.num_layers=2", "sharding=grad_op"], "activations from the first sample"),
    Setup("vit-ddp", 0.6, ["model.num_layers=2", "sharding=ddp"], "activations from the first sample"),
    Setup("vit-offload", 0.6, ["model.num_layers=2", "offload=true"], "activations from the first sample"),
    Setup("vit-bf16", 0.6, ["model.num_layers=2", "precision=bf16"], "activations from the first sample"),
    Setup("cnn", 0.6, ["model=cnn"], "activations from the first sample"),
    Setup("gpt-tiny", 1.5, ["model=gpt", "data=synthetic_tokens"], "logits from the first sample"),
    Setup("gpt-small", 2.5, ["model=gpt", "model.size=small", "data=synthetic_tokens"],
          "flat (model state), then logits"),
    Setup("heavy-vit-full", 0.735, HEAVY_VIT, "flat (model state), then activations"),
    Setup("heavy-vit-ddp", 0.65, [*HEAVY_VIT, "sharding=ddp"], "nothing fits"),
]


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


@dataclass
class Policy:
    answer: int
    sizes: list[int]  # every size asked, in order
    decided: int  # of them, decided by an outcome already run rather than probed
    wall_s: float


class SharedProbes:
    """Real probes by batch size, shared by the policies."""

    def __init__(self, plan, scratch: Path):
        self.plan, self.scratch = plan, scratch
        self.by_size: dict[int, Probe] = {}

    def add(self, probe: Probe) -> None:
        self.by_size.setdefault(probe.batch_size, probe)

    def decided(self, size: int) -> bool | None:
        if any(p.status == "ok" for b, p in self.by_size.items() if b >= size):
            return True
        if any(p.status == "oom" for b, p in self.by_size.items() if b <= size):
            return False
        return None

    def run(self, size: int) -> Probe:
        exp = self.plan.exp
        probe = run_probe(exp, size, self.scratch / f"b{size}", self.plan.launcher, self.plan.nproc,
                          exp.task.steps_per_probe, exp.task.probe_timeout)
        print(f"    probe: {probe.line()}", flush=True)
        self.add(probe)
        return probe

    def policy(self, search: Callable[[Callable[[int], bool]], int]) -> Policy:
        sizes: list[int] = []
        decided: dict[int, bool] = {}

        def fits(size: int) -> bool:
            sizes.append(size)
            if size in self.by_size:
                return self.by_size[size].status == "ok"
            known = self.decided(size)
            if known is not None:
                decided[size] = known
                return known
            return self.run(size).status == "ok"

        answer = search(fits)
        return Policy(answer, sizes, len(decided), sum(self.wall(s, decided.get(s)) for s in set(sizes)))

    def without_estimate(self, limit_gb: float) -> Policy:
        """task=max_batch's search from the probes alone, its noise band as the sweep keeps it;
        a size already probed is reused (the answer of an outcome already run is not enough:
        the search reads peaks)."""
        settings = self.plan.exp.task
        used: list[Probe] = []
        while True:
            search = BatchSearch(limit_gb, settings.resolution, settings.search_up_to, noise_band_gb(used, limit_gb))
            size = search.next_size([p.outcome() for p in used])
            if size is None:
                break
            used.append(self.by_size[size] if size in self.by_size else self.run(size))
        answer = search.bracket([p.outcome() for p in used])[0]
        return Policy(answer, [p.batch_size for p in used], 0, sum(p.wall_s for p in used))

    def wall(self, size: int, decided: bool | None) -> float:
        if decided is None:
            return self.by_size[size].wall_s
        alike = [p.wall_s for p in self.by_size.values() if (p.status == "ok") == decided]
        return statistics.median(alike or [p.wall_s for p in self.by_size.values()])

    def boundary(self) -> int:
        """The largest size that trained below every size that did not."""
        failed = min((b for b, p in self.by_size.items() if p.status != "ok"), default=None)
        return max((b for b, p in self.by_size.items() if p.status == "ok" and (failed is None or b < failed)),
                   default=0)


def bench(setup: Setup, up_to: int, policies: bool = True) -> dict:
    overrides = ["task=max_batch", f"memory.limit_gb={setup.limit_gb}", f"task.search_up_to={up_to}",
                 "wandb.mode=disabled", *setup.overrides]
    plan = prepare(compose_checked(overrides), torch.cuda.device_count())
    print(f"\n{setup.name}: {' '.join(overrides)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        sweep = MaxBatchSearch(plan.exp, Path(tmp) / "search", plan.launcher, plan.nproc)
        result = sweep.run()
        search_wall = time.perf_counter() - start
        searched = [p for p in sweep.probes if not p.for_fastest]
        shared = SharedProbes(plan, Path(tmp) / "policies")
        for probe in sweep.probes:
            shared.add(probe)
        without = shared.without_estimate(sweep.limit_gb)
        doubling = shrinking = None
        if policies:
            doubling = shared.policy(lambda fits: doubling_then_bisection(fits, up_to))
            shrinking = shared.policy(lambda fits: shrink_by_ten_percent(fits, up_to))
    return {"setup": setup, "answer": result["max_batch_size"], "noise_mb": result["noise_band_gb"] * 1024,
            "boundary": shared.boundary(), "probes": len(searched), "placing": len(sweep.probes) - len(searched),
            "sizes": [p.batch_size for p in searched], "search_wall_s": search_wall,
            "probe_wall_s": sum(p.wall_s for p in searched), "estimate_s": (sweep.estimated or {}).get("wall_s", 0.0),
            "estimated": [[b, round(gb, 3)] for b, gb in (sweep.estimated or {}).get("peaks_gb", [])],
            "without": without, "doubling": doubling, "shrinking": shrinking}


def policy_cells(policy: Policy | None, boundary: int) -> str:
    if policy is None:
        return "not run | "
    decided = f" ({policy.decided} decided)" if policy.decided else ""
    exact = "" if policy.answer == boundary else f", answers {policy.answer}"
    return f"{len(set(policy.sizes))}{decided}{exact} | {policy.wall_s:.0f}"


def table(rows: list[dict]) -> str:
    lines = [("| setup | limit GB | peak as the batch grows | answer (noise band MB) | fsdp_exp probes | "
              "fsdp_exp wall s (search, probes, estimate) | without the estimate probes | wall s | "
              "doubling + bisection probes | wall s | shrink by 10% probes | wall s |"),
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        s = r["setup"]
        placing = f" +{r['placing']} to place the fastest" if r["placing"] else ""
        raw = "" if r["boundary"] == r["answer"] else f"; {r['boundary']} trained"
        lines.append(
            f"| {s.name} | {s.limit_gb:g} | {s.curve} | {r['answer']} ({r['noise_mb']:.1f}{raw}) | "
            f"{r['probes']}{placing} | {r['search_wall_s']:.0f}, {r['probe_wall_s']:.0f}, {r['estimate_s']:.0f} | "
            f"{policy_cells(r['without'], r['boundary'])} | "
            f"{policy_cells(r['doubling'], r['boundary'])} | {policy_cells(r['shrinking'], r['boundary'])} |")
    lines.append("")
    for r in rows:
        lines.append(f"- {r['setup'].name}: fsdp_exp probed {', '.join(map(str, r['sizes']))}; without the "
                     f"estimate {', '.join(map(str, r['without'].sizes))}; the estimate (batch, GB): "
                     f"{', '.join(f'{b} {gb}' for b, gb in r['estimated']) or 'none'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [s.name for s in SETUPS]
    parser.add_argument("setups", nargs="*", metavar="SETUP", help=f"some of: {', '.join(names)} (default: all)")
    parser.add_argument("--up-to", type=int, default=4096)
    parser.add_argument("--searches-only", action="store_true",
                        help="the search with and without the estimate, not the two policies users know")
    args = parser.parse_args()
    unknown = sorted(set(args.setups) - set(names))
    if unknown:
        parser.error(f"unknown setup {', '.join(unknown)}; choose from {', '.join(names)}")
    chosen = [s for s in SETUPS if not args.setups or s.name in args.setups]
    print(header(2, torch.cuda.is_available()))
    rows = [bench(setup, args.up_to, not args.searches_only) for setup in chosen]
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
