"""summary.json: a run's record. The driver writes it (`Summary.write`, fsdp_exp.driver.run);
whatever reads a finished run reads it as one (`Summary.read`, or `Summary.of` the file's
dict): compare, a sweep's outcome, a probe's search, check_gpu, the run's own estimate added
later. Each figure has one name, a
field here, as the README and docs/ name it; what a task adds beyond these, and keys of
older summaries, are kept in `more`.

Some names are each task's own answer: `peak_mem_gb` is what a training run measured, the
peak at max_batch's answer, and the estimated peak of task=estimate; `samples_per_s` is a
run's, the answer's or tune's winner's (compare reads them by task)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdp_exp.metrics.json_record import JsonRecord

SUMMARY = "summary.json"  # a run directory's summary, written by its driver
NONE_FITS = "none_fits"  # task=max_batch or tune: not even the smallest batch fits (exit code 3)
ANSWERED = ("ok", NONE_FITS)
PEAK_GB = "peak_mem_gb"  # a run's peak memory, by this one name in every record, table and plot


@dataclass(kw_only=True, slots=True)
class Summary(JsonRecord):
    # How the run ended (fsdp_exp.driver.run); `reason`: why its check refused it (a sweep's row)
    status: str | None = None  # ok, none_fits (a search: not even its smallest batch fits), failed, oom, interrupted, refused
    error: str | None = None
    reason: str | None = None
    signal: str | None = None  # interrupted: SIGINT or SIGTERM
    steps_done: int | None = None  # interrupted: the last step metrics.jsonl holds
    task: str | None = None
    world_size: int | None = None
    device: str | None = None
    overrides: list[str] | None = None
    choices: dict[str, str] | None = None
    environment: dict | None = None
    wall_s: float | None = None

    # Training (fsdp_exp.rank.trainer, fsdp_exp.metrics.throughput): the steady-state means
    steps: int | None = None
    peak_settled_at_step: int | None = None  # a run that trains until its peak settles (fsdp_exp.rank.peak_settled)
    estimate_trace_held: bool | None = None  # the run's own trace was stopped through its timed steps (fsdp_exp.rank.trace_held)
    resumed_from_step: int | None = None
    final_loss: float | None = None
    global_batch_size: int | None = None
    warmup_only: bool | None = None
    samples_per_s: float | None = None
    steps_per_s: float | None = None
    step_time_s: float | None = None
    host_data_wait_share: float | None = None
    tokens_per_s: float | None = None
    padded_tokens_per_s: float | None = None
    padding_share: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    # ... the run's peaks (fsdp_exp.metrics.peaks)
    peak_mem_gb: float | None = None
    peak_mem_gb_per_rank: list[float] | None = None
    peak_active_gb: float | None = None
    peak_reserved_gb: float | None = None
    peak_reserved_gb_per_rank: list[float] | None = None
    peak_resident_gb: float | None = None
    peak_in_use_gb: float | None = None
    peak_forward_gb: float | None = None
    peak_backward_gb: float | None = None
    peak_optimizer_step_gb: float | None = None
    alloc_retries: float | None = None
    ooms: float | None = None
    held_mem_gb: float | None = None
    checkpoint_saves: int | None = None
    checkpoint_blocked_s: float | None = None
    # ... what the build knew and the first micro-batch counted (fsdp_exp.rank.build)
    fsdp_units: list[dict] | None = None
    tf32: bool | None = None
    peak_tflops: float | None = None
    peak_tflops_source: str | None = None
    flops_per_step: int | None = None
    hardware_flops_per_step: int | None = None
    flops_source: str | None = None
    flops_per_step_analytic: int | None = None
    flops_per_step_counted: int | None = None
    flops_uncounted_ops: list[str] | None = None
    startup: dict[str, float] | None = None
    # ... and what was added once it trained (fsdp_exp.rank.report)
    runtime_gb: float | None = None
    limit_gb: float | None = None
    peak_under_limit_gb: float | None = None
    peak_under_limit_gb_per_rank: list[float] | None = None
    held_before_limit_gb_per_rank: list[float] | None = None
    device_used_gb: float | None = None
    device_used_gb_per_rank: list[float] | None = None

    # The run's own estimate beside what it measured (fsdp_exp.estimate.beside)
    estimate: str | None = None  # "not ready": its trace had not ended when the run did, and was stopped
    estimate_failed: str | None = None
    estimate_reused_from: str | None = None  # kept from an earlier trace of this setup (fsdp_exp.estimate.earlier)
    estimate_wait_s: float | None = None
    estimate_ratio: float | None = None
    estimated_peak_in_use_gb: float | None = None
    estimated_peak_mem_gb: float | None = None
    estimated_peak_under_limit_gb: float | None = None
    estimated_peak_reserved_gb: float | None = None
    estimated_device_used_gb: float | None = None
    estimate_ratio_peak_in_use: float | None = None
    estimate_ratio_peak_mem: float | None = None
    estimate_ratio_peak_under_limit: float | None = None
    estimate_ratio_peak_reserved: float | None = None
    estimate_ratio_device_used: float | None = None

    # task=max_batch's answer (fsdp_exp.tasks.max_batch.report)
    max_batch_size: int | None = None
    recommended_batch_size: int | None = None
    bounded_by: str | None = None
    resolution: int | None = None
    noise_band_gb: float | None = None
    noise_band_samples: int | None = None
    smallest_batch_needs_gb: float | None = None
    searched_from: int | None = None
    data_share_per_rank: int | None = None
    fastest_batch_size: int | None = None
    fastest_samples_per_s: float | None = None
    near_fastest_batch_size: int | None = None
    searched_max_batch_size: int | None = None
    run_beyond_probe_gb: float | None = None
    probes: int | None = None
    verification: str | None = None

    # task=tune's winner (fsdp_exp.tasks.tune.report); `batch_size` also task=estimate's
    winner: str | None = None
    command: str | None = None
    batch_size: int | None = None
    grad_accum: int | None = None
    step_s: float | None = None
    peak_gb: float | None = None
    as_fast: list[str] | None = None
    speed_noise: float | None = None
    probed_samples_per_s: float | None = None  # the winner's probes'; samples_per_s is its command line's, as it ran
    confirmed: dict | None = None
    winner_confirmed: bool | None = None
    setups: int | None = None
    settled: dict[str, int] | None = None
    budget: str | None = None
    stopped_by_budget: bool | None = None
    probes_reused: int | None = None
    tokens_per_sample: int | None = None

    # task=estimate's prediction (fsdp_exp.tasks.estimate)
    peak_with_runtime_gb: float | None = None
    largest_batch_fitting: int | None = None
    predicted_max_batch: int | None = None
    host_gb: float | None = None
    ranks_per_node: int | None = None
    host_limit_gb: float | None = None
    seq_len: int | None = None
    tokens_per_micro_batch: int | None = None
    predicted_max_tokens: int | None = None
    gpu: str | None = None
    gpu_memory_gb: float | None = None
    predicted_samples_per_s: float | None = None  # with a calibration of this machine, or a GPU's roofline
    predicted_tokens_per_s: float | None = None
    speed_from: str | None = None  # what the predicted speed is from

    # task=eval (fsdp_exp.tasks.eval) and task=export (fsdp_exp.tasks.export)
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_samples: int | None = None
    examples: list[dict] | None = None  # task=eval: a few predictions beside their labels
    weights: str | None = None
    exported: str | None = None
    checkpoint: str | None = None
    step: int | None = None
    params: int | None = None

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
ESTIMATE_LATER = ("its trace needs longer than this run and was stopped with it; task=estimate with the same "
                  "settings traces it once, and the later runs of this setup show it at once")


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
