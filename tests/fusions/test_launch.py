"""Programmatic dependent launch: where it is on, and that a decoder layer's chain of PDL kernels, replayed in a CUDA
graph, computes bit for bit what the same kernels compute launched without it. In the chain each kernel reads what
the one before wrote and one overwrites what the one before is reading, so a kernel that touched memory before its
predecessor had finished would show."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from optiq.fusions.add_rmsnorm import add_rmsnorm
from optiq.fusions.gate_up_swiglu import gate_up_swiglu, interleave_gate_up
from optiq.fusions.launch import PREFETCH_KB, enabled, launch_options, prefetch_options
from optiq.fusions.linear import linear
from optiq.fusions.rmsnorm import rmsnorm
from kernel_testing import CUDA, needs_cuda

HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


def test_off_on_the_cpu():
    assert launch_options(torch.ones(2)) == {"USE_PDL": False}


def test_off_for_the_tensors_torch_compile_traces_with():
    with FakeTensorMode() as fake:
        assert not enabled(fake.from_tensor(torch.ones(2)))


def test_prefetch_asks_for_a_power_of_two_of_lines_within_its_budget(monkeypatch):
    """A program of 32 bf16 rows asks for PREFETCH_KB of their starts; of 48 rows the power of two under its share;
    never past a row's end; nothing without PDL (the interpreter has no prefetch) or with the knob at 0."""
    on, off = {"USE_PDL": True}, {"USE_PDL": False}
    lines = prefetch_options(on, 32, 8192, 2)["PREFETCH_LINES"]
    assert lines * 32 * 128 == PREFETCH_KB * 1024 and prefetch_options(on, 32, 8192, 2)["LINE"] == 64
    assert prefetch_options(on, 48, 8192, 2)["PREFETCH_LINES"] == lines // 2
    assert prefetch_options(on, 32, 200, 2)["PREFETCH_LINES"] == 4  # a 200-column row is four 64-column lines
    assert prefetch_options(off, 32, 8192, 2)["PREFETCH_LINES"] == 0
    monkeypatch.setenv("OPTIQ_PREFETCH_KB", "0")
    assert prefetch_options(on, 32, 8192, 2)["PREFETCH_LINES"] == 0


@needs_cuda
def test_on_from_hopper_unless_turned_off(monkeypatch):
    cuda = torch.ones(2, device="cuda")
    assert enabled(cuda) == HOPPER
    monkeypatch.setenv("OPTIQ_PDL", "0")
    assert not enabled(cuda) and launch_options(cuda) == {"USE_PDL": False}


def _layer(hidden, scratch, weights):
    """norm -> GEMM -> norm written over the GEMM's input -> gate/up -> down GEMM -> residual norm into ``hidden``."""
    w_norm, w_proj, w_gate_up, w_down = weights
    normed = rmsnorm(hidden, w_norm, 1e-5, out=scratch)
    projected = linear(normed, w_proj)
    rmsnorm(projected, w_norm, 1e-5, out=scratch)  # overwrites what the GEMM before it reads
    down = linear(gate_up_swiglu(scratch, w_gate_up), w_down)
    add_rmsnorm(down, hidden.clone(), w_norm, 1e-5, normed=hidden)


@needs_cuda
@pytest.mark.skipif(not HOPPER, reason="PDL needs Hopper or later")
def test_a_layer_chain_replays_as_without_pdl(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(7)
    size, inter, replays = 1024, 2816, 8

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * scale

    weights = (1.0 + 0.1 * randn(size), randn(size, size, scale=size**-0.5),
               interleave_gate_up(randn(inter, size, scale=size**-0.5), randn(inter, size, scale=size**-0.5)),
               randn(size, inter, scale=inter**-0.5))
    start = randn(1, size)

    monkeypatch.setenv("OPTIQ_PDL", "0")
    want, scratch = start.clone(), torch.empty_like(start)
    for _ in range(replays):
        _layer(want, scratch, weights)

    monkeypatch.setenv("OPTIQ_PDL", "1")
    hidden, scratch = start.clone(), torch.empty_like(start)
    _layer(hidden, scratch, weights)  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _layer(hidden, scratch, weights)
    hidden.copy_(start)
    for _ in range(replays):
        graph.replay()
    torch.testing.assert_close(hidden, want, rtol=0, atol=0)
    assert not torch.equal(hidden, start)
