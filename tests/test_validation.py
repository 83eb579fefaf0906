"""The validation gate passes the built-in recipes and rejects wrong kernels, rolling back only the failing recipe."""

import copy

import pytest
import torch
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

import optiq.gate.end_to_end as gate_end_to_end
from optiq.catalog.recipes import load_catalog
from optiq.gate import GatePlan, validate
from optiq.gate.end_to_end import baselines, check_end_to_end, decode
from optiq.gate.references.attention import grouped_decode_attention
from optiq.models import load_model
from optiq.patching import apply, unpatch
from wrong_kernels import user_recipe

FAST = {"concurrencies": (1, 2), "steps": 3, "prompt_len": 5}


@pytest.mark.parametrize("left_out", [{"gate_up_swiglu", "attention_prologue", "precision_flip"},
                                      {"swiglu", "qkv_proj", "moe_router"}], ids=["qkv_proj", "attention_prologue"])
def test_builtin_recipes_pass(tiny_model, left_out):
    """Every recipe that applies, at once (of two that patch the same place, one per case)."""
    catalog = load_catalog()
    patches = apply(tiny_model, [r for name, r in catalog.items() if name not in left_out])
    try:
        report = validate(patches, GatePlan(**FAST))
        assert report.passed, report
        assert all(r.passed and r.calls > 0 for r in report.recipes.values())
        assert all(e.top1 == 1.0 and e.rel_err <= e.bound for e in report.end_to_end)
        assert report.recipes["rmsnorm"].err_fused > 0 and report.recipes["greedy_sample"].err_fused == 0
    finally:
        unpatch(tiny_model)


def test_default_path_decodes_64_steps():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()["rmsnorm"]])
    report = validate(patches, GatePlan(concurrencies=(1,)))
    assert report.passed and [e.steps for e in report.end_to_end] == [64]
    rmsnorm = report.recipes["rmsnorm"]
    assert 0 < rmsnorm.margin < float("inf") and rmsnorm.err_fused <= rmsnorm.bound
    assert "rmsnorm" in patches.applied


@pytest.mark.parametrize("base, fusion, why", [
    ("rmsnorm", "wrong_kernels:norm_without_eps", "error"),
    ("rmsnorm", "wrong_kernels:norm_without_weight", "error"),  # passed while presets' norm weights were all ones
    ("rmsnorm", "wrong_kernels:norm_weight_on_half", "error"),
    ("rmsnorm", "wrong_kernels:stale_rmsnorm", "on its second run"),
    ("rope", "wrong_kernels:rope_wrong_way", "error"),
    ("decode_attention", "wrong_kernels:attention_drops_last", "error"),
    ("rmsnorm", "wrong_kernels:raising_norm", "raised RuntimeError: out of shared memory"),
])
def test_wrong_kernels_are_rolled_back_and_others_stay(tmp_path, base, fusion, why):
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    wrong = user_recipe(tmp_path, base, "wrong", fusion=fusion)
    patches = apply(model, [wrong, load_catalog()["greedy_sample"]])
    report = validate(patches, GatePlan(**FAST))
    result = report.recipes["wrong"]
    assert not result.passed and why in result.reason, result
    assert report.rolled_back == ["wrong"] and list(patches.applied) == ["greedy_sample"]
    assert report.recipes["greedy_sample"].passed and all(e.passed for e in report.end_to_end)
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_model_gated_on_constant_parameters_names_them():
    """A checkpoint's norm weights may be all ones (transformers' initialisation): the gate says so, as a kernel that
    forgot them would pass there."""
    from transformers import AutoModelForCausalLM

    from optiq.models import load_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny-llama")).eval()  # as initialised: no redraw
    patches = apply(model, [load_catalog()["rmsnorm"]])
    report = validate(patches, GatePlan(**FAST))
    assert report.passed and "model.norm.weight" in report.constant_parameters
    assert "model.layers.0.input_layernorm.weight" in report.constant_parameters
    unpatch(model)


def test_a_linear_kernel_that_forgets_the_bias_is_rolled_back(tmp_path):
    """Biases start at zero in transformers' initialisation; drawn anew, a kernel that drops them is seen."""
    from transformers import LlamaConfig

    from optiq.models import random_model

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, attention_bias=True, mlp_bias=True)
    model = random_model(config, torch.float32, torch.device("cpu"))
    assert model.model.layers[0].self_attn.o_proj.bias.abs().min() > 0
    patches = apply(model, [load_catalog()["decode_linear"]])
    report = validate(patches, GatePlan(**FAST))
    assert report.passed and report.recipes["decode_linear"].calls > 0, report
    unpatch(model)
    patches = apply(model, [user_recipe(tmp_path, "decode_linear", "wrong", fusion="wrong_kernels:linear_without_bias")])
    report = validate(patches, GatePlan(**FAST))
    assert report.rolled_back == ["wrong"] and "error" in report.recipes["wrong"].reason, report


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_computing_in_fp32_equals_an_fp32_copy_and_restores_the_weights(preset):
    model = load_model(preset, torch.bfloat16, torch.device("cpu"))
    stored = [(p, p.data_ptr()) for p in model.parameters()]
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    fp32_copy = copy.deepcopy(model).float()
    with torch.inference_mode(), grouped_decode_attention(fp32_copy):  # the attention the reference decodes with
        want, want_picks = decode(fp32_copy, prompt, 4, None, [])
    with torch.inference_mode():
        got, got_picks = decode(model, prompt, 4, None, [], dtype=torch.float32)
    assert torch.equal(got, want) and torch.equal(got_picks, want_picks)
    assert all(p is q and p.data_ptr() == address and p.dtype == torch.bfloat16
               for (p, address), q in zip(stored, model.parameters()))


def test_bf16_model_is_gated_against_itself_computing_in_fp32():
    """With the sampler, whose result is exact under the interpreter too (which rounds bf16 by truncation, so a bf16
    kernel there is less accurate than torch's, and the gate says so)."""
    model = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    patches = apply(model, [load_catalog()["greedy_sample"]])
    try:  # the sampler is a function patch, global to the process
        report = validate(patches, GatePlan(concurrencies=(1,), steps=3, prompt_len=5))
    finally:
        unpatch(model)
    assert report.passed, report
    (check,) = report.end_to_end
    assert 0 < check.rel_err_unpatched < 0.05 and check.rel_err <= check.bound
    assert report.recipes["greedy_sample"].err_fused == 0 and report.constant_parameters == []
    assert 0 < report.reference_seconds < report.baseline_seconds and report.reference_mode == "eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph mode needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_graph_mode_gate_checks_the_captured_patched_model(preset):
    model = load_model(preset, torch.bfloat16, torch.device("cuda"))
    patches = apply(model, [r for name, r in load_catalog().items()
                            if name not in ("swiglu", "qkv_proj", "precision_flip")])
    report = validate(patches, GatePlan(concurrencies=(1, 16), steps=8, prompt_len=5, mode="graph"))
    assert report.passed, report
    assert not report.rolled_back and all(e.top1 >= e.min_top1 for e in report.end_to_end)
    assert report.reference_mode == "graph"  # the MoE's fp32 experts too (optiq.gate.references.experts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph mode needs CUDA")
@pytest.mark.parametrize("spec", ["tiny:qwen2", "tiny:olmo2"])
def test_graph_mode_gate_keeps_qkv_proj_inside_the_attentions_own_forward(spec):
    """qkv_proj's per-call routing of the three projections is captured into the CUDA graph as the GEMM it chose
    (qwen2's biases; olmo2's q and k normed over all heads, left to the model's own forward here), and olmo2's
    norms, which apply their weight before rounding, in bf16 are kept too."""
    model = load_model(spec, torch.bfloat16, torch.device("cuda"))
    catalog = load_catalog()
    patches = apply(model, [catalog[name] for name in ("qkv_proj", "decode_attention", "rmsnorm", "decode_linear")])
    report = validate(patches, GatePlan(concurrencies=(1, 16), steps=8, prompt_len=5, mode="graph"))
    assert report.passed and not report.rolled_back, report
    assert report.recipes["qkv_proj"].calls > 0


def with_olmo2_qk_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Qwen3's per-head q/k norms swapped for OLMo 2's norm class of the same width and weights, as Ergo's and
    AFMoE's are (types transformers 5.17 does not have)."""
    for module in model.modules():
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name, None)
            if isinstance(norm, torch.nn.Module):
                olmo = Olmo2RMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon).to(norm.weight)
                olmo.weight.data.copy_(norm.weight)
                setattr(module, name, olmo)
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph mode needs CUDA")
@pytest.mark.parametrize("spec, recipes", [
    ("tiny:olmo2", ("rmsnorm", "sandwich_norm", "attention_prologue")),  # post-norms; q/k normed over all heads
    ("tiny:qwen3", ("rmsnorm", "attention_prologue")),  # per-head q/k norms, OLMo 2's class
])
def test_graph_mode_gate_keeps_norms_that_round_after_their_weight(spec, recipes):
    """Norms that scale the fp32 normalised row by their weight and round once (OLMo 2's), a rounding apart from
    Llama's order, which bf16 shows: each fused kernel that computes them (the row norm, the branch norm with its
    residual add, the q/k norms before the rotation, per head or over all heads) is kept in bf16, every site in
    use."""
    model = with_olmo2_qk_norms(load_model(spec, torch.bfloat16, torch.device("cuda")))
    catalog = load_catalog()
    patches = apply(model, [catalog[name] for name in recipes])
    report = validate(patches, GatePlan(concurrencies=(1, 16), steps=8, prompt_len=5, mode="graph"))
    assert report.passed and not report.rolled_back, report
    assert all(report.recipes[name].calls > 0 for name in recipes), report.recipes


@pytest.mark.parametrize("preset, base, fusion", [
    ("tiny-qwen3-moe", "moe_experts", "wrong_kernels:experts_first_choice_only"),
    ("tiny-deepseek-v2", "moe_experts", "wrong_kernels:experts_first_choice_only"),
    ("tiny-deepseek-v2", "mla_decode", "wrong_kernels:mla_drops_last"),
    ("tiny-qwen3-moe", "moe_router", "wrong_kernels:router_drops_last_expert"),
    ("tiny-deepseek-v2", "moe_router", "wrong_kernels:router_drops_last_expert"),
    ("tiny-llama", "attention_prologue", "wrong_kernels:prologue_writes_one_slot_early"),
    ("tiny-qwen3-moe", "attention_prologue", "wrong_kernels:prologue_writes_one_slot_early"),
    ("tiny-deepseek-v2", "decode_linear", "wrong_kernels:linear_skips_last_k_column"),
])
def test_moe_and_mla_recipes_pass_and_their_wrong_kernels_are_rolled_back(tmp_path, preset, base, fusion):
    model = load_model(preset, torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()[base]])
    report = validate(patches, GatePlan(**FAST))
    assert report.passed and report.recipes[base].calls > 0, report
    unpatch(model)
    patches = apply(model, [user_recipe(tmp_path, base, "wrong", fusion=fusion)])
    report = validate(patches, GatePlan(**FAST))
    assert report.rolled_back == ["wrong"] and "error" in report.recipes["wrong"].reason, report
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_whole_catalog_passes_on_the_mla_moe_preset():
    """Every recipe that applies to DeepSeek-V2 at once: norms, MLA decode, router, experts, the dense and shared
    experts' gated MLPs, o_proj, sampling (the router's lossy rival precision_flip has its own test, swiglu is
    gate_up_swiglu's rival, qkv_proj attention_prologue's; neither finds a site in MLA)."""
    model = load_model("tiny-deepseek-v2", torch.float32, torch.device("cpu"))
    patches = apply(model, [r for r in load_catalog().values()
                            if r.applies_to("deepseek_v2") and r.name not in ("precision_flip", "swiglu", "qkv_proj")])
    assert set(patches.applied) == {"rmsnorm", "add_rmsnorm", "mla_decode", "moe_router", "moe_experts",
                                    "gate_up_swiglu", "decode_linear", "greedy_sample"}
    report = validate(patches, GatePlan(**FAST))
    assert report.passed and not report.rolled_back, report
    unpatch(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_precision_flip_rounds_only_what_is_not_bf16_already(dtype):
    """The router GEMM from bf16 operands: a router weight stored in fp32 (an fp32 model; transformers 5.24 also keeps
    DeepSeek's router weight in fp32 in a bf16 model) is rounded to bf16, a lossy change of about a bf16 rounding that
    the end-to-end check judges (on this preset it passes); a bf16 weight (5.17's bf16 model) is read as it is and
    only the summation order changes."""
    model = load_model("tiny-deepseek-v2", dtype, torch.device("cpu"))
    stored = model.model.layers[1].mlp.gate.weight.dtype
    patches = apply(model, [load_catalog()["precision_flip"]])
    report = validate(patches, GatePlan(**FAST))
    result = report.recipes["precision_flip"]
    assert result.calls > 0 and report.passed, report
    if stored == torch.bfloat16:
        assert result.err_fused < 1e-5, result
    else:
        assert 1e-4 < result.err_fused <= result.bound, result
    unpatch(model)


def test_top_k_pairs_compare_as_sets_per_row():
    """A router's (weights, ids) in another order within a row is the same routing; another expert is not, and a
    lone integer output (a sampled token) still compares position by position."""
    from optiq.gate.rules import error as _error

    weights = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    ids = torch.tensor([[4, 1, 7], [0, 2, 5]])
    swapped = [0, 2, 1]
    assert _error([weights[:, swapped], ids[:, swapped]], [weights, ids]) == 0.0
    assert _error([weights, torch.tensor([[4, 1, 6], [0, 2, 5]])], [weights, ids]) == float("inf")
    assert _error([ids[:, swapped]], [ids]) == float("inf")


def test_one_fp32_reference_decode_serves_every_concurrency(monkeypatch):
    """A half-precision model's gate decodes the fp32 reference once, at the largest concurrency; the slice a smaller
    concurrency gets is what a reference decode of its own prompt gives (each sequence is computed on its own)."""
    model = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    patches = apply(model, [load_catalog()["greedy_sample"]])
    decodes = []
    plain_decode = gate_end_to_end.decode
    monkeypatch.setattr(gate_end_to_end, "decode",
                        lambda *a, **k: decodes.append(k.get("dtype")) or plain_decode(*a, **k))
    try:  # the sampler is a function patch, global to the process
        report = validate(patches, GatePlan(**FAST))
        assert report.passed and decodes.count(torch.float32) == 1, decodes
        found, *_ = baselines(patches, GatePlan((1, 2), 3, 5))
        with torch.inference_mode(), patches.suspended():
            alone, alone_picks = plain_decode(model, found[1].prompt, 3, None, [], dtype=torch.float32)
    finally:
        unpatch(model)
    torch.testing.assert_close(found[1].want, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(found[1].picks, alone_picks)


def test_streamed_errors_equal_those_of_the_stored_logits():
    """The end-to-end check compares each step's logits as it comes instead of keeping them; its numbers must be
    those of the whole decodes' logits compared at once, for the unpatched model as for the patched one."""
    model = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    patches = apply(model, [load_catalog()["rmsnorm"]])
    found, *_ = baselines(patches, GatePlan((1, 2), 3, 5))
    checks = check_end_to_end(patches, ["rmsnorm"], found)
    assert [c.concurrency for c in checks] == [1, 2]
    with torch.inference_mode(), patches.suspended():
        for check in checks:
            b = found[check.concurrency]
            assert b.want.dtype == torch.float32
            want = b.want.double()
            for changes, rel_err, top1 in [([], check.rel_err_unpatched, check.top1_unpatched),
                                           (patches.applied["rmsnorm"].changes, check.rel_err, check.top1)]:
                got, picks = decode(model, b.prompt, 3, b.picks, changes)
                expected = ((got.double() - want).norm() / want.norm()).item()
                assert 0 < rel_err == pytest.approx(expected, rel=1e-9, abs=0), (changes, rel_err, expected)
                assert top1 == (picks[1:] == b.picks[1:]).double().mean().item()
    unpatch(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph mode needs CUDA")
def test_the_fp32_reference_decodes_in_graph_mode_as_eager():
    """In graph mode the reference's steps replay one captured step, its weight casts included: same logits and picks
    as eager steps."""
    model = load_model("tiny-llama", torch.bfloat16, torch.device("cuda"))
    prompt = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.inference_mode():
        eager, eager_picks = decode(model, prompt, 8, None, [], "eager", dtype=torch.float32)
        graph, graph_picks = decode(model, prompt, 8, None, [], "graph", dtype=torch.float32)
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(graph_picks, eager_picks)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.fixture(scope="module")
def checkpoint_with_constants(tmp_path_factory):
    """A tiny-llama checkpoint saved as transformers initialises it: all-ones norm weights."""
    from transformers import AutoModelForCausalLM

    from optiq.models import load_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("checkpoint")
    AutoModelForCausalLM.from_config(load_config("tiny-llama")).save_pretrained(path)
    return str(path)


def test_a_checkpoints_constant_parameters_are_redrawn_for_a_second_pass(tmp_path, checkpoint_with_constants):
    model = load_model(checkpoint_with_constants, torch.float32, torch.device("cpu"))
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    wrong = user_recipe(tmp_path, "rmsnorm", "wrong", fusion="wrong_kernels:norm_without_weight")
    report = validate(apply(model, [wrong]), GatePlan(**FAST))
    assert any("norm" in n for n in report.constant_parameters)
    result = report.recipes["wrong"]
    assert not result.passed and "constant parameters redrawn" in result.reason, result
    assert all(bool((p == 1).all()) for p in norms)  # the checkpoint's own values are back
    unpatch(model)


def test_correct_recipes_pass_both_passes_on_a_checkpoint(checkpoint_with_constants):
    """qkv_proj concatenates the projections' weights when it is built: the second pass rebuilds it."""
    model = load_model(checkpoint_with_constants, torch.float32, torch.device("cpu"))
    catalog = load_catalog()
    patches = apply(model, [catalog[n] for n in ("rmsnorm", "qkv_proj", "decode_linear")])
    report = validate(patches, GatePlan(**FAST))
    assert report.passed and report.constant_parameters, report
    first = report.recipes["rmsnorm"].calls
    assert first > 0 and all(r.passed for r in report.recipes.values())
    unpatch(model)


def test_a_partial_last_block_shows_a_position_short_of_the_longest_context(tmp_path):
    """The cache holds 64 positions: at context 64 every block is whole, at 63 (where the smaller batches are
    checked) the last one is not."""
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    plan = GatePlan(**FAST, max_len=64)
    assert plan.capture_points() == [(1, 63), (2, 64)]
    wrong = user_recipe(tmp_path, "decode_attention", "wrong", fusion="wrong_kernels:attention_whole_blocks_only")
    report = validate(apply(model, [wrong]), plan)
    assert report.rolled_back == ["wrong"] and "context 63" in report.recipes["wrong"].reason, report
