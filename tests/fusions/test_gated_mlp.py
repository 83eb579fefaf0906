"""gated_mlp against HF's gated MLP in float64: every fused row count, odd hidden and intermediate sizes, bias and
residual, both activations, half dtypes; the partials summed once each in program order, the counters left at zero;
past FUSED_ROWS the two-kernel path.

CPU cases run under the Triton interpreter at small shapes (a single reducer there); CUDA cases use the presets' MLPs,
where several reducers wait for every program."""

import pytest
import torch
import torch.nn.functional as F

from optiq.fusions import gated_mlp as gated_mlp_module
from optiq.fusions.activation import activation_reference
from optiq.fusions.gate_up_swiglu import gate_up_swiglu, interleave_gate_up
from optiq.fusions.gated_mlp import (FUSED_ROWS, MLPS, benchmark_case, gated_mlp, gated_mlp_reference, mlp_counters,
                                     slice_width, tile_config)
from optiq.fusions.linear import linear
from kernel_testing import OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_inputs(seed, rows, hidden, intermediate, dtype, device, bias=False, residual=False):
    """x [rows, H], nn.Linear-scaled gate, up [I, H] and down [H, I] weights, and a bias and residual, never zeros."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return dict(x=draw(rows, hidden), w_gate=draw(intermediate, hidden, scale=hidden**-0.5),
                w_up=draw(intermediate, hidden, scale=hidden**-0.5), w_down=draw(hidden, intermediate,
                                                                                 scale=intermediate**-0.5),
                bias=draw(hidden) if bias else None, residual=draw(rows, hidden, scale=4.0) if residual else None)


def expected(case, activation="silu"):
    """HF's MLP in float64, its activation's output rounded to the model's dtype as HF rounds it, then bias and
    residual."""
    x, dtype = case["x"].double(), case["x"].dtype
    h = F.linear(x, case["w_gate"].double())
    h = (activation_reference(h, activation) * F.linear(x, case["w_up"].double())).to(dtype)
    out = F.linear(h.double(), case["w_down"].double())
    for extra in ("bias", "residual"):
        if case[extra] is not None:
            out = out + case[extra].double()
    return out


def run(case, activation="silu"):
    return gated_mlp(case["x"], interleave_gate_up(case["w_gate"], case["w_up"]), case["w_down"], case["bias"],
                     case["residual"], activation)


def check(case, activation="silu"):
    got = run(case, activation)
    assert got.shape == case["x"].shape and got.dtype == case["x"].dtype
    tolerance = TOLERANCES[case["x"].dtype]
    torch.testing.assert_close(got.double(), expected(case, activation), rtol=tolerance, atol=tolerance)
    return got


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("rows", range(1, FUSED_ROWS + 1))
@pytest.mark.parametrize("hidden, intermediate, bias, residual", [
    (64, 96, False, False),   # three programs of 32 (four SMs here)
    (80, 200, True, True),    # hidden not a multiple of its 128-wide chunks, the last slice cut short
    (160, 64, False, True),   # two output chunks
])
def test_matches_hf_mlp(request, rows, hidden, intermediate, bias, residual):
    check(make_inputs(seed_of(request), rows, hidden, intermediate, torch.float32, SMALL_DEVICE, bias, residual))


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_half_dtypes_and_activations(request, dtype, activation):
    check(make_inputs(seed_of(request), 2, 96, 72, dtype, SMALL_DEVICE, bias=True, residual=True), activation)


def test_partials_are_summed_once_in_program_order(request):
    """The counters are zero after a launch (the next one finds them so), a second launch gives the same bits, and
    the residual and every program's slice are in the sum: a down weight with one slice's columns zeroed moves it."""
    case = make_inputs(seed_of(request), 3, 64, 100, torch.float32, SMALL_DEVICE, residual=True)
    got = check(case)
    assert not mlp_counters(case["x"].device).any()
    assert torch.equal(run(case), got)
    width = slice_width(100, case["x"].device)
    for first in range(0, 100, width):
        cut = dict(case, w_down=case["w_down"].clone())
        cut["w_down"][:, first:first + width] = 0
        assert not torch.allclose(run(cut), got, atol=1e-3)
    assert not torch.allclose(run(dict(case, residual=None)).double(), got.double(), atol=0.5)


def test_past_fused_rows_the_mlp_is_two_kernels(request):
    """FUSED_ROWS + 1 rows: gate_up_swiglu, then the decode GEMM with bias and residual, bit for bit."""
    case = make_inputs(seed_of(request), FUSED_ROWS + 1, 64, 96, torch.float32, SMALL_DEVICE, True, True)
    w_gate_up = interleave_gate_up(case["w_gate"], case["w_up"])
    two = linear(gate_up_swiglu(case["x"], w_gate_up), case["w_down"], case["bias"], case["residual"])
    assert torch.equal(check(case), two)


def test_the_knob_turns_the_fused_kernel_off(request, monkeypatch):
    case = make_inputs(seed_of(request), 1, 64, 96, torch.float32, SMALL_DEVICE, residual=True)
    fused = check(case)
    monkeypatch.setenv("OPTIQ_MLP_FUSED_ROWS", "0")
    two = check(case)
    assert not torch.equal(fused, two)  # another summation order: the knob really chose the other path


def test_slices_keep_every_program_resident(monkeypatch):
    """On 132 SMs: no more programs than SMs (the reducers wait for all of them), each slice as narrow as that
    allows; every configuration's stages fit an SM's shared memory."""
    monkeypatch.setattr(gated_mlp_module, "multiprocessor_count", lambda device: 132)
    widths = {label: slice_width(intermediate, torch.device("cpu")) for label, (_, intermediate) in MLPS.items()}
    assert widths == {"llama-3.2-1b": 64, "qwen3-0.6b": 32, "llama-3.1-8b": 128, "phi-3-mini": 64, "gemma-3-1b": 64}
    for label, (_, intermediate) in MLPS.items():
        config = tile_config(intermediate, torch.device("cpu"))
        assert -(-intermediate // config["BLOCK_S"]) <= 132
        per_stage = ((16 + 2 * config["BLOCK_S"]) * config["BLOCK_K"] + config["BLOCK_S"] * 128) * 2
        assert config["num_stages"] * per_stage <= 227 * 1024, label


def test_wrong_shapes_are_refused():
    case = make_inputs(1, 2, 64, 96, torch.float32, "cpu")
    w_gate_up = interleave_gate_up(case["w_gate"], case["w_up"])
    with pytest.raises(ValueError):
        gated_mlp(case["x"], w_gate_up[:, :32], case["w_down"])
    with pytest.raises(ValueError):
        gated_mlp(case["x"], w_gate_up, case["w_down"][:, :48])
    with pytest.raises(ValueError):
        gated_mlp(case["x"], w_gate_up, case["w_down"], residual=case["x"][:1])


def test_custom_op_registration(request):
    case = make_inputs(seed_of(request), 2, 64, 96, torch.float32, SMALL_DEVICE, bias=True, residual=True)
    torch.library.opcheck(torch.ops.optiq.gated_mlp.default,
                          (case["x"], interleave_gate_up(case["w_gate"], case["w_up"]), case["w_down"],
                           mlp_counters(case["x"].device), case["bias"], case["residual"], 0), **OPCHECKS)


@needs_cuda
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("preset", MLPS)
@pytest.mark.parametrize("rows", [1, 2, FUSED_ROWS, FUSED_ROWS + 1])
def test_preset_mlps_cuda(preset, rows):
    """At the presets' shapes, several reducers each waiting for every program."""
    hidden, intermediate = MLPS[preset]
    check(make_inputs(rows + hidden, rows, hidden, intermediate, torch.bfloat16, "cuda", residual=True))
    assert not mlp_counters(torch.device("cuda")).any()


@needs_cuda
def test_cuda_graph_and_compile_cuda():
    case = make_inputs(7, 1, 2048, 8192, torch.bfloat16, "cuda", bias=True, residual=True)
    assert_graph_replay_and_compile(lambda: run(case), lambda: case["x"].copy_(torch.randn_like(case["x"])))


@needs_cuda
def test_benchmark_cases_cuda():
    for case in benchmark_case(1, torch.bfloat16, "cuda").values():
        torch.testing.assert_close(case["fused"](), case["eager"](), rtol=2e-2, atol=2e-2)
