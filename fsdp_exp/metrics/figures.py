"""The parts of summary.json (fsdp_exp.metrics.summary.Summary, composed of them): how a run
ended, what training measured, the run's own estimate, and each task's answer. A task makes
its answer as its record (`TrainAnswer`, `MaxBatchAnswer`, `TuneAnswer`, `EstimateAnswer`, `EvalAnswer`,
`ExportAnswer`): a name it has no field for is an error where it is made. The figures more
than one task answers with (a batch, its speed and peak) are `Answer`'s, which each answer
extends; each figure is declared once, here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


class Figures:
    """A part of summary.json, made where its figures are: a dataclass whose fields are
    Summary's."""

    __slots__ = ()

    def figures(self) -> dict[str, Any]:
        """Its figures that are set, by name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        return {name: value for name, value in values.items() if value is not None}


def composed_of(*parts: type) -> Callable[[type], type]:
    """A class decorator, under @dataclass: the class gets each field of `parts`, in their
    order (a field that two parts share, once), before its own."""

    def compose(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        annotations: dict[str, Any] = {}
        for part in parts:
            for f in fields(part):  # type: ignore[arg-type]
                if f.name not in annotations:
                    annotations[f.name] = f.type
                    setattr(cls, f.name, f.default)
        cls.__annotations__ = {**annotations, **own}
        return cls

    return compose


@dataclass(kw_only=True, slots=True)
class Answer(Figures):
    """What more than one task answers with: how the run ended, its batch, speed and peaks
    (a training run's as it measured them, max_batch's at its answer, tune's winner's as its
    command line ran, task=estimate's as predicted)."""

    status: str | None = None  # ok, none_fits (a search: not even its smallest batch fits), failed, oom, interrupted, refused
    task: str | None = None
    world_size: int | None = None
    device: str | None = None
    wall_s: float | None = None
    limit_gb: float | None = None
    batch_size: int | None = None
    max_batch_size: int | None = None
    probes: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_mem_gb: float | None = None
    peak_mem_gb_per_rank: list[float] | None = None
    peak_under_limit_gb: float | None = None
    peak_in_use_gb: float | None = None
    peak_reserved_gb: float | None = None
    device_used_gb: float | None = None


@dataclass(kw_only=True, slots=True)
class RunEnd(Figures):
    """How the run ended beyond its status (fsdp_exp.driver.run); `reason`: why its check
    refused it (a sweep's row)."""

    error: str | None = None
    reason: str | None = None
    signal: str | None = None  # interrupted: SIGINT or SIGTERM
    steps_done: int | None = None  # interrupted: the last step metrics.jsonl holds
    overrides: list[str] | None = None
    choices: dict[str, str] | None = None
    environment: dict | None = None


@dataclass(kw_only=True, slots=True)
class Training(Figures):
    """What a training run measured (fsdp_exp.rank.trainer, fsdp_exp.metrics.throughput and
    peaks, fsdp_exp.rank.build and report), beside the Answer's figures."""

    steps: int | None = None
    peak_settled_at_step: int | None = None  # a run that trains until its peak settles (fsdp_exp.rank.peak_settled)
    estimate_trace_held: bool | None = None  # the run's own trace was stopped through its timed steps (fsdp_exp.rank.trace_held)
    resumed_from_step: int | None = None
    final_loss: float | None = None
    global_batch_size: int | None = None
    warmup_only: bool | None = None
    steps_per_s: float | None = None
    step_time_s: float | None = None
    host_data_wait_share: float | None = None
    padded_tokens_per_s: float | None = None
    padding_share: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    peak_active_gb: float | None = None
    peak_reserved_gb_per_rank: list[float] | None = None
    peak_resident_gb: float | None = None
    peak_forward_gb: float | None = None
    peak_backward_gb: float | None = None
    peak_optimizer_step_gb: float | None = None
    alloc_retries: float | None = None
    ooms: float | None = None
    held_mem_gb: float | None = None
    checkpoint_saves: int | None = None
    checkpoint_blocked_s: float | None = None
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
    runtime_gb: float | None = None
    peak_under_limit_gb_per_rank: list[float] | None = None
    held_before_limit_gb_per_rank: list[float] | None = None
    device_used_gb_per_rank: list[float] | None = None


@dataclass(kw_only=True, slots=True)
class OwnEstimate(Figures):
    """The run's own estimate beside what it measured (fsdp_exp.estimate.beside)."""

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


@dataclass(kw_only=True, slots=True)
@composed_of(Training, OwnEstimate)
class TrainAnswer(Answer):
    """task=train's figures (fsdp_exp.tasks.train): what training measured on its ranks
    (fsdp_exp.rank.report) and its own estimate beside them."""


@dataclass(kw_only=True, slots=True)
class MaxBatchAnswer(Answer):
    """task=max_batch's answer (fsdp_exp.tasks.max_batch.report)."""

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
    verification: str | None = None


@dataclass(kw_only=True, slots=True)
class TuneAnswer(Answer):
    """task=tune's winner (fsdp_exp.tasks.tune.report)."""

    winner: str | None = None
    command: str | None = None
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


@dataclass(kw_only=True, slots=True)
class EstimateAnswer(Answer):
    """task=estimate's prediction (fsdp_exp.tasks.estimate)."""

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


@dataclass(kw_only=True, slots=True)
class EvalAnswer(Answer):
    """task=eval's figures (fsdp_exp.tasks.eval)."""

    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_samples: int | None = None
    examples: list[dict] | None = None  # task=eval: a few predictions beside their labels
    weights: str | None = None


@dataclass(kw_only=True, slots=True)
class ExportAnswer(Answer):
    """task=export's figures (fsdp_exp.tasks.export)."""

    exported: str | None = None
    checkpoint: str | None = None
    step: int | None = None
    params: int | None = None


PARTS = (Answer, RunEnd, Training, OwnEstimate, MaxBatchAnswer, TuneAnswer, EstimateAnswer, EvalAnswer, ExportAnswer)
