"""task=max_batch, one idea across these modules:

- task.py      the task: its checks, and its run, which is the search
- settings.py  max_batch.*: how the search searches (apart, so the config's schema holds
               them without importing the search)
- search.py    the driver's search (MaxBatchSearch): probes, the record, the answer
- record.py    max_batch.json, the search's record (MaxBatchRecord), written and read
- policy.py    where to probe next (BatchSearch), from the outcomes so far
- probe.py     one probe: the run's config trimmed to a few steps at one batch size, on fresh ranks
- prior.py     the estimate's curve (task=estimate), which places the first probes
- verify.py    runs of the command at the answer, as the user will run it
- answer.py    the answer from the probes: noise band, margin, the batch to use
- report.py    the answer told: its line, the plot (plot.py), wandb, the summary's figures
"""
