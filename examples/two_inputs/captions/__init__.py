"""A toy image-and-caption model trained contrastively: plain PyTorch, no fsdp_exp import."""
