"""How fast a run trains, from its windows' times and counts: samples/s, tokens/s (the tokens
the loss sees, with the padded count beside), TFLOP/s, MFU and HFU, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_exp import distributed
from fsdp_exp.batch import Batch


@dataclass
class Totals:
    """Steps and what they took: the time, the host's wait for data, and for token data whose
    padding the batches show, the tokens the loss saw and their positions (padding included),
    summed over the ranks."""

    steps: int = 0
    time_s: float = 0.0
    host_data_wait_s: float = 0.0
    tokens: float = 0.0
    positions: float = 0.0

    def add(self, other: Totals) -> None:
        self.steps += other.steps
        self.time_s += other.time_s
        self.host_data_wait_s += other.host_data_wait_s
        self.tokens += other.tokens
        self.positions += other.positions


@dataclass
class Throughput:
    """The throughput figures of `global_batch` samples a step. `tokens_per_sample` > 0: token
    data (tokens/s). `flops_per_step`: this rank's model FLOPs per optimizer step (MFU, with
    `peak_tflops`); `hardware_flops_per_step`: what ran, with the forward activation
    checkpointing recomputes (HFU). `ignore_index`: a target that is padding (the loss's)."""

    global_batch: int
    tokens_per_sample: int = 0
    peak_tflops: float | None = None
    flops_per_step: int = 0
    hardware_flops_per_step: int = 0
    ignore_index: int = -100

    def __post_init__(self) -> None:
        self._tokens: list[torch.Tensor] = []  # this window's micro-batches: the tokens the loss saw (on the device)
        self._positions = 0  # and their token positions, padding included

    def count(self, batch: Batch) -> None:
        """A micro-batch's tokens, for token data; read at the window's end (reading waits for a GPU)."""
        if not self.tokens_per_sample:
            return
        seen = batch.tokens(self.ignore_index)
        if seen is not None:
            self._tokens.append(seen)
            self._positions += batch.positions()

    def window(self, steps: int, time_s: float, host_data_wait_s: float, device: torch.device) -> Totals:
        """The window's totals; its tokens summed over the ranks (ranks may pad their batches
        differently). Collective when the batches show their padding: every rank calls it."""
        tokens = positions = 0.0
        if self._tokens:
            tokens, positions = distributed.total([sum(self._tokens), self._positions], device)
            self._tokens, self._positions = [], 0
        return Totals(steps, time_s, host_data_wait_s, tokens, positions)

    def means(self, t: Totals) -> dict:
        """The figures over `t.steps` steps that took `t.time_s`."""
        means = {
            "samples_per_s": self.global_batch * t.steps / t.time_s,
            "steps_per_s": t.steps / t.time_s,
            "step_time_s": t.time_s / t.steps,
            "host_data_wait_share": t.host_data_wait_s / t.time_s,
        }
        seen = 1.0  # the share of the token positions the loss sees
        if t.positions:  # token data whose padding the batches show
            seen = t.tokens / t.positions
            means |= {"tokens_per_s": t.tokens / t.time_s, "padded_tokens_per_s": t.positions / t.time_s,
                      "padding_share": 1 - seen}
        elif self.tokens_per_sample:
            means["tokens_per_s"] = means["samples_per_s"] * self.tokens_per_sample
        if self.flops_per_step:  # the model FLOPs of the tokens the loss sees; HFU counts every one
            means["tflops_per_device"] = self.flops_per_step * seen * t.steps / t.time_s / 1e12
            means["mfu"] = means["tflops_per_device"] / self.peak_tflops if self.peak_tflops else None
        if self.hardware_flops_per_step:
            hardware_tflops = self.hardware_flops_per_step * t.steps / t.time_s / 1e12
            means["hfu"] = hardware_tflops / self.peak_tflops if self.peak_tflops else None
        return means
