"""A user's own model and data, measured by fsdp_exp without changing fsdp_exp."""
