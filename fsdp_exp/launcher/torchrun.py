"""launcher=torchrun: one run across several machines, with torchrun's c10d rendezvous.

Every node runs the same command, for example on two nodes:

    python -m fsdp_exp launcher=torchrun launcher.nnodes=2 launcher.rdzv_endpoint=node0:29400

Each node's command starts its `nproc_per_node` ranks with torch's elastic agent (the
machinery behind torchrun), and the agents meet at `rdzv_endpoint`. The rank that
rendezvous makes rank 0 writes the run's metrics.jsonl and checkpoints (into its node's
run directory, shared with the other ranks at start); every node's command writes its
ranks' logs and a summary.json of the same figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.rendezvous.api import RendezvousError

from fsdp_exp.errors import ConfigError, one_line
from fsdp_exp.launcher.core import RunFailed
from fsdp_exp.launcher.local import LocalLauncher, elastic_run

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment


def parse_nnodes(nnodes: Any) -> tuple[int, int]:
    """`2` -> (2, 2); `"1:4"` -> (1, 4): elastic, any node count in that range."""
    text = str(nnodes)
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"launcher.nnodes={nnodes}: a node count, or min:max (e.g. 2 or 1:4)")
    return bounds


@dataclass
class TorchrunLauncher(LocalLauncher):
    nnodes: Any = 1  # the number of machines, or min:max for an elastic run
    rdzv_endpoint: str = "localhost:29400"  # host:port of one of the nodes, reachable from all
    rdzv_id: str = "fsdp_exp"  # the same on every node of a run, different between runs
    rdzv_timeout: int = 300  # seconds to wait for the nodes to meet before a clear error

    def __post_init__(self) -> None:
        super().__post_init__()
        self.min_nodes, self.max_nodes = parse_nnodes(self.nnodes)
        if self.rdzv_timeout < 1:
            raise ConfigError(f"launcher.rdzv_timeout={self.rdzv_timeout}: must be at least 1 (seconds)")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"launcher.rdzv_endpoint={self.rdzv_endpoint}: must be host:port")

    @property
    def starts_all_ranks(self) -> bool:  # type: ignore[override]
        """Each node's command starts its own ranks: only a one-node run is all here."""
        return self.max_nodes == 1

    def world_size(self, gpus: int) -> int:
        """The world size when every node has joined."""
        return self.per_node(gpus) * self.max_nodes

    def per_node(self, gpus: int) -> int:
        return super().world_size(gpus)

    def ranks_per_node(self, world: int) -> int:
        return max(1, world // self.max_nodes)

    def launch(self, task: Callable[[Experiment, Path], Any], cfg: Experiment, run_dir: Path, nproc: int,
               time_limit_s: float | None = None) -> Any:
        """This node's ranks; the figures every rank returns (the same on every rank)."""
        per_node = self.per_node(torch.cuda.device_count() if cfg.device == "cuda" else 0)
        options = dict(min_nodes=self.min_nodes, max_nodes=self.max_nodes, nproc_per_node=per_node,
                       run_id=self.rdzv_id, rdzv_endpoint=self.rdzv_endpoint,
                       rdzv_configs={"join_timeout": self.rdzv_timeout, "timeout": self.rdzv_timeout},
                       max_restarts=self.max_restarts, start_method=self.start_method)
        try:
            results = elastic_run(task, cfg, run_dir, options, time_limit_s)
        except RendezvousError as err:
            raise RunFailed(
                f"launcher.rdzv_endpoint={self.rdzv_endpoint}: no rendezvous of launcher.nnodes={self.nnodes} "
                f"within launcher.rdzv_timeout={self.rdzv_timeout} s ({one_line(err)})") from None
        return results[min(results)]
