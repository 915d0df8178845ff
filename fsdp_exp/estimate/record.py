"""estimate.json: the estimate of a setup, one record. `fsdp_exp.estimate.predict` makes it,
task=estimate adds its answer in tokens, prints its table and writes it; a training run's
own estimate (`fsdp_exp.estimate.beside`) writes it beside the run, where the run's check
against it reads it back (`EstimateRecord.read`).

Each figure a run measures is named as the run names it (`peak_mem_gb`, `peak_in_use_gb`,
`peak_under_limit_gb`, `peak_reserved_gb`, `device_used_gb`): the run's summary has each
beside the measured one as `estimated_<name>` (fsdp_exp.metrics.summary.ESTIMATED).
Light: no torch, so the process that settles a run's summary imports it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdp_exp.metrics.json_record import JsonRecord

ESTIMATE_FILE = "estimate.json"


@dataclass(kw_only=True, slots=True)
class EstimateRecord(JsonRecord):
    device: str | None = None  # cpu | cuda: the device estimated for
    world_size: int | None = None
    shards: int | None = None  # ranks sharing each parameter
    params: int | None = None
    batch_size: int | None = None  # the answer's: the largest that fits, else the first asked for

    # Each figure a run measures, at batch_size, under the run's name for it:
    peak_mem_gb: float | None = None  # the largest while it trains, the runtime left out, the data and imports in
    peak_in_use_gb: float | None = None  # CPU: what the allocations held where the step's phases end
    peak_under_limit_gb: float | None = None  # what memory.limit_gb caps
    peak_reserved_gb: float | None = None  # GPU: what torch's caching allocator reserves
    device_used_gb: float | None = None  # GPU: what the device holds, outside the allocator too

    # ... and what no run measures apart
    peak_with_runtime_gb: float | None = None  # the rank's whole peak with its runtime
    peak_mem_with_build_gb: float | None = None  # the peak over a model build too, without the runtime
    runtime_gb: float | None = None
    data_gb: float | None = None  # CPU: what making the data set grew the tracing process by
    build_held_gb: float | None = None  # CPU: what building the model grew it by besides its tensors (imports)
    step_peak_gb: float | None = None
    phase: str | None = None  # what sets the peak when not a step: a model build, a data load, a save
    breakdown_gb: dict[str, float] | None = None  # the peak's parts: parameters, gradients, ...
    outside_allocator_gb: dict[str, float] | None = None  # GPU: the CUDA context, NCCL, cuBLAS
    cublas_workspaces_mb: list[float] | None = None
    gpu: str | None = None  # task.gpu: the GPU it must fit on
    gpu_memory_gb: float | None = None
    offloaded_gb: float | None = None  # offload=true: what each rank keeps in host memory
    build_peak_gb: float | None = None  # a whole model built on every rank first

    # Where it must fit, and the answer
    limit_gb: float | None = None
    host_gb: float | None = None  # the host's memory per node
    host_phase: str | None = None
    host_per_rank_gb: dict[str, float] | None = None
    host_launcher_gb: float | None = None  # the launching command and its rank server
    ranks_per_node: int | None = None
    host_limit_gb: float | None = None
    largest_batch_fitting: int | None = None  # of the batch sizes traced; 0: none fits
    predicted_max_batch: int | None = None  # where the curve through them reaches the memory
    batches: list[dict[str, Any]] | None = None  # each batch size traced, as above
    step_work: dict[str, Any] | None = None  # what a step does, for the speed model (fsdp_exp.estimate.speed)
    # How fast, at batch_size (fsdp_exp.estimate.how_fast): by task.calibration's rates, or a roofline
    predicted_samples_per_s: float | None = None
    predicted_tokens_per_s: float | None = None
    speed_from: str | None = None  # whose rates, in words (a roofline says it is an upper bound)
    trace_s: float | None = None
    wall_s: float | None = None

    # task=estimate's own: the setup, its answer in tokens (token data), by sequence length
    setup: str | None = None
    seq_len: int | None = None
    tokens_per_micro_batch: int | None = None
    predicted_max_tokens: int | None = None
    by_seq_len: list[dict[str, Any]] | None = None

    error: str | None = None  # why the setup could not be traced, in place of the figures
    reused_from: str | None = None  # kept from an earlier trace of this setup: where (fsdp_exp.estimate.earlier)

    more: dict[str, Any] = field(default_factory=dict)  # any other key, as it was written

    FILE: ClassVar[str] = ESTIMATE_FILE

    @property
    def judged(self) -> bool:
        """Whether there is memory to fit in: memory.limit_gb, a named GPU or the host's limit."""
        return self.limit_gb is not None or self.gpu is not None or self.host_limit_gb is not None
