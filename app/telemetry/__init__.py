"""What a run tells people: TensorBoard and the console.

tags.py       the vocabulary: every scalar and text tag, each scalar with its unit in its name
layout.py     the Custom Scalars layout every run writes: AMP health, Learning, Speed, Memory
writer.py     the TensorBoard writer of the main process, and the null writer of the other ranks
meters.py     the meters the loop feeds every step (on the device), read to the host only at log steps
flops.py      training FLOPs per token and the GPUs' peak FLOP/s, for MFU
footprint.py  the memory of weights, gradients and optimizer state, estimated before any weight loads
report.py     the set-up as TensorBoard text at start; the HPARAMS row and the summary table at the end
console.py    the libraries' routine notices (load report, tied weights at save) kept off the console unless --verbose
"""
