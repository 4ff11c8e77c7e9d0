"""One rank's model runner: step inputs, the KV cache and its swap copies, CUDA graphs, the
sampler and the attention backends."""
