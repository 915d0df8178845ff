"""conf/launcher/*: how the ranks of one run start, on the driver. The trainer is the same
under each, and every rank begins in `fsdp_exp.rank.worker.run_rank`.

The folder is named for what it does (launch ranks) rather than for the group, since it
holds more than the options: `core`, what every launcher shares (the questions the driver
asks a launcher, the rank count, the rank outcome and the one explanation of a failed
launch, the console echo and the watchdog), and `rank_server`, the process forked ranks
come from. `local`, `torchrun`, `slurm`, `ray`: one option each, which starts ranks its own
way and turns its native results into rank outcomes. `external`: a run under a torchrun
the user started.
"""
