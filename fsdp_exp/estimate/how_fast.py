"""How fast a setup trains, for task=estimate: priced by the speed model
(fsdp_exp.estimate.speed) at the rates a task=tune fitted on this machine
(`task.calibration`), or, on a named GPU without one, a roofline: the step's FLOPs at the
GPU's peak, and nothing else, an upper bound."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.errors import ConfigError
from fsdp_exp.estimate.speed import PARTS, Rates, StepWork
from fsdp_exp.metrics.flops import PEAKS

if TYPE_CHECKING:
    from fsdp_exp.estimate.gpu import Gpu
    from fsdp_exp.estimate.record import EstimateRecord

TUNE_RECORD = "tune.json"  # fsdp_exp.tasks.tune.report.RECORD, without its imports


def read_calibration(where: str) -> Rates:
    """The rates of a task=tune run's speed model: its folder or its tune.json."""
    path = Path(where).expanduser()
    path = path / TUNE_RECORD if path.is_dir() else path
    try:
        rates = Rates.from_json(json.loads(path.read_text()).get("speed_model"))
    except FileNotFoundError:
        raise ConfigError(f"task.calibration={where}: no {TUNE_RECORD} there; give a task=tune run's folder "
                          "or its tune.json") from None
    except (ValueError, AttributeError, KeyError, TypeError) as err:
        raise ConfigError(f"task.calibration={where}: {path} is not a tune's record ({err})") from None
    if rates is None:
        raise ConfigError(f"task.calibration={where}: that tune has no speed model (it ran with task.estimate=false, "
                          "or no probe of a traced setup trained)")
    return rates


def roofline(gpu: Gpu, column: str) -> tuple[Rates, str] | None:
    """Rates that cost a step its FLOPs at the GPU's peak in `column` (bf16, tf32, fp32) and
    nothing else, and that said in words; None where the GPU's peak is not known."""
    wanted = set(words(gpu.name))
    peak = next((p for p in PEAKS if wanted <= set(words(p.entry))), None)
    tflops = getattr(peak, column) if peak else None
    if peak is None or tflops is None:
        return None
    seconds = tuple(1 / (tflops * 1e12) if part == "flops" else 0.0 for part in PARTS)
    return Rates(seconds, 0, 0), f"roofline on {peak.entry} at its {column} peak, {tflops:g} TFLOP/s: an upper bound"


def words(name: str) -> list[str]:
    return re.split(r"[\s\-_]+", name.lower())


def add_speeds(record: EstimateRecord, rates: Rates, source: str, tokens_per_sample: int) -> None:
    """Each traced batch's predicted samples/s (and tokens/s, for token data) by `rates`,
    and the answer's batch's on the record."""
    work = StepWork.from_json(record.step_work)
    record.speed_from = source
    if work is None:
        record.speed_from = f"{source}; but the step's FLOPs were not counted"
        return
    for batch in record.batches or []:
        batch["predicted_samples_per_s"] = rates.samples_per_s(work, batch["batch_size"])
        batch["within_calibration"] = rates.fitted_at(batch["batch_size"])
    at = next((b for b in record.batches or [] if b["batch_size"] == record.batch_size), None)
    record.predicted_samples_per_s = at["predicted_samples_per_s"] if at else None
    if rates.batches is not None and at is not None and not at["within_calibration"]:
        low, high = rates.batches
        record.speed_from += (f"; outside the batches it was fitted at ({low} to {high}), where its error is "
                              "larger (docs/BENCHMARKS.md, \"How fast, calibrated\")")
    if record.predicted_samples_per_s is not None and tokens_per_sample:
        record.predicted_tokens_per_s = record.predicted_samples_per_s * tokens_per_sample
