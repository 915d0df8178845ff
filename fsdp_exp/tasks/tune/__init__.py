"""task=tune, one idea in six modules:

- task.py      the task: its checks, and its run, which is the tune
- settings.py  task.*: the space of setups, the budget, and each setup's search settings
- space.py     the setups: every combination of task.space's options, as command-line overrides
- tuner.py     the driver: compose each setup, prune by the estimate, probe, search those that can win
- ranking.py   what the measurements say: bounds, whether a setup can still win, the ranked table
- report.py    tune.json, tune.md, tune.png, wandb and the answer line
"""
