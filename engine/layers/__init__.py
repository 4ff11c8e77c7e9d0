"""Building blocks of the models: tensor-parallel linear layers, vocab-parallel embedding,
RMSNorm, RoPE, SwiGLU and the attention layer over the paged cache."""
