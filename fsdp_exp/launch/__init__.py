"""conf/launcher/*: how the ranks of one run start. The trainer is the same under each.

- `core`: what every launcher shares, on the driver: the questions the driver asks a
  launcher (`Launcher`), the rank count, the rank outcome and the one explanation of a
  failed launch (`explain` -> `RunFailed`), the console echo and the watchdog.
- `worker`: what every rank runs first (`run_rank`), the variables a rank reads, and the
  one way it knows that it was restarted.
- `local`, `torchrun`, `slurm`, `ray`: each starts ranks its own way and turns its native
  results into rank outcomes. `external`: a run under a torchrun the user started.
"""
