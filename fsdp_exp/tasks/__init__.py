"""conf/task/*: what a run does with its ranks (train now; max_batch, export, eval later)."""
