"""Model architectures (Llama 2/3, Mistral, Qwen2, Qwen3) assembled from engine.layers."""
