"""What a run measures (memory, FLOPs, the environment) and where the figures go (sinks)."""
