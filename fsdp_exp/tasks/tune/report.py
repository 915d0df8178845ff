"""What task=tune writes: tune.json (every setup's row, ranked, and the winner's command
line), tune.md (the table), tune.png (samples/s against peak memory, one point a setup,
the Pareto front and the winner marked: compare's chart), the table in wandb, and the
answer in the log."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_exp.metrics.figures import TuneAnswer
from fsdp_exp.metrics.plots import plot_throughput_vs_memory
from fsdp_exp.metrics.summary import NONE_FITS
from fsdp_exp.tasks.wandb_record import log_record
from fsdp_exp.tasks.tune.ranking import SPEED_NOISE, Row, ranked, table, ties, winner

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")

RECORD = "tune.json"


def command_words(prefix: list[str], row: Row) -> list[str]:
    """The overrides of the command that trains the setup at its batch: train.batch_size is a
    step's batch on each rank, `grad_accum` micro-batches of the row's batch."""
    assert row.batch_size is not None
    words = [*prefix, *row.overrides, f"train.batch_size={row.batch_size * row.grad_accum}"]
    if row.grad_accum > 1:
        words.append(f"train.grad_accum={row.grad_accum}")
    return words


def command_line(prefix: list[str], row: Row) -> str:
    """The command that trains the setup at its batch, as the user would type it."""
    return " ".join(["python -m fsdp_exp", *(shlex.quote(w) for w in command_words(prefix, row))])


def tune_record(rows: list[Row], *, prefix: list[str], world_size: int, limit_gb: float | None, budget: str,
                stopped: bool, probes_run: int, probes_reused: int, tokens_per_sample: int, wall_s: float,
                confirmed: dict | None = None, speed_model: dict | None = None,
                folded: list[str] | None = None, band: float | None = None) -> dict:
    """tune.json: the rows ranked, the winner marked, and how the tune got there. `confirmed`:
    the winner run again (status, samples_per_s, peak_gb, step_spread): the speed noise is how
    far that moved from the table, or its own steps from each other, SPEED_NOISE at least."""
    best = winner(rows)
    noise = max(SPEED_NOISE, band or 0.0)  # `band`: measured between runs on this machine
    if best and best.samples_per_s and confirmed and confirmed.get("samples_per_s"):
        noise = max(noise, abs(confirmed["samples_per_s"] / best.samples_per_s - 1), confirmed.get("step_spread") or 0)
    for row in rows:
        row.winner = row is best
    ran = confirmed.get("samples_per_s") if confirmed and confirmed.get("status") == "ok" else None
    order = ranked(rows)
    counts = {status: sum(r.status == status for r in rows) for status in dict.fromkeys(r.status for r in order)}
    return {
        "winner": best.setup if best else None,
        "command": command_line(prefix, best) if best else None,
        "batch_size": best.batch_size if best else None,
        "max_batch_size": best.max_batch_size if best else None,  # the largest the winner fits
        "grad_accum": best.grad_accum if best else None,
        "step_s": best.step_s if best else None,  # with task.global_batch: the time of one optimizer step
        # what the winner's command line, as printed, trained at; else its probes' (probed_samples_per_s)
        "samples_per_s": (ran or best.samples_per_s) if best else None,
        "probed_samples_per_s": best.samples_per_s if best else None,
        "tokens_per_s": at_speed(best.tokens_per_s, ran, best.samples_per_s) if best else None,
        "peak_gb": best.peak_gb if best else None,
        "as_fast": [r.setup for r in ties(rows, best, noise)] if best else [],  # within the speed noise of the winner
        "speed_noise": noise,  # samples/s moves by this share between runs: the answer's noise band
        "confirmed": confirmed,
        # False: the winner's command line was never run, or did not train (answer_line says which)
        "winner_confirmed": bool(confirmed and confirmed["status"] == "ok") if best else None,
        "limit_gb": limit_gb,
        "world_size": world_size,
        "setups": len(rows),
        "settled": counts,
        "budget": budget,
        "stopped_by_budget": stopped,
        "probes": probes_run,  # run by this tune (the setups' searches reuse any recorded)
        "probes_reused": probes_reused,
        "tokens_per_sample": tokens_per_sample,
        "wall_s": wall_s,
        "speed_model": speed_model,  # this machine's rates, fitted to the probes (fsdp_exp.estimate.speed)
        "folded": folded or [],  # options that change nothing on this device, folded into one (each in words)
        "rows": [r.to_json() for r in order],
    }


def at_speed(tokens_per_s: float | None, ran: float | None, probed: float | None) -> float | None:
    """Tokens/s of the probes, at the samples/s the command line `ran` at instead (where it ran)."""
    return tokens_per_s if tokens_per_s is None or not ran or not probed else tokens_per_s * ran / probed


def rows_of(record: dict) -> list[Row]:
    return [Row(**r) for r in record["rows"]]


def answer_line(record: dict) -> str:
    settled = ", ".join(f"{n} {status}" for status, n in record["settled"].items())
    cost = f"{record['setups']} setups ({settled}), {record['probes']} probe(s) in {record['wall_s']:.0f} s"
    if not record["winner"]:
        return f"tune: no setup trained under the limit; {cost}"
    speed = f"{record['samples_per_s']:,.1f} samples/s" + (
        f" ({record['tokens_per_s']:,.0f} tokens/s)" if record.get("tokens_per_s") else "")
    also = f"; as fast within {record['speed_noise']:.0%}: {'; '.join(record['as_fast'])}" if record["as_fast"] else ""
    batch = f"{record['batch_size']}" + (f" x {record['grad_accum']} (train.grad_accum)" if record["grad_accum"] > 1
                                         else "")
    if record.get("step_s") is not None:
        speed = f"{record['step_s']:.3f} s a step, {speed}"
    return (f"tune: fastest {record['winner']} at batch {batch} per rank, {speed}{as_it_ran(record)}, peak "
            f"{record['peak_gb']:.3f} GB{run_again(record)}{also}; {cost}\n  run it: {record['command']}")


def as_it_ran(record: dict) -> str:
    """Whose speed the answer gives: the winner's command line's, run as printed, beside its
    probes' (the table's, which rank the setups alike)."""
    confirmed, probed = record.get("confirmed"), record.get("probed_samples_per_s")
    if not confirmed or confirmed["status"] != "ok":
        return ""
    return (f" as its command line ran (its probes: {probed:,.1f}; noise band {record['speed_noise']:.0%})"
            if probed else f" (noise band {record['speed_noise']:.0%})")


def model_line(model: dict | None) -> str:
    """The speed model in words: the rates it fitted, and how far it missed a setup it had
    not seen (the `predicted` column)."""
    if not model:
        return ""
    rates = [f"{model['tflops']:.3g} TFLOP/s" if model.get("tflops") else None,
             f"{model['wire_gb_per_s']:.3g} GB/s on the wire" if model.get("wire_gb_per_s") else None,
             f"{model['ms_per_step']:.3g} ms a step" if model.get("ms_per_step") else None]
    error = model.get("error")
    missed = (f"; held out, it missed a setup's speed by at most {error:.0%}" if error is not None
              else "; too few setups ran to hold one out")
    return (f"speed model, fitted to {model['runs']} probe(s) of {model['setups']} setup(s): "
            f"{', '.join(r for r in rates if r) or 'no cost seen'}{missed}")


def run_again(record: dict) -> str:
    """What the winner did when run again, or that it was not: a winner nobody ran as its
    command line prints it is said to be one, in words a reader cannot miss."""
    confirmed = record.get("confirmed")
    if not confirmed:
        why = "task.budget ran out first" if record.get("stopped_by_budget") else "the tune ended first"
        return f"; NOT CONFIRMED: its command line was never run ({why}), so it may not train as printed"
    if confirmed["status"] == "ok":
        return ""
    return (f"; run again at batch {record['batch_size']} it did not train ({confirmed['status']}: "
            f"{confirmed['reason']}): task=max_batch on its command line finds a batch with room to spare")


def plot(record: dict, path: Path) -> list[str]:
    """tune.png: compare's chart of samples/s against peak memory, the winner starred."""
    rows = [r for r in rows_of(record) if r.samples_per_s and r.peak_gb is not None
            and r.status in ("measured", "bounded")]
    if not rows:
        return []
    points = [(f"{r.setup} @ {r.batch_size}" + ("" if r.status == "measured" else " (one probe; bounded)"),
               r.samples_per_s or 0.0, r.peak_gb or 0.0) for r in rows]
    best = next((i for i, r in enumerate(rows) if r.winner), None)
    limit = record.get("limit_gb")
    title = f"task=tune on {record['world_size']} rank(s)" + (f", memory.limit_gb={limit:g}" if limit else "")
    return plot_throughput_vs_memory(points, path, title=title, memory_label="peak memory per rank (GB)",
                                     winner=best, limit_gb=limit)


def report(exp: Experiment, context: RunContext, run_dir: Path, record: dict) -> TuneAnswer:
    """tune.md, tune.png, wandb and the log; the summary's figures."""
    tokens = bool(record["tokens_per_sample"])
    text = table(rows_of(record), tokens, confirmed=record["winner_confirmed"] is not False)
    notes = [*record.get("folded", []), model_line(record.get("speed_model"))]
    text += "".join(f"\n\n{note}" for note in notes if note)
    (run_dir / "tune.md").write_text(f"{text}\n\n{answer_line(record)}\n")
    png = run_dir / "tune.png"
    drawn = plot(record, png)
    log_to_wandb(exp, context, run_dir, record, png if drawn else None)
    log.info("%s\n%s\n  the record: %s", text, answer_line(record), run_dir / RECORD)  # the command line ends its own
    return summary_of(record)


def summary_of(record: dict) -> TuneAnswer:
    """The tune's figures in its summary.json: the winner's (its speed as its command line ran)."""
    keys = ("winner", "command", "batch_size", "max_batch_size", "grad_accum", "step_s", "samples_per_s",
            "probed_samples_per_s", "tokens_per_s", "peak_gb", "speed_noise", "confirmed", "winner_confirmed",
            "as_fast", "limit_gb", "world_size", "setups", "settled", "probes", "probes_reused", "stopped_by_budget")
    answer = TuneAnswer(task="tune", **{k: record.get(k) for k in keys})
    rows = record.get("rows") or []
    if rows and all(r.get("status") == "does not fit" for r in rows):  # no setup fits: the tune's answer
        answer.status = NONE_FITS
    return answer


SETUP_COLUMNS = ("setup", "status", "how", "batch_size", "grad_accum", "samples_per_s", "predicted_samples_per_s",
                 "tokens_per_s", "mfu",
                 "peak_gb", "headroom_gb", "max_batch_size", "estimated_max_batch", "bound_samples_per_s", "probes",
                 "winner")


def log_to_wandb(exp: Experiment, context: RunContext, run_dir: Path, record: dict, png: Path | None) -> None:
    """The setups as a wandb table, the plot as an image, the winner in the run summary."""
    log_record(exp, context, run_dir, "setups", SETUP_COLUMNS, record["rows"], {"tune": png},
               {k: record[k] for k in ("winner", "command", "batch_size", "samples_per_s", "probes")})
