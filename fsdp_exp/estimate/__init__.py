"""task=estimate's engine: one rank's training steps traced on fake tensors (`trace`), and
what the peak is made of, on a CPU or a GPU (`breakdown`)."""
