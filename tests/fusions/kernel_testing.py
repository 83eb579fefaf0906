"""What every kernel test shares: whether a GPU is here, and where the small odd-shape cases run (on the GPU when
there is one, else on the CPU under the Triton interpreter)."""

import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
SMALL_DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def seed_of(request) -> int:
    """A seed of the test's own (its node name), so every case draws different inputs, reproducibly."""
    return zlib.crc32(request.node.name.encode())
