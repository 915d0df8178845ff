"""Where each run's figures go as it trains: metrics.jsonl and the console (wandb:
fsdp_exp.metrics.wandb_sink; summary.json: fsdp_exp.metrics.summary)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_exp.metrics.summary import PEAK_GB

log = logging.getLogger("fsdp_exp")


METRICS = "metrics.jsonl"  # a run directory's records, one a logged step, written by rank 0


class JsonLines:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open until close()

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()

    @staticmethod
    def read(path: Path) -> list[dict]:
        """The records a run wrote (none where there is no file); a line cut short (a run
        killed while writing) says nothing and is skipped."""
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def figures_so_far(records: list[dict], warmup_steps: int = 0) -> dict:
    """What the logged steps of a run that did not finish say: the last loss, the speed over
    the windows past the warm-up (or over all, when every one was warm-up), the largest peak.
    A window never straddles the warm-up (`warmup_steps`): the first past it starts there."""
    steps = [r for r in records if "step" in r and r.get("samples_per_s")]
    if not steps:
        return {}
    spans, last = [], 0  # (the steps of each record's window, the record)
    for r in steps:
        spans.append((r["step"] - (last if r.get("warmup") else max(last, warmup_steps)), r))
        last = r["step"]
    timed = [(n, r) for n, r in spans if not r.get("warmup") and r.get("steps_per_s")] or \
        [(n, r) for n, r in spans if r.get("steps_per_s")]
    figures = {"final_loss": steps[-1].get("loss")}
    if timed:  # samples over seconds, each window's from its steps at its speed
        figures["samples_per_s"] = sum(n * r["samples_per_s"] / r["steps_per_s"] for n, r in timed) / \
            sum(n / r["steps_per_s"] for n, r in timed)
    peaks = [r[PEAK_GB] for r in steps if r.get(PEAK_GB) is not None]
    if peaks:
        figures[PEAK_GB] = max(peaks)
    return figures


def record_line(record: dict, total_steps: int) -> str:
    return f"step {record['step']:>{len(str(total_steps))}}/{total_steps}  {record_figures(record)}"


def record_figures(record: dict) -> str:
    parts = [f"loss {record['loss']:.4f}"]
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    parts.append(f"{record['samples_per_s']:,.1f} samples/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu']:.1%}")
    elif "tflops_per_device" in record:
        parts.append(f"{record['tflops_per_device']:.3f} TFLOP/s")
    parts.append(f"peak {record['peak_mem_gb']:.2f} GB")
    if record.get("warmup"):  # its throughput is not the run's: no average counts it
        parts.append("(warm-up)")
    return "  ".join(parts)


def duration(seconds: float) -> str:
    """A time span as a person reads it: 45 s, 3 min 20 s, 1 h 05 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _is_sized_terminal() -> bool:
    """A terminal wide enough to draw a bar (a pty with no size reports 0 columns)."""
    try:
        return sys.stdout.isatty() and os.get_terminal_size(sys.stdout.fileno()).columns > 0
    except (OSError, ValueError):
        return False


class Progress:
    """Rank 0's console: a live bar on a terminal, a plain line per record otherwise. Both
    say how long is left once a step after the first has been timed.

    `clock`: seconds, for the step times (a test gives its own)."""

    LONG_S = 60  # without a bar, a run with more left than this says so as soon as it knows

    def __init__(self, total_steps: int, live: bool | None = None, done: int = 0,
                 clock: Callable[[], float] = time.perf_counter):
        self.total_steps = total_steps
        self.step = done
        self.clock = clock
        self.step_times: list[float] = []  # this attempt's, each from the end of the step before
        self.last_end: float | None = None
        self.shown: str = ""  # the last record's figures, on the bar
        self.told_time_left = False
        self.bar: Any = None
        if _is_sized_terminal() if live is None else live:
            from tqdm import tqdm

            # tqdm's own estimate of the time left is left out: it counts the first step,
            # which also counts FLOPs (and compiles), so it would say two different things.
            self.bar = tqdm(total=total_steps, initial=done, unit="step", dynamic_ncols=True, file=sys.stdout,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def step_time_s(self) -> float | None:
        """The mean time of this attempt's steps after its first; None until one is timed.
        The first step is left out: it also counts the FLOPs, touches all its memory for the
        first time, and a compiled model compiles in it."""
        timed = self.step_times[1:]
        return sum(timed) / len(timed) if timed else None

    def time_left_s(self) -> float | None:
        step_time = self.step_time_s()
        return None if step_time is None else step_time * (self.total_steps - self.step)

    def left(self) -> str:
        """`"3 min 20 s left"`, or nothing when not known yet or no step is left."""
        left = self.time_left_s()
        return f"{duration(left)} left" if left and self.step < self.total_steps else ""

    def before_step(self, step: int) -> None:
        if self.last_end is None:
            self.last_end = self.clock()

    def after_step(self, step: int) -> None:
        now = self.clock()
        if self.last_end is not None:
            self.step_times.append(now - self.last_end)
        self.last_end, self.step = now, step
        if self.bar is not None:
            self.bar.update(1)
            self._show()
        elif not self.told_time_left and (self.time_left_s() or 0) > self.LONG_S:
            self.told_time_left = True  # records may be many minutes apart (train.log_every)
            log.info("step %d/%d: %s a step, %s", step, self.total_steps, duration(self.step_time_s()), self.left())

    def log(self, record: dict) -> None:
        line = record_line(record, self.total_steps)
        if self.bar is not None:
            self.shown = record_figures(record)  # the bar shows the step
            self._show()
            logging.getLogger("fsdp_exp.rank_file").info(line)
        else:
            left = self.left()
            log.info(f"{line}  {left}" if left else line)

    def _show(self) -> None:
        self.bar.set_postfix_str(", ".join(part for part in (self.left(), self.shown) if part), refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
