"""max_batch.json: a search's record. The search rewrites it whole after every probe
(`MaxBatchSearch.save`) and reads it back when it is run again into the same directory
(`MaxBatchSearch.recorded_probes`); the answer line, the plot, wandb and the summary's figures
read it as one (fsdp_exp.tasks.max_batch.report). Each key is a field here, in the file's
order; keys of older records are kept in `more`.

The nested parts stay as the file holds them: each probe is `Probe.to_json()`, the
verification `Verification.to_json()`, the length check `LengthCheck.to_json()`, the
estimate the curve of fsdp_exp.tasks.max_batch.prior."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdp_exp.metrics.json_record import JsonRecord

RECORD = "max_batch.json"  # in a search's run directory


@dataclass(kw_only=True, slots=True)
class MaxBatchRecord(JsonRecord):
    # What was searched, under which limit, and how (task.*)
    setup: str | None = None
    device: str | None = None
    device_name: str | None = None  # rank 0's
    world_size: int | None = None
    limit_gb: float | None = None
    resolution: int | None = None
    margin: float | None = None
    search_up_to: int | None = None
    steps_per_probe: int | None = None

    # The answer, once verified
    max_batch_size: int | None = None
    searched_max_batch_size: int | None = None  # the probes' boundary, before the verification
    verification: dict | None = None
    length_check: dict | None = None
    run_beyond_probe_gb: float | None = None  # counted against each probe
    recommended_batch_size: int | None = None
    # whether the line keeps the margin free at it (not where even the smallest size holds more)
    recommended_keeps_margin: bool | None = None
    bounded_by: str | None = None  # verification, data, search_up_to, oom, failed or noise
    data_share_per_rank: int | None = None
    searched_from: int | None = None
    too_small_to_train: list[dict] = field(default_factory=list)  # each {"batch_size", "reason"}
    noise_band_gb: float | None = None
    # how far the boundary moves between runs of this setup, in samples
    noise_band_samples: float | None = None
    # ... measured at the answer
    peak_under_limit_gb: float | None = None
    peak_mem_gb: float | None = None
    peak_mem_gb_per_rank: list[float] | None = None
    alloc_retries: float | None = None  # GPU: the allocator freed its cache to fit it
    samples_per_s: float | None = None
    fastest_batch_size: int | None = None
    fastest_samples_per_s: float | None = None
    near_fastest_batch_size: int | None = None
    smallest_batch_needs_gb: float | None = None  # none fits

    # What the search read the answer from
    memory_model: dict | None = None  # the line: intercept_gb, slope_gb_per_sample, points, measure
    estimate: dict | None = None  # the estimate's curve (task.estimate)
    probes: list[dict] = field(default_factory=list)
    smallest_batch_need_probe: dict | None = None  # none fits: under all this device gives a rank
    probe_count: int | None = None
    # the probes run before the first run of the command (the search's own); the rest went on
    # below the boundary with what that run held beyond its probe counted
    probes_before_verifying: int | None = None
    probes_reused: int | None = None
    wall_s: float | None = None  # this run's, after any reused probes
    probe_wall_s: float | None = None
    estimate_wall_s: float | None = None
    verify_wall_s: float | None = None
    fingerprint: str | None = None  # the setup the probes are for (fsdp_exp.tasks.max_batch.probe)

    more: dict[str, Any] = field(default_factory=dict)  # any other key, as it was written

    FILE: ClassVar[str] = RECORD
    KEEPS_NONE: ClassVar[bool] = True  # every key, null where unset, as the file always had them
