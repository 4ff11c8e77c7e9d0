"""Kernel tests run compiled on a CUDA GPU, else on the CPU through the Triton interpreter."""

import os

import torch

# NOTE: must happen before triton is imported anywhere, or kernels compile for a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
