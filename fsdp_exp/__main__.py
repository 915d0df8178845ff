"""`python -m fsdp_exp`: fsdp_exp.commands.experiment, started as `fsdp-exp` starts it."""

from fsdp_exp.commands import experiment

if __name__ == "__main__":
    experiment()
