"""Hand-written kernels for the places where XLA's code is the bottleneck (see cpu_matmul)."""
