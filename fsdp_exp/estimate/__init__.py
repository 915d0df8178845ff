"""The estimate of a setup's memory, without a run: `predict` traces one rank's training
steps on fake tensors (`trace`, in a process of its own) and reads its peaks (`traced`);
`breakdown` says what each peak is made of on a CPU or a GPU (`allocator`: the CUDA
caching allocator's sizes); `curve` is the peak as a curve over the batch size.
task=estimate prints it; task=max_batch places its probes by it."""
