"""Triton kernels, one file per fusion: kernel, host wrapper, pure-torch reference. Knows nothing of models."""
