"""summary.json: a run's record. The driver writes it (`Summary.write`, fsdp_exp.driver.run);
whatever reads a finished run reads it as one (`Summary.read`, or `Summary.of` the file's
dict): compare, a sweep's outcome, a probe's search, check_gpu, the run's own estimate added
later. Each figure has one name, a field of one of the parts it is composed of
(fsdp_exp.metrics.figures), as the README and docs/ name it; inside the process a figure
without a field is an error where it is added, and a key of an older summary read from a
file is kept in `more`.

Some names are each task's own answer: `peak_mem_gb` is what a training run measured, the
peak at max_batch's answer, and the estimated peak of task=estimate; `samples_per_s` is a
run's, the answer's or tune's winner's (compare reads them by task)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdp_exp.metrics.figures import PARTS, composed_of
from fsdp_exp.metrics.json_record import JsonRecord

SUMMARY = "summary.json"  # a run directory's summary, written by its driver
NONE_FITS = "none_fits"  # task=max_batch or tune: not even the smallest batch fits (exit code 3)
ANSWERED = ("ok", NONE_FITS)
PEAK_GB = "peak_mem_gb"  # a run's peak memory, by this one name in every record, table and plot


@dataclass(kw_only=True, slots=True)
@composed_of(*PARTS)
class Summary(JsonRecord):
    """summary.json's figures: each part's (fsdp_exp.metrics.figures), then any other key."""

    more: dict[str, Any] = field(default_factory=dict)  # any other key, as it was written

    FILE: ClassVar[str] = SUMMARY

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def answered(self) -> bool:
        """The run ended with its answer: `ok`, or a search's `none_fits`."""
        return self.status in ANSWERED


NAMES = Summary.names()


# What a run measures that its own estimate predicts (memory.estimate, fsdp_exp.estimate.beside),
# with what it is called: the estimate is estimated_<figure> beside it in the summary, and
# estimated over measured is estimate_ratio_<figure without _gb>; estimate_ratio is the first
# one the run has.
ESTIMATED = (("in use at phase ends", "peak_in_use_gb"),  # CPU: what the allocations held
             ("peak", PEAK_GB),
             ("as the limit counts it", "peak_under_limit_gb"),
             ("reserved", "peak_reserved_gb"),
             ("the device", "device_used_gb"))


def estimated(measured: str) -> str:
    return f"estimated_{measured}"


def estimate_ratio(measured: str) -> str:
    return f"estimate_ratio_{measured.removesuffix('_gb')}"


assert all(estimated(m) in NAMES and estimate_ratio(m) in NAMES for _, m in ESTIMATED)

NOT_READY = "not ready"
ESTIMATE_LATER = ("its trace needed longer than the run's end could wait and was stopped with it; task=estimate "
                  "with the same settings traces it once, and the later runs of this setup show it at once")


def estimate_line(summary: Summary) -> str | None:
    """The run's own estimate beside what it measured, each figure with its error; or why
    there is none, or that it is still tracing; None when the run has neither. On CPU the
    resident peak is shown without an error: it also holds what glibc keeps of freed blocks,
    which no estimate of tensors predicts (peak_in_use_gb is what it predicts)."""
    if summary.estimate_failed is not None:
        return f"none: {summary.estimate_failed}"
    if summary.estimate == NOT_READY:
        return f"not ready: {ESTIMATE_LATER}"
    resident = summary.device == "cpu" or summary.runtime_gb is not None
    shown = []
    for name, measured in ESTIMATED:
        ratio = summary.get(estimate_ratio(measured))
        if ratio is None:
            continue
        guess, seen = summary.get(estimated(measured)), summary.get(measured)
        if resident and measured == PEAK_GB:
            shown.append(f"{name} {guess:.3f} GB (resident {seen:.3f} GB: glibc keeps freed blocks)")
        else:
            shown.append(f"{name} {guess:.3f} GB (measured {seen:.3f} GB, {ratio - 1:+.1%})")
    return "; ".join(shown) or None


SETUP_GROUPS = ("task", "model", "data", "sharding", "precision")
WARMUP_ONLY = " (warm-up steps only: raise train.steps above metrics.warmup_steps to measure)"


def summary_table(summary: Summary) -> str:
    """The run on one screen: what ran, how fast, how much memory."""
    s = summary

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    # With every step in warm-up, the means are the warm-up's: slower than the run would be.
    warmup = bool(s.warmup_only)

    def padding() -> str:
        share = s.padding_share
        return f" ({s.padded_tokens_per_s:,.0f} with padding, {share:.1%} of the positions)" if share else ""

    def measured(shown: str) -> str:
        return f"{shown} (warm-up)" if warmup and not shown.startswith("-") else shown

    rows = [
        ("status", s.status),
        ("setup", " ".join(f"{k}={v}" for k, v in (s.choices or {}).items() if k in SETUP_GROUPS)),
        ("overrides", " ".join(s.overrides or [])),
        ("world size", s.world_size),
        ("max batch", "none fits" if s.max_batch_size == 0 else s.max_batch_size),
        ("batch 1 needs" if (s.searched_from or s.resolution) == 1 else "smallest batch needs",
         fmt(s.smallest_batch_needs_gb, ".2f") + " GB"),
        ("recommended batch", s.recommended_batch_size or None),
        ("fastest batch", s.fastest_batch_size),
        ("within 5% of it from", s.near_fastest_batch_size),
        ("peak memory (max)", fmt(s.peak_mem_gb, ".2f") + " GB"),
        ("per rank", ", ".join(f"{v:.2f}" for v in s.peak_mem_gb_per_rank or []) + " GB"),
        ("whole process", fmt(s.peak_resident_gb, ".2f") + " GB resident, with "
         + fmt(s.runtime_gb, ".2f") + " GB of runtime" if s.runtime_gb is not None else None),
        ("memory.limit_gb", fmt(s.limit_gb, "g") + " GB"),
        ("peak under the limit", fmt(s.peak_under_limit_gb, ".3f") + " GB"),
        ("task=estimate's", estimate_line(s)),
        ("noise band", fmt(s.noise_band_gb and s.noise_band_gb * 1024, ".1f") + " MB"),
        ("steps", s.steps),
        ("resumed from step", s.resumed_from_step),
        ("eval loss", fmt(s.eval_loss, ".4f")),
        ("eval accuracy", fmt(s.eval_accuracy, ".2%")),
        ("exported", s.exported),
        ("final loss", fmt(s.final_loss, ".4f")),
        ("samples/s", fmt(s.samples_per_s, ",.1f") + (WARMUP_ONLY if warmup else "")),
        ("tokens/s", measured(fmt(s.tokens_per_s, ",.0f") + padding())),
        ("step time", measured(fmt(s.step_time_s, ".4f") + " s")),
        ("host waiting for data", fmt(s.host_data_wait_share, ".1%")),
        ("TFLOP/s per device", measured(fmt(s.tflops_per_device, ".3f"))),
        ("MFU", measured(fmt(s.mfu, ".1%"))),
        ("HFU (with recompute)", fmt(s.hfu, ".1%") if s.hfu != s.mfu else None),
        ("peak TFLOP/s", s.peak_tflops and f"{s.peak_tflops:g} ({s.peak_tflops_source})"),
        ("checkpoint blocked", fmt(s.checkpoint_blocked_s, ".3f") + " s per save"),
        ("wall time", fmt(s.wall_s, ".1f") + " s"),
    ]
    rows = [(k, v) for k, v in rows if v not in (None, "", "-", "- GB", " GB", "- MB", "- s", "- s per save")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
