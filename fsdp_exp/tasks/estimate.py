"""task=estimate: each rank's peak memory for this setup at any world size, without a run.

The driver starts one process that traces a rank's training steps on fake tensors
(`fsdp_exp.estimate.trace`): nothing real is allocated, so `task.world_size=64` runs on a
laptop. It writes estimate.json, prints a table, and with `task.batch_sizes` answers the
largest batch predicted to fit under `memory.limit_gb`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from fsdp_exp.config import Device
from fsdp_exp.data.tokens import TokenData
from fsdp_exp.errors import ConfigError, at_least, one_line
from fsdp_exp.estimate.breakdown import PARTS
from fsdp_exp.estimate.gpu import Gpu, gpu_named
from fsdp_exp.estimate.how_fast import add_speeds, read_calibration, roofline
from fsdp_exp.estimate.earlier import keep, setup_key
from fsdp_exp.estimate.predict import CannotTrace, estimate, fits
from fsdp_exp.estimate.record import ESTIMATE_FILE, EstimateRecord
from fsdp_exp.launcher.core import RunFailed
from fsdp_exp.memory import device_memory_gb
from fsdp_exp.metrics.figures import EstimateAnswer
from fsdp_exp.metrics.flops import peak_column
from fsdp_exp.metrics.plots import plot_tokens
from fsdp_exp.metrics.summary import PEAK_GB
from fsdp_exp.tasks import Task, setup_line

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.estimate.speed import Rates
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


@dataclass
class Estimate(Task):
    world_size: int | None = None  # ranks to estimate for; null: what the launcher would start
    batch_sizes: list[int] = field(default_factory=list)  # per-rank sizes to predict; []: train.batch_size
    device: Device = Device.auto  # auto (the run's) | cpu | cuda: the device to estimate for, any machine
    baseline_gb: float | None = None  # the runtime's own memory beside the tensors; null: measured (CPU), modelled (GPU)
    gpu: str | None = None  # a GPU (H100-SXM, A100-40GB, L4, ...) or its memory in GB: fits on it? implies device cuda
    seq_lens: list[int] = field(default_factory=list)  # token data: the estimate again at each of these data.seq_len
    ranks_per_node: int | None = None  # ranks sharing a node's host memory; null: as the launcher places them
    calibration: str | None = None  # a task=tune run's folder (or its tune.json): its speed model says how fast

    uses_the_device: ClassVar[bool] = False  # it traces, for any device and world size

    def __post_init__(self) -> None:
        if self.world_size is not None:
            at_least("task.world_size", self.world_size, 1)
        for size in self.batch_sizes:
            at_least("task.batch_sizes", size, 1)
        for length in self.seq_lens:
            at_least("task.seq_lens", length, 1)
        if self.ranks_per_node is not None:
            at_least("task.ranks_per_node", self.ranks_per_node, 1)
        if self.baseline_gb is not None and self.baseline_gb < 0:
            raise ConfigError(f"task.baseline_gb={self.baseline_gb}: must be at least 0")
        if self.gpu is not None:
            gpu_named(str(self.gpu))
            if self.device == "cpu":
                raise ConfigError(f"task.gpu={self.gpu}: names a GPU to estimate for; leave task.device=auto or set cuda")

    def world(self, launched: int) -> int:
        """The world size to estimate for: task.world_size, or what the launcher would start."""
        return self.world_size or launched

    def check(self, exp: Experiment) -> None:
        if self.calibration is not None:  # before anything runs: a folder that is not a tune's is one line
            read_calibration(self.calibration)
        if self.seq_lens and not isinstance(exp.data, TokenData):
            raise ConfigError(f"task.seq_lens: data={type(exp.data).__name__} has no sequence length; "
                              "it is for token data (synthetic_tokens, text, token_file, padded_tokens)")
        sizes = self.sizes(exp)
        for size in sizes:
            if size % exp.train.grad_accum:
                raise ConfigError(f"task.batch_sizes: {size} is not a multiple of train.grad_accum="
                                  f"{exp.train.grad_accum}")

    def sizes(self, exp: Experiment) -> list[int]:
        return sorted(set(self.batch_sizes)) or [exp.train.batch_size]

    def on_gpu(self, exp: Experiment) -> bool:
        return self.device == "cuda" or self.gpu is not None or (self.device == "auto" and exp.device == "cuda")

    def named_gpu(self) -> Gpu | None:
        return gpu_named(str(self.gpu)) if self.gpu is not None else None

    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher,
            nproc: int) -> EstimateAnswer:
        calibrated = read_calibration(self.calibration) if self.calibration is not None else None
        per_node = self.ranks_per_node or launcher.ranks_per_node(nproc)
        sizes = self.sizes(exp)
        log.info("tracing one rank of %d on fake tensors: its build, sharding and a training step at %s "
                 "(seconds to a minute, by the model)", nproc,
                 f"batch {sizes[0]}" if len(sizes) == 1 else f"{len(sizes)} batch sizes, {sizes[0]} to {sizes[-1]}")
        kept = self.kept_as(exp, nproc, per_node)
        try:
            record = estimate(exp, nproc, sizes, self.on_gpu(exp), self.baseline_gb, gpu=self.named_gpu(),
                              ranks_per_node=per_node)
        except CannotTrace as err:  # a training run of the setup says so at once
            if kept is not None:
                keep(kept, EstimateRecord(error=one_line(err, limit=300)))
            raise
        if kept is not None:
            keep(kept, record)  # a training run of the setup checks against it at once
        record.setup = setup_line(context)
        tokens(record, exp)
        self.how_fast(record, exp, calibrated)
        if self.seq_lens:
            record.by_seq_len = [self.at_seq_len(exp, length, nproc, per_node) for length in sorted(set(self.seq_lens))]
        record.write(run_dir)
        print(table(record), flush=True)
        if self.seq_lens:
            print(seq_len_table(record), flush=True)
            plot_tokens(record.by_seq_len, room_words(record) or None, Path(run_dir) / "estimate_seq_lens.png")
        log.info("%s -> %s", answer_line(record), run_dir / ESTIMATE_FILE)
        return EstimateAnswer(task="estimate", **{k: record.get(k) for k in (*SUMMARY_KEYS, *GPU_KEYS, *TOKEN_KEYS)})

    def kept_as(self, exp: Experiment, nproc: int, per_node: int) -> str | None:
        """The key the record is kept under for the setup's training runs
        (fsdp_exp.estimate.earlier): an estimate of what such a run traces, at its own batch, for
        its own device, without task.gpu or task.baseline_gb; None for any other."""
        if self.sizes(exp) != [exp.train.batch_size] or self.baseline_gb is not None or self.gpu is not None:
            return None
        return setup_key(exp, nproc, per_node, self.on_gpu(exp))

    def how_fast(self, record: EstimateRecord, exp: Experiment, rates: Rates | None) -> None:
        """Predicted samples/s: by task.calibration's `rates`, or with task.gpu alone, a roofline."""
        gpu = self.named_gpu()
        if rates is not None:
            found: tuple | None = (rates, f"task.calibration={self.calibration}: {rates.runs} probe(s) of "
                                          f"{rates.setups} setup(s) on the machine that tuned")
        elif gpu is not None:
            found = roofline(gpu, peak_column(exp.precision.param_dtype, exp.precision.tf32))
            if found is None:
                record.speed_from = (f"there is no roofline: the peak TFLOP/s of {gpu.name} is not in the table; "
                                     "task.calibration gives rates measured on a machine")
        else:
            found = None
        if found is not None:
            add_speeds(record, *found, exp.data.tokens_per_sample)

    def at_seq_len(self, exp: Experiment, length: int, nproc: int, per_node: int) -> dict:
        """The estimate with data.seq_len=`length`: the largest batch that fits and its tokens,
        or why it could not be traced (a model that reads fewer positions)."""
        longer = replace(exp, data=replace(exp.data, seq_len=length))
        try:
            found = estimate(longer, nproc, self.sizes(exp), self.on_gpu(exp), self.baseline_gb, gpu=self.named_gpu(),
                             ranks_per_node=per_node)
        except RunFailed as err:
            return {"seq_len": length, "error": str(err)}
        tokens(found, longer)
        row = ("batch_size", PEAK_GB, "largest_batch_fitting", "predicted_max_batch", *TOKEN_KEYS)
        return {"seq_len": length, **{k: v for k, v in found.as_dict().items() if k in row}}


def tokens(record: EstimateRecord, exp: Experiment) -> None:
    """For token data, the answer in tokens: a micro-batch of the largest batch that fits
    (or of the batch estimated) times data.seq_len."""
    if not isinstance(exp.data, TokenData):
        return
    batch = record.largest_batch_fitting if record.largest_batch_fitting is not None else record.batch_size
    record.seq_len = exp.data.seq_len
    record.tokens_per_micro_batch = batch // exp.train.grad_accum * exp.data.seq_len
    if record.predicted_max_batch is not None:
        record.predicted_max_tokens = record.predicted_max_batch // exp.train.grad_accum * exp.data.seq_len


def seq_len_table(record: EstimateRecord) -> str:
    """The largest batch and its tokens per micro-batch at each sequence length."""
    fitted = record.judged
    head = "largest batch" if fitted else "batch"
    lines = [f"{'seq_len':>8} {head:>14} {'tokens/micro-batch':>19} {'peak GB':>8}"
             + (f" {'curve: batch':>13} {'tokens':>9}" if fitted else "")]
    for row in record.by_seq_len or []:
        if "error" in row:
            lines.append(f"{row['seq_len']:>8}  {row['error']}")
            continue
        batch = row["largest_batch_fitting"] if fitted else row["batch_size"]
        line = f"{row['seq_len']:>8} {batch:>14} {row['tokens_per_micro_batch']:>19,} {row['peak_mem_gb']:>8.3f}"
        if fitted and row.get("predicted_max_batch") is not None:
            line += f" {row['predicted_max_batch']:>13} {row['predicted_max_tokens']:>9,}"
        lines.append(line)
    if fitted:
        lines.append("largest batch: of task.batch_sizes, traced; curve: where the estimate's curve through them "
                     "reaches the memory (list more sizes in task.batch_sizes to trace closer)")
    return "\n".join(lines)


SUMMARY_KEYS = (PEAK_GB, "peak_under_limit_gb", "peak_with_runtime_gb", "batch_size", "world_size", "device", "limit_gb", "largest_batch_fitting",
                "predicted_max_batch", "host_gb", "ranks_per_node", "host_limit_gb", "wall_s", "predicted_samples_per_s",
                "predicted_tokens_per_s", "speed_from")
GPU_KEYS = ("peak_in_use_gb", "peak_reserved_gb", "device_used_gb", "gpu", "gpu_memory_gb")  # peak_in_use_gb: CPU
TOKEN_KEYS = ("seq_len", "tokens_per_micro_batch", "predicted_max_tokens")


def answer_line(record: EstimateRecord) -> str:
    where = f"{record.world_size} ranks on {record.device}"
    line = (f"predicted peak per rank at batch {record.batch_size}: {record.peak_mem_with_build_gb:.2f} GB "
            f"({where}, at the {record.phase or 'step'}), {record.peak_with_runtime_gb:.2f} GB "
            f"with {record.runtime_gb:.2f} GB of runtime")
    if record.device_used_gb is not None:
        line += f"; the GPU holds {record.device_used_gb:.2f} GB ({record.peak_reserved_gb:.2f} GB reserved by torch)"
    room = room_words(record)
    if room and len(record.batches) > 1:
        fitting = record.largest_batch_fitting
        line += (f"; largest batch predicted to fit {room}: {fitting}" if fitting
                 else f"; no batch asked for fits {room}")
        if record.predicted_max_batch is not None:
            line += f" (the estimate's curve reaches it at {record.predicted_max_batch})"
    elif room:
        line += f"; {'fits' if fitting_batch(record, record.batches[0]) else 'does not fit'} {room}"
    return line


def room_words(record: EstimateRecord) -> str:
    """Where the record's batches must fit, in words; "" where nothing is judged."""
    return " and ".join(([f"under memory.limit_gb={record.limit_gb:g}"] if record.limit_gb is not None else [])
                        + ([f"on {record.gpu} ({record.gpu_memory_gb:g} GB)"] if record.gpu is not None else [])
                        + ([f"with the host under memory.host_limit_gb={record.host_limit_gb:g}"]
                           if record.host_limit_gb is not None else []))


def fitting_batch(record: EstimateRecord, batch: dict) -> bool | None:
    """Whether a traced batch of the record fits where it must (predict.fits)."""
    return fits(batch, record.limit_gb, record.gpu_memory_gb, record.host_limit_gb)


def table(record: EstimateRecord) -> str:
    """One screen: the peak per batch size and what it is made of, in GB."""
    columns = [*PARTS, "baseline"]
    on_gpu = record.device == "cuda"
    short = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
             "temporaries": "temps", "unsharded_and_buffers": "unshard", "baseline": "outside" if on_gpu else "rt+data"}
    runtime = record.runtime_gb
    judged = record.judged
    fast = record.speed_from is not None
    lines = [f"estimate for {record.setup}: {record.params:,} parameters, {record.world_size} ranks "
             f"({record.shards} sharing each parameter), {record.device}",
             f"{'batch':>6} {'peak GB':>8} {'+runtime':>8}" + (f" {'reserved':>8} {'device':>8}" if on_gpu else "")
             + f" {'phase':<15}" + "".join(f"{short[c]:>8}" for c in columns) + (f" {'fits':>5}" if judged else "")
             + (f" {'samples/s':>10}" if fast else "")]
    for b in record.batches:
        own = b["peak_with_runtime_gb"] - runtime
        row = (f"{b['batch_size']:>6} {own:>8.3f} {b['peak_with_runtime_gb']:>8.3f}"
               + (f" {b['peak_reserved_gb']:>8.3f} {b['device_used_gb']:>8.3f}" if on_gpu else "") + f" {b['phase'] or 'step':<15}")
        row += "".join(f"{b['breakdown_gb'][c]:>8.3f}" for c in columns)
        if judged:
            row += f" {'yes' if fitting_batch(record, b) else 'no':>5}"
        if fast:
            speed = b.get("predicted_samples_per_s")
            mark = "" if b.get("within_calibration", True) else "*"
            row += f" {f'{speed:,.1f}{mark}':>10}" if speed is not None else f" {'':>10}"
        lines.append(row)
    if on_gpu:
        outside = ", ".join(f"{k.replace('_', ' ')} {v:.2f} GB" for k, v in record.outside_allocator_gb.items())
        lines.append(f"on the GPU: reserved is what torch's caching allocator holds (memory.limit_gb caps it); "
                     f"the device also holds {outside} outside it")
    lines.append(host_line(record))
    if fast:
        lines.append(speed_line(record))
    evaluated = [b for b in record.batches if b.get("eval_gb") is not None]
    if evaluated:
        lines.append("task=eval of these weights, in one process at task.batch_size "
                     + ", ".join(f"{b['batch_size']}: {b['eval_gb']:.2f} GB" for b in evaluated)
                     + " (the whole model, and a weights file read beside it or the forward without gradients)")
    for name, (what, avoid) in OUTGROWING.items():
        outgrown = [b for b in record.batches if b["phase"] == name]
        if outgrown:
            lines.append(f"{what} peaks above a step at batch {', '.join(str(b['batch_size']) for b in outgrown)} "
                         f"({outgrown[0]['phases_gb'].get(name, outgrown[0]['peak_with_runtime_gb']):.3f} GB "
                         f"with the runtime); {avoid}")
    return "\n".join(lines)


def speed_line(record: EstimateRecord) -> str:
    """How fast, at the answer's batch, and whose rates say so."""
    speed, tokens_per_s = record.predicted_samples_per_s, record.predicted_tokens_per_s
    if speed is None:
        return f"samples/s: none predicted; {record.speed_from}"
    marked = any(not b.get("within_calibration", True) for b in record.batches or [])
    return (f"predicted at batch {record.batch_size}: {speed:,.1f} samples/s on {record.world_size} rank(s)"
            + (f", {tokens_per_s:,.0f} tokens/s" if tokens_per_s else "") + f", by {record.speed_from}"
            + ("; *: a batch outside those the calibration was fitted at" if marked else ""))


def host_line(record: EstimateRecord) -> str:
    """The host's memory per node at the answer's batch: the total, what each rank holds,
    and against what it is judged (memory.host_limit_gb, else this machine's RAM)."""
    parts = ", ".join(f"{name} {gb:.2f} GB" for name, gb in record.host_per_rank_gb.items())
    limit = record.host_limit_gb
    against = (f"memory.host_limit_gb={limit:g}" if limit is not None
               else f"this machine's {device_memory_gb('cpu'):.1f} GB of RAM (memory.host_limit_gb sets a node's)")
    fits_in = record.host_gb <= (limit if limit is not None else device_memory_gb("cpu"))
    line = (f"host per node at batch {record.batch_size}: {record.host_gb:.2f} GB at its {record.host_phase} "
            f"({record.ranks_per_node} rank(s), each {parts}; the launching command and its rank server "
            f"{record.host_launcher_gb:.2f} GB); "
            f"{'fits' if fits_in else 'does not fit'} {against}")
    if not fits_in:
        line += "; " + HOST_SAVINGS
    return line


HOST_SAVINGS = ("fewer ranks per node, fewer data.num_workers, offload=false, checkpoint=dcp (no staged copy) "
                "or model.init_device=meta hold less of it")


# A phase that can outgrow the training step: what it is, and what avoids it.
OUTGROWING = {
    "model build": ("building the whole model on every rank first",
                    "model.init_device=meta builds only each rank's shards"),
    "pretrained load": ("loading the pretrained weights into the whole model on every rank first",
                        "model.init_device=meta: rank 0 alone loads them and sends each rank its shards"),
    "rank 0's model build": ("rank 0's whole model, built to send each rank its shards (model.init_device=meta),",
                             "on a GPU it is in host memory, not on the device; on CPU, more ranks make the shards "
                             "beside it smaller"),
    "data load": ("making the data set (its temporaries, beside the shards)",
                  "fewer samples (data.num_samples) or a data set read from files holds less"),
    "checkpoint save": ("a checkpoint save's copy of the state, beside a step,",
                        "checkpoint=dcp writes from the state itself, with no copy"),
}
