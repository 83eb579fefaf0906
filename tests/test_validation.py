"""The validation gate passes the built-in recipes and rejects wrong kernels, rolling back only the failing recipe."""

import copy

import pytest
import torch

from optiq.models import load_model
from optiq.patching import apply, unpatch
from optiq.recipes import load_catalog
from optiq.validation import _decode, validate
from wrong_kernels import user_recipe

FAST = {"concurrencies": (1, 2), "steps": 3, "prompt_len": 5}


def test_builtin_recipes_pass(tiny_model):
    catalog = load_catalog()
    patches = apply(tiny_model, [r for name, r in catalog.items() if name != "gate_up_swiglu"])
    try:
        report = validate(patches, **FAST)
        assert report.passed, report
        assert all(r.passed and r.calls > 0 for r in report.recipes.values())
        assert all(e.top1 == 1.0 and e.rel_err <= e.bound for e in report.end_to_end)
        assert report.recipes["rmsnorm"].err_fused > 0 and report.recipes["greedy_sample"].err_fused == 0
    finally:
        unpatch(tiny_model)


def test_default_path_decodes_64_steps():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()["rmsnorm"]])
    report = validate(patches, concurrencies=(1,))
    assert report.passed and [e.steps for e in report.end_to_end] == [64]
    assert "rmsnorm" in patches.applied


@pytest.mark.parametrize("base, fusion, why", [
    ("rmsnorm", "wrong_kernels:norm_without_eps", "error"),
    ("rmsnorm", "wrong_kernels:stale_rmsnorm", "on its second run"),
    ("rope", "wrong_kernels:rope_wrong_way", "error"),
    ("decode_attention", "wrong_kernels:attention_drops_last", "error"),
    ("rmsnorm", "wrong_kernels:raising_norm", "raised RuntimeError: out of shared memory"),
])
def test_wrong_kernels_are_rolled_back_and_others_stay(tmp_path, base, fusion, why):
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    wrong = user_recipe(tmp_path, base, "wrong", fusion=fusion)
    patches = apply(model, [wrong, load_catalog()["greedy_sample"]])
    report = validate(patches, **FAST)
    result = report.recipes["wrong"]
    assert not result.passed and why in result.reason, result
    assert report.rolled_back == ["wrong"] and list(patches.applied) == ["greedy_sample"]
    assert report.recipes["greedy_sample"].passed and all(e.passed for e in report.end_to_end)
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_computing_in_fp32_equals_an_fp32_copy_and_restores_the_weights(preset):
    model = load_model(preset, torch.bfloat16, torch.device("cpu"))
    stored = [(p, p.data_ptr()) for p in model.parameters()]
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, want_picks = _decode(copy.deepcopy(model).float(), prompt, 4, None, [], [])
        got, got_picks = _decode(model, prompt, 4, None, [], [], dtype=torch.float32)
    assert torch.equal(got, want) and torch.equal(got_picks, want_picks)
    assert all(p is q and p.data_ptr() == address and p.dtype == torch.bfloat16
               for (p, address), q in zip(stored, model.parameters()))


def test_bf16_model_is_gated_against_itself_computing_in_fp32():
    model = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    patches = apply(model, [load_catalog()["rmsnorm"]])
    report = validate(patches, concurrencies=(1,), steps=3, prompt_len=5)
    assert report.passed, report
    (check,) = report.end_to_end
    assert 0 < check.rel_err_unpatched < 0.05 and check.rel_err <= check.bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph mode needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_graph_mode_gate_checks_the_captured_patched_model(preset):
    model = load_model(preset, torch.bfloat16, torch.device("cuda"))
    patches = apply(model, [r for name, r in load_catalog().items() if name != "swiglu"])
    report = validate(patches, concurrencies=(1, 16), steps=8, prompt_len=5, mode="graph")
    assert report.passed, report
    assert not report.rolled_back and all(e.top1 >= e.min_top1 for e in report.end_to_end)


@pytest.mark.parametrize("preset, base, fusion", [
    ("tiny-qwen3-moe", "moe_experts", "wrong_kernels:experts_first_choice_only"),
    ("tiny-deepseek-v2", "moe_experts", "wrong_kernels:experts_first_choice_only"),
    ("tiny-deepseek-v2", "mla_decode", "wrong_kernels:mla_drops_last"),
    ("tiny-qwen3-moe", "moe_router", "wrong_kernels:router_drops_last_expert"),
    ("tiny-deepseek-v2", "moe_router", "wrong_kernels:router_drops_last_expert"),
])
def test_moe_and_mla_recipes_pass_and_their_wrong_kernels_are_rolled_back(tmp_path, preset, base, fusion):
    model = load_model(preset, torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()[base]])
    report = validate(patches, **FAST)
    assert report.passed and report.recipes[base].calls > 0, report
    unpatch(model)
    patches = apply(model, [user_recipe(tmp_path, base, "wrong", fusion=fusion)])
    report = validate(patches, **FAST)
    assert report.rolled_back == ["wrong"] and "error" in report.recipes["wrong"].reason, report
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_whole_catalog_passes_on_the_mla_moe_preset():
    """Every recipe that applies to DeepSeek-V2 at once: norms, MLA decode, router, experts, sampling (the router's
    lossy rival precision_flip has its own test)."""
    model = load_model("tiny-deepseek-v2", torch.float32, torch.device("cpu"))
    patches = apply(model, [r for r in load_catalog().values()
                            if r.applies_to("deepseek_v2") and r.name != "precision_flip"])
    assert set(patches.applied) == {"rmsnorm", "add_rmsnorm", "mla_decode", "moe_router", "moe_experts",
                                    "greedy_sample"}
    report = validate(patches, **FAST)
    assert report.passed and not report.rolled_back, report
    unpatch(model)


@pytest.mark.parametrize("dtype, passes", [(torch.float32, False), (torch.bfloat16, True)])
def test_precision_flip_is_lossy_on_fp32_weights_and_passes_on_bf16_ones(dtype, passes):
    """The router's fp32 GEMM from bf16 operands: on an fp32 model that rounds the weights and hidden states, a
    different function the gate rolls back; on a bf16 model the operands are bf16 already and only the summation
    order changes, so it passes."""
    model = load_model("tiny-deepseek-v2", dtype, torch.device("cpu"))
    patches = apply(model, [load_catalog()["precision_flip"]])
    report = validate(patches, **FAST)
    assert report.recipes["precision_flip"].calls > 0
    assert report.passed == passes and (report.rolled_back == [] if passes else ["precision_flip"]), report
    unpatch(model)


def test_top_k_pairs_compare_as_sets_per_row():
    """A router's (weights, ids) in another order within a row is the same routing; another expert is not, and a
    lone integer output (a sampled token) still compares position by position."""
    from optiq.validation import _error

    weights = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    ids = torch.tensor([[4, 1, 7], [0, 2, 5]])
    swapped = [0, 2, 1]
    assert _error([weights[:, swapped], ids[:, swapped]], [weights, ids]) == 0.0
    assert _error([weights, torch.tensor([[4, 1, 6], [0, 2, 5]])], [weights, ids]) == float("inf")
    assert _error([ids[:, swapped]], [ids]) == float("inf")
