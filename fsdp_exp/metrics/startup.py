"""Where a run's start-up goes: the time (Unix time) at which each part of it ended, from
the command to the first training step.

The driver marks its part (`command`: the process started; `imported`; `composed`: the
run composed and checked; `launched`: the ranks asked for) in the experiment it hands to
the ranks; each rank adds its own (`rank_started`: its process started, forked or spawned;
`rank_ready`: it runs the task; `process_group`; `built`: the model sharded, the data and
optimizer made; `ready`: the sinks made, the checkpoint restored), and rank 0's marks are
the summary's `startup`. The first step, whose first micro-batch also counts the FLOPs,
ends at the `time` of its record in metrics.jsonl. `bench/startup.py` turns them into
durations.
"""

from __future__ import annotations


MARKS = ("command", "imported", "composed", "launched", "rank_started", "rank_ready", "process_group", "built",
         "ready")


def in_order(marks: dict[str, float]) -> dict[str, float]:
    """The marks set, in the order of the start-up."""
    return {name: marks[name] for name in MARKS if marks.get(name) is not None}
