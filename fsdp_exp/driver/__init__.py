"""The driver: what runs once per run, on the machine you typed on.

`fsdp_exp.commands.experiment` composes and checks every run of the command (`plan.prepare`: the checks
that span groups), then hands each planned run to `run.run_experiment`, which runs its
task's driver side (`fsdp_exp.tasks`: one launch for task=train, a search of launches for
task=max_batch), has the launcher (`fsdp_exp.launcher`) start the ranks, and writes
summary.json. `outcomes` gathers the runs' outcomes for the exit code, and runs a sweep's
runs side by side on a cluster launcher (`sweep`).
"""
