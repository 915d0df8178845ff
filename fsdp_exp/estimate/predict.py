"""The estimate of a setup: each rank's peak memory by batch size at any world size, from a
trace of its training steps on fake tensors (`trace`) in a process of its own, and what the
peaks are made of (`breakdown`). task=estimate prints it; task=max_batch places its probes
by it."""

from __future__ import annotations

import importlib
import math
import signal
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.errors import one_line
from fsdp_exp.estimate.breakdown import GB, estimate_batch, evaluation_gb
from fsdp_exp.estimate.curve import PeakCurve
from fsdp_exp.estimate.gpu import Gpu, allocator_cap_gb, cublas_workspaces, outside_allocator_gb
from fsdp_exp.estimate.host import HostSetup, host_memory
from fsdp_exp.estimate.record import EstimateRecord
from fsdp_exp.estimate.speed import StepWork
from fsdp_exp.launcher.core import POLL_S, RunFailed, alongside
from fsdp_exp.launcher.rank_server import RANK_MODULES, process_context
from fsdp_exp.linux import anonymous_bytes
from fsdp_exp.memory import set_for_measuring
from fsdp_exp.metrics.wandb_sink import Wandb, WandbMode

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.estimate.traced import Trace

TIME_LIMIT_S = 900  # a trace past this is stopped: something in it does not run on fake tensors


def estimate(exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
             baseline_gb: float | None = None, stop_above_gb: float | None = None, gpu: Gpu | None = None,
             ranks_per_node: int | None = None) -> EstimateRecord:
    """The estimate record, traced in a fresh process (see `trace_in_child`). With
    `stop_above_gb`, the sizes are traced in order up to the first whose step is predicted
    to peak above it. On a GPU, `gpu` (task.gpu) names the device whose memory it must fit in.
    The host's memory is per node of `ranks_per_node` ranks (default: all on one)."""
    start = time.perf_counter()
    own_gb = anonymous_bytes() / GB  # this command's: as the launching command's and its rank server's, and task=eval's
    outside = outside_allocator_gb(world_size, exp.sharding.groups(world_size), gpu) if on_gpu else {}
    workspaces = cublas_workspaces(gpu) if on_gpu else ()
    outside_gb = baseline_gb if baseline_gb is not None else sum(outside.values())
    cap_gb = allocator_cap_gb(exp.memory.limit_gb, gpu, outside_gb) if on_gpu else None
    traced = trace_in_child(exp, world_size, batch_sizes, on_gpu, baseline_gb, stop_above_gb, outside, workspaces,
                            None if cap_gb is None else max(int(cap_gb * GB), 0))
    if baseline_gb is not None and on_gpu:  # the user's figure stands for everything outside the allocator
        outside = {"task.baseline_gb": baseline_gb}
    baseline_gb = baseline_or_measured(baseline_gb, on_gpu, traced.baseline_bytes, outside)
    builds_whole = exp.model.init_device != "meta"
    data_gb = 0.0 if on_gpu else traced.data_bytes / GB
    build_held_gb = 0.0 if on_gpu else traced.build_held_bytes / GB
    batches = [estimate_batch(step, traced, on_gpu, exp.offload, baseline_gb, builds_whole, sum(workspaces),
                              exp.checkpoint.stages_a_copy, exp.checkpoint.threads_started,
                              bool(exp.model.kwargs.get("pretrained"))) for step in traced.steps]
    steps = traced.steps
    if stop_above_gb is not None:  # the trace judged each step before what the math libraries keep was added
        over = next((i for i, b in enumerate(batches) if b.peak_under_limit_gb > stop_above_gb), len(batches))
        batches, steps = batches[:over + 1], steps[:over + 1]
    on_host = HostSetup(min(ranks_per_node or world_size, world_size), exp.data.num_workers,
                        exp.checkpoint.stages_a_copy, builds_whole, exp.train.grad_accum, 2 * own_gb, exp.offload)
    for b, step in zip(batches, steps):
        b.host = host_memory(b, traced, on_host, on_gpu)
        if not on_gpu:
            kept = step.library.in_use_bytes if step.library is not None else 0
            b.peak_in_use_gb = (step.at_phase_ends_bytes + traced.built_in_use_bytes + kept) / GB
        b.eval_gb = evaluation_gb(step, traced, on_gpu, baseline_gb if on_gpu else own_gb)
    limit, host_limit = exp.memory.limit_gb, exp.memory.host_limit_gb
    gpu_gb = gpu.memory_gb if gpu is not None and on_gpu else None

    judged = limit is not None or gpu_gb is not None or host_limit is not None
    fitting = [b for b in batches if fits(b.to_json(), limit, gpu_gb, host_limit)]
    chosen = fitting[-1] if fitting else batches[0]
    crossings = [c for c in (crossing([(b.batch_size, b.peak_under_limit_gb) for b in batches], limit),
                             crossing([(b.batch_size, b.device_used_gb or 0.0) for b in batches], gpu_gb),
                             crossing([(b.batch_size, b.host["host_gb"]) for b in batches], host_limit))
                 if c is not None]
    target = gpu if on_gpu else None  # task.gpu: the GPU it must fit on
    return EstimateRecord(
        device="cuda" if on_gpu else "cpu",
        world_size=world_size,
        shards=traced.shard_count,
        params=traced.params,
        batch_size=chosen.batch_size,
        # Each figure a run measures, under the name the run gives it:
        # the largest while it trains, the runtime left out, the data set and the build's imports in
        peak_mem_gb=chosen.training_gb() - chosen.breakdown_gb["baseline"] + data_gb + build_held_gb,
        peak_in_use_gb=chosen.peak_in_use_gb,
        peak_under_limit_gb=chosen.peak_under_limit_gb,
        peak_reserved_gb=chosen.peak_reserved_gb if on_gpu else None,
        device_used_gb=chosen.device_used_gb if on_gpu else None,
        # and what no run measures apart: the rank's whole peak with its runtime, which phase
        # sets it (a model build can outgrow the steps), and the runtime itself
        peak_with_runtime_gb=chosen.peak_with_runtime_gb,
        peak_mem_with_build_gb=chosen.peak_with_runtime_gb - chosen.breakdown_gb["baseline"] + data_gb + build_held_gb,
        runtime_gb=chosen.breakdown_gb["baseline"] - data_gb - build_held_gb,
        data_gb=data_gb,
        build_held_gb=build_held_gb,
        step_peak_gb=chosen.step_peak_gb,
        phase=chosen.phase,
        breakdown_gb=chosen.breakdown_gb,
        outside_allocator_gb=outside if on_gpu else None,
        cublas_workspaces_mb=[n / 2**20 for n in workspaces] if on_gpu else None,
        gpu=target.name if target else None,
        gpu_memory_gb=target.memory_gb if target else None,
        offloaded_gb=chosen.offloaded_gb,
        build_peak_gb=(traced.build_bytes / GB + baseline_gb) if builds_whole else None,
        limit_gb=limit,
        **chosen.host,  # host_gb (per node), host_phase, host_per_rank_gb, host_launcher_gb
        ranks_per_node=on_host.ranks_per_node,
        host_limit_gb=host_limit,
        largest_batch_fitting=fitting[-1].batch_size if fitting else (0 if judged else None),
        predicted_max_batch=min(crossings) if crossings else None,
        batches=[b.to_json() for b in batches],
        step_work=step_work(traced, exp.offload),
        trace_s=traced.seconds,
        wall_s=time.perf_counter() - start,
    )


def step_work(traced: Trace, offload: bool) -> dict | None:
    """What a step of the first size traced does, as the speed model counts it
    (fsdp_exp.estimate.speed); None when its FLOPs were not counted."""
    first = traced.steps[0] if traced.steps else None
    if first is None or not first.flops:
        return None
    shards = traced.optimizer_params
    # offload=true: each step brings the fp32 shards in and takes their gradients out
    return StepWork(first.batch_size, first.flops, first.wire_bytes, 8 * shards if offload else 0, shards,
                    traced.world_size).to_json()


def fits(batch: dict, limit_gb: float | None, gpu_memory_gb: float | None,
         host_limit_gb: float | None = None) -> bool | None:
    """Whether a batch of the record fits: what memory.limit_gb caps under it, on a named
    GPU (task.gpu) what the device holds within its memory, and the host's memory per node
    under memory.host_limit_gb; None: nothing to fit in."""
    if limit_gb is None and gpu_memory_gb is None and host_limit_gb is None:
        return None
    return ((limit_gb is None or batch["peak_under_limit_gb"] <= limit_gb)
            and (gpu_memory_gb is None or batch.get("device_used_gb", 0.0) <= gpu_memory_gb)
            and (host_limit_gb is None or batch.get("host_gb", 0.0) <= host_limit_gb))


def crossing(points: list[tuple[int, float]], target_gb: float | None) -> int | None:
    """Where the estimate's curve (straight between the sizes traced, on past the largest
    along the last two) reaches `target_gb`: the boundary it predicts, also between or
    beyond the sizes asked for."""
    if target_gb is None or len(points) < 2:
        return None
    size = PeakCurve(tuple(points)).crossing(target_gb)
    return None if math.isinf(size) else max(0, math.floor(size))


def baseline_or_measured(baseline_gb: float | None, on_gpu: bool, measured_bytes: int,
                         outside: dict[str, float]) -> float:
    """task.baseline_gb, or by default what sits outside the allocator on a GPU (`outside`)
    and what the tracing process held before building the model on CPU."""
    if baseline_gb is not None:
        return baseline_gb
    return sum(outside.values()) if on_gpu else measured_bytes / GB


def trace_in_child(exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
                   baseline_gb: float | None = None, stop_above_gb: float | None = None,
                   outside: dict[str, float] | None = None, workspaces: tuple[int, ...] = (),
                   cap_bytes: int | None = None) -> Any:
    """The trace, in a fresh process: the fake process group is this process's own, nothing
    of the driver's (threads, a sweep's other runs) is in the way, and what the process
    holds before tracing is what a rank holds before building its model (the baseline): forked
    from the rank server, as a run's ranks are, where the command started one (no second
    import of torch, seconds on a small machine), else spawned."""
    context = process_context()
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_traced, args=(child, exp, world_size, batch_sizes, on_gpu, baseline_gb,
                                                    stop_above_gb, outside or {}, workspaces, cap_bytes), daemon=True)
    # Ctrl-C reaches every process of the terminal's group: blocked in the tracing process
    # from its start (a forked process keeps the mask, through exec too), it leaves the
    # signal to this one, which stops it on its way out.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    child.close()
    run = alongside.get()  # a run beside others: Ctrl-C reaches it as its stop event
    try:
        deadline = time.monotonic() + TIME_LIMIT_S
        while not parent.poll(POLL_S):
            if run is not None and run.stop.is_set():
                raise KeyboardInterrupt  # stopped, not a setup that cannot be traced
            if time.monotonic() > deadline:
                break
        said = parent.poll(0)
        if said:
            ok, result = parent.recv()
        else:
            ok, result = False, f"it ran past {TIME_LIMIT_S} s"
    except EOFError:
        process.join(5)
        said, ok, result = False, False, f"the tracing process ended with exit code {process.exitcode}"
    finally:
        if process.is_alive():
            process.kill()
        process.join()
    if not ok:
        raise (CannotTrace if said else RunFailed)(f"task=estimate could not trace this setup: {result}")
    return result


class CannotTrace(RunFailed):
    """The trace itself failed on this setup (not its process, nor its time): so will it again."""


def _traced(pipe: Any, exp: Experiment, world_size: int, batch_sizes: list[int], on_gpu: bool,
            baseline_gb: float | None, stop_above_gb: float | None, outside: dict[str, float],
            workspaces: tuple[int, ...], cap_bytes: int | None) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # forked from the rank server: Ctrl-C is the driver's
    warnings.filterwarnings("ignore")
    try:
        from fsdp_exp.estimate.trace import trace  # here, in the child: tracing's imports cost the driver 0.5 s

        for module in RANK_MODULES:  # what a rank forked from the rank server holds (a spawned child: 9 MB)
            importlib.import_module(module)

        # the environment of the run it predicts: a GPU run's wandb keeps its error reporting
        set_for_measuring("cuda" if on_gpu else "cpu", None, estimated=True)

        if exp.wandb.mode != WandbMode.disabled:
            hold_a_wandb_run()

        def enough(step: Any, baseline_bytes: int) -> bool:
            base = baseline_or_measured(baseline_gb, on_gpu, baseline_bytes, outside)
            return estimate_batch(step, None, on_gpu, exp.offload, base, False, sum(workspaces)).peak_under_limit_gb > stop_above_gb

        pipe.send((True, trace(exp, world_size, batch_sizes, on_gpu, enough if stop_above_gb is not None else None,
                               workspaces, cap_bytes)))
    except Exception as err:  # noqa: BLE001 - sent back as one line
        pipe.send((False, one_line(err, named=True, whole=True, limit=500)))


def hold_a_wandb_run() -> None:
    """What rank 0 holds for its wandb run, held in this process before it is measured: rank
    0 starts the run before it marks its runtime (fsdp_exp.rank.build.start_wandb), so wandb's
    modules and what its run keeps (tens of MB) are in its runtime, which
    memory.limit_gb counts. An offline run of the same sink, in a directory removed after."""
    with tempfile.TemporaryDirectory() as scratch:
        sink = Wandb(mode=WandbMode.offline.value, project="estimate", entity=None, group=None, tags=[], config={},
                     run_dir=Path(scratch), job_type="estimate")
        sink.log({"step": 1, "loss": 1.0})
        sink.finish({})
