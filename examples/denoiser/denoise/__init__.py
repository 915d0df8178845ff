"""A small DiT-like denoiser, trained with fsdp_exp's loss=mse."""
