"""fsdp_exp's sweeper for `python -m fsdp_exp -m ...` (hydra/sweeper=fsdp_exp, conf/config.yaml)."""
