"""The gate's fp32 reference experts: every expert on every token of a decode step, weighted by the routing, must
compute what transformers' loop over the experts hit computes (here against that loop in float64)."""

import copy
import gc
import weakref

import pytest
import torch

from optiq.models import load_model
from optiq.gate.references.experts import DENSE_TOKENS, experts_forward
from optiq.gate.references import float64
from optiq.gate.references.float64 import float64_path
from optiq.gate.references.fp32 import computing_in

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 parts' products need CUDA")


def _experts(preset: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    model = load_model(preset, dtype, torch.device(device))
    return next(m for m in model.modules() if type(m).__name__.endswith("Experts"))


def _routing(tokens: int, experts: int, k: int, seed: int, device: str):
    """Top-k ids (distinct per token) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    return ids.to(device), weights.to(device)


def _error(experts: torch.nn.Module, tokens: int, seed: int) -> float:
    """The reference forward's relative error against transformers' eager loop over a float64 copy."""
    device = experts.gate_up_proj.device
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(seed))
    hidden = hidden.to(device)
    ids, weights = _routing(tokens, experts.gate_up_proj.shape[0], min(8, experts.gate_up_proj.shape[0] // 2), seed,
                            device)
    exact = copy.deepcopy(experts).double()
    exact.config._experts_implementation = "eager"
    with torch.inference_mode():
        want = exact(hidden.double(), ids, weights.double())
        got = experts_forward(experts)(hidden, ids, weights)
    assert got.dtype == torch.float32 and got.shape == want.shape
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
@pytest.mark.parametrize("tokens", [1, 16, DENSE_TOKENS, DENSE_TOKENS + 1])  # decode steps (all experts at once),
# then a prompt (a loop over the experts hit)
def test_reference_experts_compute_transformers_loop(preset, tokens):
    assert _error(_experts(preset, torch.float32, "cpu"), tokens, seed=tokens) < 1e-6


@pytest.mark.parametrize("tokens", [4, DENSE_TOKENS + 1])
def test_the_id_of_no_expert_adds_nothing(tokens):
    """transformers 5.24 marks a pick of an expert on another rank with id E; such a pick must count for nothing."""
    experts = _experts("tiny-qwen3-moe", torch.float32, "cpu")
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(tokens))
    ids, weights = _routing(tokens, experts.gate_up_proj.shape[0], 4, tokens, "cpu")
    gone = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.25
    with torch.inference_mode():
        got = experts_forward(experts)(hidden, ids.masked_fill(gone, experts.gate_up_proj.shape[0]), weights)
        want = experts_forward(experts)(hidden, ids, weights.masked_fill(gone, 0.0))
    assert gone.any() and torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@cuda
@pytest.mark.parametrize("tokens", [1, 64, DENSE_TOKENS + 3])
def test_reference_experts_from_bf16_parts_at_qwen3_30b_a3b_shapes(tokens):
    """128 experts of 2048 x 768 with bf16 weights: the split products' few millionths (session 6: 2-4.4e-6)."""
    config = load_model("tiny-qwen3-moe", torch.bfloat16, torch.device("cpu")).config
    config.hidden_size, config.moe_intermediate_size, config.num_experts = 2048, 768, 128
    experts = type(_experts("tiny-qwen3-moe", torch.bfloat16, "cpu"))(config).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.02, generator=torch.Generator("cuda").manual_seed(0))
    torch.nn.init.normal_(experts.down_proj, std=0.02, generator=torch.Generator("cuda").manual_seed(1))
    assert _error(experts, tokens, seed=tokens) < 1e-5


@cuda
def test_computing_in_fp32_on_a_gpu_keeps_the_experts_bf16():
    model = load_model("tiny-qwen3-moe", torch.bfloat16, torch.device("cuda"))
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    with computing_in(model, torch.float32):
        assert all("forward" in vars(m) and m.gate_up_proj.dtype == torch.bfloat16 for m in experts)
    assert all("forward" not in vars(m) for m in experts)


@pytest.mark.parametrize("owner", ["experts", "decoder layer"])
@pytest.mark.parametrize("shared", [False, True])
def test_the_float64_copy_of_a_site_is_freed_on_exit_without_a_garbage_collection(owner, shared, monkeypatch):
    """The gate copies each site's module to float64; for a qwen3-30b-a3b layer that is 4.8 GB, so 48 of them kept
    alive by the experts' closures until a collection ran out of memory on the H200 (session 8). Experts past
    SHARED_EXPERTS_BYTES keep their weights (shared, in their dtype) and the rest of the copy is float64."""
    if shared:
        monkeypatch.setattr(float64, "SHARED_EXPERTS_BYTES", 0)
    model = load_model("tiny-qwen3-moe", torch.float32, torch.device("cpu"))
    module = next(m for m in model.modules() if type(m).__name__.endswith("Experts" if owner == "experts" else
                                                                            "DecoderLayer"))
    weights = {id(p) for m in module.modules() if hasattr(m, "gate_up_proj") for p in m.parameters(recurse=False)}
    gc.collect()
    gc.disable()
    try:
        with float64_path(module.forward) as exact:
            copies = [weakref.ref(m) for m in _modules_behind(exact) if m is not module]
            params = [p for c in copies for p in c().parameters(recurse=False)]
            assert copies and (weights <= {id(p) for p in params}) == shared
            assert all(p.dtype == torch.float64 for p in params if id(p) not in weights)
        del exact
        assert all(c() is None for c in copies)
    finally:
        gc.enable()


def _modules_behind(fn) -> list[torch.nn.Module]:
    """The float64 copy and its experts behind a reference callable (a bound method or an experts closure)."""
    owner = getattr(fn, "__self__", None) or next(c.cell_contents for c in fn.__closure__
                                                  if isinstance(c.cell_contents, torch.nn.Module))
    return list(owner.modules())
