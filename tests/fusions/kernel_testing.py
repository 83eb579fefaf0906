"""What every kernel test shares: whether a GPU is here, and where the small odd-shape cases run (on the GPU when
there is one, else on the CPU under the Triton interpreter)."""

import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
SMALL_DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# (offset, weight_first) of a norm kernel: where the weight applies and where the result is rounded, as HF's norms do
NORM_KINDS = pytest.mark.parametrize("offset, weight_first", [(False, False), (True, False), (False, True)],
                                     ids=["llama", "gemma", "olmo2"])
# torch.library.opcheck's checks that can run here: the interpreter cannot run under fake tensors (torch's wrap_triton
# launches an interpreted kernel directly), so the fake-tensor and AOT checks run on CUDA only.
OPCHECKS = {} if CUDA else {"test_utils": ("test_schema", "test_autograd_registration")}


def seed_of(request) -> int:
    """A seed of the test's own (its node name), so every case draws different inputs, reproducibly."""
    return zlib.crc32(request.node.name.encode())


def assert_identical(got, want):
    """Bit for bit, tensors or sequences of them."""
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def assert_graph_replay_and_compile(run, refill, expect=None, same=assert_identical, compile=True,
                                    same_compiled=None):
    """The op keeps nothing on the host, so a serving engine can capture it and torch.compile can trace it.

    ``run()`` calls the op on fixed input tensors. Under torch.compile(fullgraph=True) it must give what eager gives;
    captured into a CUDA graph and replayed after ``refill()`` wrote new values into those inputs, it must give what
    ``expect()`` (default: eager ``run()``) gives on them. ``same(got, want)`` asserts a match (``same_compiled``, if
    given, for the compiled run: an op that calls cuBLAS may get another of its GEMM algorithms under inductor)."""
    expected = run()  # also compiles the Triton kernels, outside the capture
    if compile:
        (same_compiled or same)(torch.compile(run, fullgraph=True)(), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    refill()
    want = (expect or run)()
    graph.replay()
    same(captured, want)
