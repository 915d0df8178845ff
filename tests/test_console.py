"""What a user sees on the console of a real run: the run's own lines, not every probe's
or torch's; those stay in the rank logs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import REPO, SMALL_VIT, read_json, run_cli


class LateChannelsLast(nn.Module):
    """A conv net that turns its weights channels-last in its first forward, as code tuned
    for GPUs does. DDP, built before, then finds gradients laid out unlike its buckets, and
    torch warns "Grad strides do not match bucket view strides" from its own code."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 4, stride=4)
        self.head = nn.Linear(8 * 7 * 7, num_classes)
        self.converted = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.converted:
            self.conv.to(memory_format=torch.channels_last)
            self.converted = True
        return self.head(torch.relu(self.conv(images)).flatten(1))


@pytest.mark.slow
def test_a_search_shows_its_fsdp_units_once_and_each_probe_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "search"
    result = run_cli("task=max_batch", "memory.limit_gb=0.6", *SMALL_VIT, "task.search_up_to=8",
                     "task.estimate=false", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    probes = read_json(run_dir / "max_batch.json")["probes"]
    assert len(probes) >= 2
    console = result.stdout.splitlines()
    assert len([line for line in console if "FSDP units:" in line]) == 1
    assert len([line for line in console if "] probe " in line]) == len(probes)
    assert not [line for line in console if "[rank0]" in line]  # a probe's own lines are in its log
    for probe in probes:
        log = (run_dir / probe["dir"] / "rank0.log").read_text()
        settled = re.search(r"the peak settled at step (\d+): ", log)
        # a probe of task.probe_steps (20); the one at the expected answer runs as the command would
        assert "FSDP units:" in log and settled and re.search(rf"step +{settled[1]}/\d+ ", log)
        assert int(settled[1]) == probe["steps"] >= 5


@pytest.mark.slow
def test_torch_warnings_stay_in_the_rank_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli("model=custom", f"model._target_={__name__}.LateChannelsLast", "sharding=ddp", "train.steps=2",
                     "wandb.mode=disabled", f"hydra.run.dir={run_dir}", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Grad strides" not in result.stdout + result.stderr
    assert "torch warned: " in (run_dir / "rank0.log").read_text()
    assert "Grad strides do not match bucket view strides" in (run_dir / "rank0.log").read_text()


def test_a_long_list_of_fsdp_units_is_summarised_with_where_the_full_list_is() -> None:
    from fsdp_exp.sharding.wrap import units_line

    gpt2 = [{"module": f"blocks.{i}", "params": 7_087_872} for i in range(12)] + [{"module": "(root)",
                                                                                  "params": 39_383_808}]
    assert units_line(gpt2, Path("run/rank0.log")) == (
        "FSDP units: 13 (blocks.0-11 of 7.1M params each, (root) 39.4M); full list in run/rank0.log")
    short = [{"module": "encoder.layers.encoder_layer_0", "params": 99_584}, {"module": "(root)", "params": 10_250}]
    assert units_line(short, Path("run/rank0.log")) == "FSDP units: encoder.layers.encoder_layer_0 (99,584), (root) (10,250)"
