"""Recipes find their sites by what modules compute: an RMSNorm of any class, with w or 1 + w; a gated MLP with its
projections apart or fused, SwiGLU or GeGLU; and models the catalog was not written for get recipes that the gate
then keeps (or rolls back, for a kernel wrong on them)."""

import importlib
from dataclasses import astuple

import pytest
import torch
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, DeepseekV4Config, Gemma3TextConfig,
                          Phi3Config)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4Attention, DeepseekV4HashRouter,
                                                                 DeepseekV4HyperConnection, DeepseekV4IndexerScorer,
                                                                 DeepseekV4TopKRouter)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from optiq.catalog.recipes import load_catalog
from optiq.fusions.indexer_scores import indexer_scores
from optiq.gate import GatePlan, validate
from optiq.gate.mutants import verify
from optiq.models import load_model
from optiq.patching import apply, unpatch
from optiq.patching.replacements import mla as mla_replacements
from optiq.patching.replacements import rope as rope_replacements
from optiq.patching.replacements.indexer import indexer_scores_forward
from optiq.patching.structure import (MlaSite, NormSite, RotaryLayout, SwigluExpertsSite, fp32_topk_router,
                                      gated_mlp, grouped_linear, hyper_connection, indexer_scorer, mla_attention,
                                      pre_norm_decoder_layer, qkv_attention, qkv_projections, rms_norm,
                                      rotary_layout, sandwich_norm_decoder_layer, swiglu_experts, topk_router)

from wrong_kernels import user_recipe

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_rms_norms_are_found_by_what_they_compute_whatever_their_class():
    """With where each applies its weight and rounds: Llama's rounds the normalised row before the weight, OLMo 2's
    after (the same function in float64, a rounding apart in bf16)."""
    llama, gemma, olmo2 = LlamaRMSNorm(32, eps=1e-5), Gemma3RMSNorm(32, eps=1e-6), Olmo2RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_(1.0, 0.1)
        gemma.weight.normal_(0.0, 0.1)
        olmo2.weight.normal_(1.0, 0.1)
    assert rms_norm(llama) == NormSite("variance_epsilon", offset=False, weight_first=False)
    assert rms_norm(gemma) == NormSite("eps", offset=True, weight_first=False)
    assert rms_norm(olmo2) == NormSite("variance_epsilon", offset=False, weight_first=True)
    assert rms_norm(torch.nn.LayerNorm(32, bias=False)) is None  # subtracts the mean: another structure
    assert rms_norm(torch.nn.Linear(32, 32, bias=False)) is None


class ScaledNorm(LlamaRMSNorm):
    """An RMSNorm with an extra scale: the right parameters, another function."""

    def forward(self, hidden_states):
        return 2.0 * super().forward(hidden_states)


def test_a_module_with_the_parameters_but_another_function_does_not_match():
    assert rms_norm(ScaledNorm(32)) is None


@pytest.fixture(scope="module", params=[Phi3Config(**TINY), Gemma3TextConfig(**TINY, head_dim=16)],
                ids=["phi3", "gemma3_text"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param.model_type)
    AutoModelForCausalLM.from_config(request.param).save_pretrained(path)
    return str(path)


def test_a_model_the_catalog_never_named_gets_recipes_the_gate_keeps(checkpoint):
    model = load_model(checkpoint, torch.float32, torch.device("cpu"))
    catalog = load_catalog()
    names = ["rmsnorm", "decode_attention", "decode_linear", "rope", "greedy_sample"]
    patches = apply(model, [catalog[n] for n in names])
    try:
        assert list(patches.applied) == names, patches.not_applicable
        report = validate(patches, GatePlan((1, 2), steps=3, prompt_len=5))
    finally:
        unpatch(model)
    assert report.passed and not report.rolled_back, report
    assert report.constant_parameters  # the checkpoint's initial norm weights: gated a second time, redrawn


@pytest.mark.parametrize("spec, site", [
    ("tiny-llama", dict(gate="gate_proj", up="up_proj", down="down_proj", fused="", activation="silu")),
    ("tiny:phi3", dict(gate="", up="", down="down_proj", fused="gate_up_proj", gate_first=True, activation="silu")),
    ("tiny:gemma3_text", dict(gate="gate_proj", up="up_proj", down="down_proj", activation="gelu_tanh")),
])
def test_gated_mlps_are_found_apart_or_fused_with_their_activation(spec, site):
    model = load_model(spec, torch.float32, torch.device("cpu"))
    mlp = model.model.layers[0].mlp
    found = gated_mlp(mlp)
    assert found is not None and all(getattr(found, k) == v for k, v in site.items()), found
    gate, up = found.gate_up_weights(mlp)
    x = torch.randn(3, gate.shape[1])
    act = torch.nn.functional.silu if found.activation == "silu" else (
        lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    torch.testing.assert_close(mlp(x), getattr(mlp, found.down)(act(x @ gate.T) * (x @ up.T)))


def test_modules_that_are_not_gated_mlps_do_not_match():
    gpt2 = load_model("tiny:gpt2", torch.float32, torch.device("cpu"))
    assert gated_mlp(gpt2.transformer.h[0].mlp) is None  # c_fc, act, c_proj: not gated
    assert gated_mlp(gpt2.transformer.h[0].attn) is None
    assert gated_mlp(torch.nn.Linear(8, 8)) is None


def test_a_swiglu_kernel_that_ignores_the_activation_is_rolled_back_on_geglu(tmp_path):
    """Gemma's MLP is GeGLU: the built-in kernel, told so, passes; one that always computes silu is rejected."""
    model = load_model("tiny:gemma3_text", torch.float32, torch.device("cpu"))
    wrong = user_recipe(tmp_path, "swiglu", "swiglu_silu_only", fusion="wrong_kernels:swiglu_always_silu")
    for recipe, passes in ((load_catalog()["swiglu"], True), (wrong, False)):
        patches = apply(model, [recipe])
        try:
            assert list(patches.applied) == [recipe.name], patches.not_applicable
            report = validate(patches, GatePlan((2,), steps=3, prompt_len=5))
        finally:
            unpatch(model)
        assert (recipe.name not in report.rolled_back) == passes, report.recipes[recipe.name]


def test_a_recipe_whose_sites_never_run_in_decode_is_rolled_back_not_passed():
    """AXK1 rotates with a function of its own: the llama-style apply_rotary_pos_emb its module also defines is
    patched but never called, so the gate has nothing to check and must not report a pass."""
    model = load_model("tiny:axk1", torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()["rope"]])
    try:
        assert list(patches.applied) == ["rope"], patches.not_applicable
        report = validate(patches, GatePlan((2,), steps=3, prompt_len=5))
    finally:
        unpatch(model)
    assert report.rolled_back == ["rope"] and report.recipes["rope"].calls == 0
    assert "no call in a decode step" in report.recipes["rope"].reason


@pytest.mark.parametrize("spec, names", [
    ("tiny:gpt_neox", ["rope", "decode_attention"]),  # partial rotary: a quarter of each head rotated
    ("tiny:glm", ["rope"]),  # half of each head, interleaved pairs, one angle a pair
    ("tiny:cohere", ["rope"]),  # interleaved pairs, each channel its own column, in fp32
    ("tiny:helium", ["rope"]),  # interleaved pairs turned by the first half of cos
    ("tiny:nanochat", ["rope"]),  # turned the other way
    ("tiny:gpt_oss", ["attention_prologue"]),  # cos half a head wide, one angle a pair
    ("tiny:ernie4_5", ["attention_prologue"]),  # interleaved pairs, one angle a pair, in fp32
    ("tiny:ergo", ["attention_prologue"]),  # NoPE layers (no cos and sin) among rotating ones: their own forward
    ("tiny:cohere2", ["attention_prologue"]),  # global layers that skip the rotation are not sites: the last
    # static layer's own update advances the counters the kernel's layers left
])
def test_variants_the_kernels_handle_pass_the_gate(spec, names):
    model = load_model(spec, torch.float32, torch.device("cpu"))
    catalog = load_catalog()
    patches = apply(model, [catalog[n] for n in names])
    try:
        assert list(patches.applied) == names, patches.not_applicable
        report = validate(patches, GatePlan((2,), steps=3, prompt_len=5))
    finally:
        unpatch(model)
    assert not report.rolled_back and report.passed, report.recipes
    assert all(report.recipes[n].calls > 0 for n in names)


@pytest.mark.parametrize("spec, name", [
    ("tiny:glm4_moe_lite", "decode_attention"),  # MLA values narrower than keys: every call goes to sdpa
    ("tiny:glm", "attention_prologue"),  # half of each head rotated: every call goes to the module's own
])
def test_a_recipe_whose_kernel_never_runs_is_rolled_back_not_kept(spec, name):
    """Sites found, every call handed back to the original path: the gate passes each call exactly and still keeps
    nothing, saying so, so the recipe's rivals (rope, for attention_prologue) get their turn."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()[name]])
    try:
        assert list(patches.applied) == [name], patches.not_applicable
        report = validate(patches, GatePlan((2,), steps=3, prompt_len=40))
    finally:
        unpatch(model)
    assert report.rolled_back == [name]
    assert "its kernel ran at none of its" in report.recipes[name].reason, report.recipes[name].reason


@pytest.mark.parametrize("spec, matched", [
    ("tiny:llama", [True, True]),
    ("tiny:cohere2", [True, False]),  # its global layers skip the rotation
    ("tiny:exaone4", [True, False]),  # the same, written another way
    ("tiny:afmoe", [False, False]),  # a sigmoid gate on the attention's output
    ("tiny:bitnet", [False, False]),  # a norm between the attention and o_proj
    ("tiny:doge", [False, False]),  # a mask of its own, made from the values
    ("tiny:hunyuan_v1_dense", [False, False]),  # q and k normed after the rotation
    ("tiny:ministral3", [False, False]),  # queries scaled by their position (wants position_ids)
])
def test_attention_prologue_sites_are_the_attentions_it_computes(spec, matched):
    """qkv_attention runs each attention once and matches only a forward that computes what attention_prologue's
    replacement does; a layer that rotates nothing, gates or normalises its output, builds its own mask or scales its
    queries is not a site (the gate rolled attention_prologue back on such models, or at short contexts could not
    tell)."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    assert [qkv_attention(layer.self_attn) is not None for layer in model.model.layers] == matched


def test_attention_prologue_hands_the_attention_function_what_the_forward_does():
    """The window Phi-3 hands from its config and the sinks GPT-OSS hands from its parameter, alongside the scale,
    reach the attention function through the replacement as through the model's own forward."""
    phi3 = load_model("tiny:phi3", torch.float32, torch.device("cpu")).model.layers[0].self_attn
    arguments = dict(qkv_attention(phi3).arguments)
    assert arguments == {"scaling": phi3.scaling, "sliding_window": phi3.config.sliding_window}
    gpt_oss = load_model("tiny:gpt_oss", torch.float32, torch.device("cpu")).model.layers[0].self_attn
    arguments = dict(qkv_attention(gpt_oss).arguments)
    assert arguments["s_aux"] is gpt_oss.sinks and arguments["scaling"] == gpt_oss.scaling


@pytest.mark.parametrize("module, layout", [
    ("llama", (64, False, False, False, False)), ("cohere", (64, True, False, False, True)),
    ("helium", (64, True, True, False, False)), ("ernie4_5", (64, True, True, False, True)),
    ("nanochat", (64, False, False, True, False)), ("gpt_oss", None), ("codegen", None),
])
def test_rotary_layouts_are_found_by_what_the_function_computes(module, layout):
    """transformers' apply_rotary_pos_emb variants at heads of 64 by full-width cos in bf16: Llama's, Cohere's
    interleaved pairs in fp32, Helium's pairs by the first half of cos, ERNIE's in fp32, NanoChat's other sense; none
    for GPT-OSS's (its cos is half a head wide) or GPT-J-style codegen's (sin before cos). GPT-OSS's at half width, GLM's
    partial rotary and Phi-3's at the widths they take."""
    function = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    found = rotary_layout(function, 64, 64, torch.bfloat16)
    assert (found and astuple(found)) == layout
    oss = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss").apply_rotary_pos_emb
    glm = importlib.import_module("transformers.models.glm.modeling_glm").apply_rotary_pos_emb
    assert astuple(rotary_layout(oss, 64, 32, torch.bfloat16)) == (64, False, True, False, False)
    assert astuple(rotary_layout(glm, 64, 32, torch.float32)) == (32, True, True, False, False)


def test_a_wrong_layout_is_rolled_back_by_the_gate(monkeypatch):
    """Cohere's rotation run as Llama's (a probe that got the layout wrong): the gate rolls rope back."""
    monkeypatch.setattr(rope_replacements, "rotary_layout", lambda *args: RotaryLayout(16, *[False] * 4))
    model = load_model("tiny:cohere", torch.float32, torch.device("cpu"))
    patches = apply(model, [load_catalog()["rope"]])
    try:
        report = validate(patches, GatePlan((2,), steps=3, prompt_len=5))
    finally:
        unpatch(model)
    assert report.rolled_back == ["rope"] and "error" in report.recipes["rope"].reason, report.recipes["rope"]


@pytest.mark.parametrize("spec, variants", [
    ("tiny:gemma3_text", ["sliding window forgotten"]),  # sdpa; sliding layers interleaved with full ones
    ("tiny:gemma2", ["sliding window forgotten", "softcap forgotten"]),  # eager: softcap is beyond sdpa
    ("tiny:gpt_oss", ["sliding window forgotten", "sinks forgotten"]),  # eager: per-head sinks
    ("tiny:llama4_text", ["sliding window forgotten"]),  # chunked attention: a query sees its own chunk of 32
])
def test_decode_attention_computes_the_zoo_variants_and_forgetting_one_is_caught(spec, variants):
    """The prompt outgrows the tiny configs' 32-position window, so forgetting the window changes the function; the
    kernel must run on these calls (not hand them back), so the mutants that forget a variant alter something.
    Random weights give scores of a few thousandths, which Gemma 2's own cap of 50 leaves straight: the gate lifts
    them toward it (``softcap_scales``), or a kernel without the cap would pass."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    assert {m.attn_logit_softcapping for m in model.modules() if hasattr(m, "attn_logit_softcapping")} <= {None, 50.0}
    results = verify(model, [load_catalog()["decode_attention"]], GatePlan((2,), steps=3, prompt_len=40))
    result = results["decode_attention"]
    assert result.real == "passed", result.real
    status = {mutant.name: mutant.status for mutant in result.mutants}
    assert all(status[name] == "killed" for name in variants), {n: status[n] for n in variants}


def test_an_implementation_without_the_cap_runs_uncapped_and_so_does_the_kernel(monkeypatch):
    """transformers 5.17's sdpa takes Gemma 2's softcap into its **kwargs and drops it (5.25's raises), so Gemma 2
    under it computes uncapped scores; the kernel computes what the model ran, which the gate checks at scores lifted
    toward the cap (it rejected a capped kernel there on an H100). The stand-in is that sdpa, registered anew."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    def sdpa_dropping_the_cap(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        kwargs.pop("softcap", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "capless", sdpa_dropping_the_cap)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "capless", sdpa_mask)
    model = load_model("tiny:gemma2", torch.float32, torch.device("cpu"))
    model.config._attn_implementation = "capless"
    results = verify(model, [load_catalog()["decode_attention"]], GatePlan((2,), steps=3, prompt_len=40))
    result = results["decode_attention"]
    assert result.real == "passed", result.real
    status = {mutant.name: mutant.status for mutant in result.mutants}
    assert status["softcap forgotten"] == "unchanged" and status["sliding window forgotten"] == "killed", status


@pytest.mark.parametrize("spec, names, multiplier", [
    ("tiny:gemma3_text", ["attention_prologue"], None),  # per-head q/k norms of 1 + w, sliding layers
    ("tiny:phi3", ["attention_prologue", "add_rmsnorm"], None),  # one fused qkv_proj
    ("tiny:granite", ["add_rmsnorm", "attention_prologue"], 0.22),  # Granite's residual and attention multipliers
    ("tiny:olmo2", ["attention_prologue", "sandwich_norm"], None),  # q/k normed over all heads; post-norm layers
    ("tiny:deepseek_v32", ["add_rmsnorm"], None),  # its cache layers hold the indexer's keys beside the latent's
    ("tiny:gpt_oss", ["add_rmsnorm"], None),  # a MoE that returns its router scores beside the hidden states
    ("tiny:bailing_hybrid", ["add_rmsnorm"], None),  # linear-attention mixers that return the hidden states alone
    ("tiny:minicpm3", ["add_rmsnorm"], None),  # each branch scaled by MiniCPM's scale_depth / sqrt(layers)
])
def test_llama_family_sites_are_found_by_structure_and_kept(spec, names, multiplier):
    """The attention and decoder-layer recipes, once written for five classes, on models the catalog never named;
    Granite's multipliers set off one (its published 0.22), so forgetting them would change the function."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    if multiplier is not None:
        for layer in model.model.layers:
            layer.residual_multiplier = multiplier
            layer.self_attn.scaling = multiplier
    catalog = load_catalog()
    patches = apply(model, [catalog[n] for n in names])
    try:
        assert sorted(patches.applied) == sorted(names), patches.not_applicable
        report = validate(patches, GatePlan((2,), steps=3, prompt_len=40))
    finally:
        unpatch(model)
    assert not report.rolled_back and report.passed, report.recipes
    assert all(report.recipes[n].calls > 0 for n in names)


@pytest.mark.parametrize("spec, pre_norm, sandwich", [
    ("tiny:llama", [(1.0, 1.0)] * 2, [False] * 2),
    ("tiny:minicpm3", [(1.4 / 2**0.5, 1.4 / 2**0.5)] * 2, [False] * 2),  # scale_depth 1.4 over sqrt(2 layers)
    ("tiny:olmo2", [None] * 2, [True] * 2),
    ("tiny:doge", [None] * 2, [False] * 2),  # residuals through learned gates
    ("tiny:minimax", [None] * 2, [False] * 2),  # residuals weighted by alpha and beta
    ("tiny:beam", [None] * 2, [False] * 2),  # Gemma's four norms, one branch added in another place
])
def test_decoder_layers_are_found_by_what_they_add_and_scale(spec, pre_norm, sandwich):
    """A layer is add_rmsnorm's or sandwich_norm's site only where its forward, run on stand-in branches, adds and
    normalises as the replacement does; the scale it puts on each branch is found, not read from an attribute."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    found = [pre_norm_decoder_layer(layer) for layer in model.model.layers]
    assert [None if site is None else pytest.approx((site.attention_scale, site.mlp_scale), rel=1e-6)
            for site in found] == pre_norm
    assert [sandwich_norm_decoder_layer(layer) is not None for layer in model.model.layers] == sandwich


@pytest.mark.parametrize("spec, structure", [("tiny:llama", pre_norm_decoder_layer),
                                             ("tiny:olmo2", sandwich_norm_decoder_layer)])
def test_decoder_layers_are_found_under_norms_a_recipe_patched(spec, structure):
    """The layer probes run in float64, which a fused norm's kernel does not take: they run the norms' own class
    forward, so add_rmsnorm and sandwich_norm find their layers after rmsnorm has patched the norms."""
    model = load_model(spec, torch.float32, torch.device("cpu"))

    def kernel_of_one_dtype(norm):
        own = norm.forward

        def forward(x):
            if x.dtype != torch.float32:
                raise TypeError(f"no {x.dtype} kernel")
            return own(x)
        return forward

    for module in model.modules():
        if rms_norm(module) is not None:
            module.forward = kernel_of_one_dtype(module)
    assert all(structure(layer) is not None for layer in model.model.layers)


@pytest.mark.parametrize("spec", [
    "tiny:qwen2",  # a bias on each projection
    "tiny:olmo2",  # q and k normed over all heads at once, before the split into heads
    "tiny:hunyuan_v1_dense",  # q and k normed after the rotation
    "tiny:stablelm",  # a quarter of each head rotated
    "tiny:diffllama",  # two attention maps subtracted
])
def test_qkv_projections_are_one_gemm_inside_each_attentions_own_forward(spec, tmp_path):
    """qkv_proj serves the three projections from one GEMM and leaves the rest of the forward the model's own, so it
    is kept on attentions llama's code does not compute; a GEMM that forgets the bias (qwen2's, redrawn around zero),
    or hands the keys back as the values, is rolled back."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    plan = GatePlan((2,), steps=3, prompt_len=16)
    patches = apply(model, [load_catalog()["qkv_proj"]])
    try:
        report = validate(patches, plan)
    finally:
        unpatch(model)
    assert not report.rolled_back and report.recipes["qkv_proj"].calls > 0, report.recipes
    assert all("forward" not in vars(m) for m in model.modules())
    if spec == "tiny:qwen2":
        assert_rolled_back(model, plan, tmp_path, "qkv_proj", ("qkv_without_bias", "qkv_keys_as_values"))


def test_projections_that_quantise_on_the_way_are_not_one_gemm():
    """A Linear subclass with a forward of its own (BitNet-style quantisation) computes another function: no
    qkv_proj site; plain linears of one input width are one, under llama's names or BERT's."""
    class Quantised(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x.round())

    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))
    assert qkv_projections(attention).names == ("q_proj", "k_proj", "v_proj")
    attention.k_proj = Quantised(8, 8)
    assert qkv_projections(attention) is None
    attention.query, attention.key, attention.value = (torch.nn.Linear(8, n) for n in (8, 4, 4))
    assert qkv_projections(attention).names == ("query", "key", "value")
    attention.value = torch.nn.Linear(6, 4)
    assert qkv_projections(attention) is None


@pytest.mark.parametrize("spec", ["tiny:gemma3_text", "tiny:gemma2", "tiny:glm4", "tiny:olmo2", "tiny:flex_olmo"])
def test_sandwich_norm_layers_are_found_and_their_mutants_killed(spec):
    """Gemma's and GLM-4's placements of the four norms and OLMo 2's post-norms (two, after the branches; FlexOlmo's
    around a MoE), on both passes of the gate with every mutant (the row swap among them: the kernel runs twice a
    layer); a pre-norm layer is not a sandwich."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    assert all(sandwich_norm_decoder_layer(layer) for layer in model.model.layers)
    assert not any(pre_norm_decoder_layer(layer) for layer in model.model.layers)
    result = verify(model, [load_catalog()["sandwich_norm"]], GatePlan((2,), steps=3, prompt_len=5))["sandwich_norm"]
    assert result.real == "passed", result.real
    status = {mutant.name: mutant.status for mutant in result.mutants}
    assert {"weight forgotten", "eps forgotten", "rows 0 and 1 swapped", "last row stale"} <= set(status) and set(
        status.values()) == {"killed"}, status
    llama = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    assert sandwich_norm_decoder_layer(llama.model.layers[0]) is None


def assert_rolled_back(model, plan, tmp_path, base: str, fusions: tuple[str, ...]) -> None:
    """Each of ``fusions`` (tests/wrong_kernels.py) in recipe ``base``'s place is rolled back by the gate for its
    error, and leaves no forward of its own on any module."""
    for fusion in fusions:
        patches = apply(model, [user_recipe(tmp_path / fusion, base, "wrong", fusion=f"wrong_kernels:{fusion}")])
        report = validate(patches, plan)
        assert report.rolled_back == ["wrong"] and "error" in report.recipes["wrong"].reason, (fusion, report)
        assert all("forward" not in vars(m) for m in model.modules())


def assert_kept(model, plan, name: str):
    """Recipe ``name`` alone passes the gate on both passes, and no mutant of its kernel survives; its result."""
    result = verify(model, [load_catalog()[name]], plan)[name]
    assert result.real == "passed", result.real
    assert result.mutants and all(mutant.status != "survived" for mutant in result.mutants), result.mutants
    return result


def test_a_sampler_blind_to_a_stretch_of_the_vocabulary_or_breaking_ties_late_is_rolled_back(tmp_path):
    """On tiny:gpt_neox no captured step's largest logit fell in the first eighth of the vocabulary, so a sampler
    blind to it passed, as one keeping the later of two tied maxima passes wherever logits are random: the gate's
    rows with their maximum swept over the vocabulary, and a tie (``per_recipe._swept``), show both. The real
    sampler is kept."""
    model = load_model("tiny:gpt_neox", torch.float32, torch.device("cpu"))
    plan = GatePlan((1, 2), steps=3, prompt_len=16, max_len=64)
    patches = apply(model, [load_catalog()["greedy_sample"]])
    try:
        report = validate(patches, plan)
    finally:
        unpatch(model)
    assert report.passed and not report.rolled_back, report.recipes
    for fusion, seen in (("sampler_blind_to_first_block", "its largest entry at 0"),
                         ("sampler_last_of_ties", "a tie")):
        patches = apply(model, [user_recipe(tmp_path / fusion, "greedy_sample", "wrong",
                                            fusion=f"wrong_kernels:{fusion}")])
        try:
            report = validate(patches, plan)
        finally:
            unpatch(model)
        assert report.rolled_back == ["wrong"] and seen in report.recipes["wrong"].reason, (fusion, report)


def test_hyper_connections_are_found_by_what_they_compute():
    """DeepSeek-V4's mHC is found with the Sinkhorn iteration count and eps its config gives (read from what the
    module computes, not from its attribute names); its final collapse (one output, no Sinkhorn) and a norm are not
    hyper-connections. A layer around them is not a pre-norm decoder layer: add_rmsnorm's one residual stream
    is not its four."""
    config = DeepseekV4Config(hidden_size=32, hc_mult=4, hc_sinkhorn_iters=7, hc_eps=1e-4, rms_norm_eps=1e-5)
    site = hyper_connection(DeepseekV4HyperConnection(config))
    assert (site.iterations, site.hc_eps, site.norm_eps) == (7, 1e-4, 1e-5)
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    assert all(hyper_connection(layer.attn_hc) and hyper_connection(layer.ffn_hc) for layer in model.model.layers)
    assert hyper_connection(model.model.hc_head) is None
    assert hyper_connection(model.model.layers[0].input_layernorm) is None
    assert not any(pre_norm_decoder_layer(layer) for layer in model.model.layers)


def test_hyper_connection_recipe_is_kept_and_its_wrong_kernels_rolled_back(tmp_path):
    """On both passes of the gate with every mutant that applies; a Sinkhorn loop run once and a forgotten base
    are rolled back."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    plan = GatePlan((2,), steps=3, prompt_len=5)
    result = verify(model, [load_catalog()["hyper_connection"]], plan)["hyper_connection"]
    assert result.real == "passed", result.real
    status = {mutant.name: mutant.status for mutant in result.mutants}
    assert {"rows 0 and 1 swapped", "last row stale", "first block dropped"} <= set(status) and set(
        status.values()) == {"killed"}, status
    assert_rolled_back(model, plan, tmp_path, "hyper_connection", ("mixing_single_iteration", "mixing_without_base"))


def test_grouped_projections_are_found_by_what_they_compute():
    """DeepSeek-V4's grouped output projection is found with its config's group count; its dense projections, and
    a Linear that keeps a group count but computes a dense product, are not grouped."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    found = {name: site for name, module in model.named_modules() if (site := grouped_linear(module))}
    assert set(found) == {f"model.layers.{i}.self_attn.o_a_proj" for i in range(len(model.model.layers))}
    assert {site.groups for site in found.values()} == {model.config.o_groups}
    dense = torch.nn.Linear(16, 8, bias=False)
    dense.n_groups = 2
    assert grouped_linear(dense) is None


@pytest.mark.parametrize("recipe, wrong_kernels", [
    ("grouped_linear", ("grouped_linear_shifted_blocks", "grouped_linear_as_one_block")),
    ("indexer_scores", ("indexer_scores_without_relu", "indexer_scores_heads_alike")),
    ("compressor_pool", ("pool_over_the_features", "pool_without_the_last_slot"))])
def test_deepseek_v4_recipe_is_kept_and_its_wrong_kernels_rolled_back(tmp_path, recipe, wrong_kernels):
    """On tiny-deepseek-v4 (a prompt of 9: its CSA layer's indexer has two closed windows to score), on both passes of
    the gate with every mutant that applies. Rolled back: a group offset by one and the block-diagonal structure lost
    (grouped_linear); the lossy indexer flip without the ReLU, or weighing every head alike (for indexer_scores, a
    scale off by 1.6% sits at the lossy floor, two bf16 ulps: the flip's own error on top of it puts it past); a
    compressor's softmax over the features instead of the window, or a window short of its newest slot
    (compressor_pool)."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    plan = GatePlan((2,), steps=3, prompt_len=9)
    result = assert_kept(model, plan, recipe)
    killed = {mutant.name for mutant in result.mutants if mutant.status == "killed"}
    assert {"first block dropped", "last block dropped", "rows 0 and 1 swapped", "last row stale",
            "state kept across calls"} <= killed, result.mutants
    assert_rolled_back(model, plan, tmp_path, recipe, wrong_kernels)


def test_a_site_the_gate_cannot_replay_rolls_its_recipe_back():
    """DeepSeek-V4 on its own cache (an attention forward of its own keeps it off optiq's static cache) appends its
    compressed entries after the mask the attention interface was built for, so decode_attention's recorded call
    cannot be replayed through the model's own path: the recipe is rolled back with that reason, and the run goes
    on (it was a traceback)."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    attentions = [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]
    for attention in attentions:
        attention.forward = type(attention).forward.__get__(attention)
    report = validate(apply(model, [load_catalog()["decode_attention"]]), GatePlan((2,), steps=3, prompt_len=9))
    assert report.rolled_back == ["decode_attention"], report
    assert "fails when replayed on its captured inputs" in report.recipes["decode_attention"].reason
    assert all("forward" not in vars(m) for m in model.modules() if m not in attentions)


def test_on_the_v4_static_cache_decode_attention_is_kept_and_its_wrong_kernels_rolled_back(tmp_path):
    """On optiq's static cache a V4 step's mask covers the keys it gathered (the window, then the closed or selected
    compressed entries), the ones a query does not see said as padding: the interface hands that visibility and
    the sinks to the kernel, which runs every call and passes the gate on both passes with its mutants killed. A
    kernel that attends every gathered key, or forgets the sinks, is rolled back."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    plan = GatePlan((2,), steps=3, prompt_len=9)
    assert_kept(model, plan, "decode_attention")
    patches = apply(model, [load_catalog()["decode_attention"]])
    report = validate(patches, plan)
    assert report.passed and report.recipes["decode_attention"].calls > 0, report
    patches.undo()
    assert_rolled_back(model, plan, tmp_path, "decode_attention",
                       ("attention_ignores_visibility", "attention_without_sinks"))


def test_v4_one_tensor_rotation_is_kept_and_its_wrong_kernels_rolled_back(tmp_path):
    """trailing_rope on every V4 rotation (queries, keys, the output's inverse, compressed entries, the indexer's
    queries) on both passes with its mutants killed; the llama family's rope, written for (q, k, cos, sin), finds
    no site; a rotation the wrong way and the half-split pairing are rolled back."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    plan = GatePlan((2,), steps=3, prompt_len=9)
    assert_kept(model, plan, "trailing_rope")
    patches = apply(model, [load_catalog()["rope"]])
    assert not patches.applied and "no site" in patches.not_applicable["rope"], patches.not_applicable
    assert_rolled_back(model, plan, tmp_path, "trailing_rope", ("trailing_rope_wrong_way", "trailing_rope_half_split"))


def test_experts_are_found_with_the_clamp_they_apply():
    """DeepSeek-V4's experts clamp at their swiglu_limit, Qwen3-MoE's at none (both found by what their gate
    computes); a GeLU gate is not SwiGLU experts."""
    v4 = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    found = {swiglu_experts(m) for m in v4.modules() if type(m).__name__ == "DeepseekV4Experts"}
    assert found == {SwigluExpertsSite(v4.config.swiglu_limit)}
    qwen = load_model("tiny-qwen3-moe", torch.float32, torch.device("cpu"))
    experts = next(m for m in qwen.modules() if type(m).__name__ == "Qwen3MoeExperts")
    assert swiglu_experts(experts) == SwigluExpertsSite(None)
    experts.act_fn = torch.nn.GELU()
    assert swiglu_experts(experts) is None


def test_v4_experts_recipe_is_kept_and_a_kernel_without_the_clamp_rolled_back(tmp_path):
    """moe_experts on DeepSeek-V4's clamped experts, on both passes with its mutants killed; a kernel that forgets
    the clamp is rolled back."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    plan = GatePlan((2,), steps=3, prompt_len=9)
    assert_kept(model, plan, "moe_experts")
    assert_rolled_back(model, plan, tmp_path, "moe_experts", ("experts_without_clamp",))


class ScorerWithoutRelu(DeepseekV4IndexerScorer):
    """An indexer scorer's projection and scales, its ReLU left out: another function."""

    def forward(self, q, compressed_kv, hidden_states):
        scores = torch.matmul(q.float(), compressed_kv.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        weights = self.weights_proj(hidden_states).float() * self.weights_scaling
        return (scores * weights.unsqueeze(-1)).sum(dim=2)


def test_indexer_scorers_are_found_by_what_they_compute():
    """Every CSA layer's scorer in tiny-deepseek-v4 and nothing else, with the product of its config's two scales
    (found among the module's floats by what they do); a scorer without the ReLU, or whose projection has a bias,
    is not one. Its replacement refuses any other module and hands a prefill's many positions to HF's forward."""
    config = DeepseekV4Config(hidden_size=32, index_n_heads=5, index_head_dim=24)
    site = indexer_scorer(DeepseekV4IndexerScorer(config))
    assert site.projection == "weights_proj" and site.scale == pytest.approx((24 * 5) ** -0.5, rel=1e-12)
    assert indexer_scorer(ScorerWithoutRelu(config)) is None
    biased = DeepseekV4IndexerScorer(config)
    biased.weights_proj = torch.nn.Linear(32, 5)
    assert indexer_scorer(biased) is None
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    found = {name for name, module in model.named_modules() if indexer_scorer(module)}
    assert found == {f"model.layers.{i}.self_attn.compressor.indexer.scorer"
                     for i, kind in enumerate(model.config.layer_types) if kind == "compressed_sparse_attention"}
    scorer = model.get_submodule(found.pop())
    q, keys, hidden = torch.randn(2, 3, 3, 16), torch.randn(2, 5, 16), torch.randn(2, 3, 64)
    assert torch.equal(indexer_scores_forward(scorer, indexer_scores)(q, keys, hidden), scorer(q, keys, hidden))
    with pytest.raises(ValueError, match="lightning indexer"):
        indexer_scores_forward(model.model.layers[0].input_layernorm, indexer_scores)


@pytest.mark.parametrize("spec, rotation", [
    ("tiny:deepseek_v2", "apply_rotary_emb"), ("tiny:deepseek_v3", "apply_rotary_pos_emb_interleave"),
    ("tiny:glm4_moe_lite", "apply_rotary_pos_emb_interleave"), ("tiny:minicpm3", "apply_rotary_pos_emb"),
    ("tiny:kimi_linear", None),
    # forwards that do more than the absorbed path: an indexer, latent scales, an output gate
    ("tiny:deepseek_v32", "no site"), ("tiny:longcat_flash", "no site"), ("tiny:bailing_hybrid", "no site"),
])
def test_mla_attentions_are_found_with_the_rotation_their_forward_uses(spec, rotation):
    model = load_model(spec, torch.float32, torch.device("cpu"))
    sites = {mla_attention(m) for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")}
    heads = model.config.num_attention_heads
    assert sites == ({None} if rotation == "no site" else {MlaSite(heads, rotation)})


@pytest.mark.parametrize("spec", ["tiny:deepseek_v3", "tiny:glm4_moe_lite"])
def test_mla_decode_is_kept_beyond_deepseek_v2_and_a_wrong_rotation_rolled_back(spec, monkeypatch):
    """The absorbed path on V3-style MLA (rope in interleaved pairs, out in halves) passes the gate; the same path
    turning its rope parts as Llama's does not (prefill cached the rope keys the model's way)."""
    model = load_model(spec, torch.float32, torch.device("cpu"))
    recipe = load_catalog()["mla_decode"]
    for wrong in (False, True):
        if wrong:
            monkeypatch.setattr(mla_replacements, "mla_attention",
                                lambda attn: MlaSite(attn.config.num_attention_heads, "apply_rotary_pos_emb"))
        patches = apply(model, [recipe])
        try:
            report = validate(patches, GatePlan((2,), steps=3, prompt_len=5))
        finally:
            unpatch(model)
        assert report.rolled_back == (["mla_decode"] if wrong else []), report.recipes["mla_decode"]
        assert report.recipes["mla_decode"].calls > 0


def _routing(site):
    return site and (site.score, site.renormalize, site.bias, site.groups, site.logits, site.fp32_weights)


@pytest.mark.parametrize("spec, routing", [
    ("tiny-qwen3-moe", ("softmax", True, None, (1, 1, 2), "model", False)),
    ("tiny-deepseek-v2", ("softmax", False, None, (1, 1, 2), "fp32", True)),
    ("tiny:deepseek_v3", ("sigmoid", True, "e_score_correction_bias", (1, 1, 2), "fp32", True)),
    ("tiny:mixtral", ("softmax", True, None, (1, 1, 2), "model", True)),
    ("tiny:granitemoe", ("softmax", True, None, (1, 1, 2), "cast", False)),  # softmax of its top-k logits alone
    ("tiny:gpt_oss", None),  # a bias in the logits' GEMM
    ("tiny:ernie4_5_moe", None),  # the choice's statistics a child module's parameter
])
def test_routers_are_found_by_what_they_compute(spec, routing):
    model = load_model(spec, torch.float32, torch.device("cpu"))
    routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    assert routers and {_routing(topk_router(m)) for m in routers} == {routing}
    assert {fp32_topk_router(m) is not None for m in routers} == {routing is not None and routing[4] == "fp32"}


def test_group_limited_bias_and_hash_routers_are_found_with_their_buffers():
    """DeepSeek-V3's groups ranked by their two best (V2's by their best), V4's sqrt(softplus) with its selection
    bias, and its hash routing's table, each with its scale."""
    torch.manual_seed(0)
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                                               topk_group=2, routed_scaling_factor=2.0))
    v2 = DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=4, n_group=8,
                                               topk_group=3, topk_method="group_limited_greedy"))
    v4 = DeepseekV4Config(hidden_size=32, num_local_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.5)
    for router in (v3, v2, DeepseekV4TopKRouter(v4), DeepseekV4HashRouter(v4)):
        torch.nn.init.normal_(router.weight)
    sites = [topk_router(router) for router in (v3, v2, DeepseekV4TopKRouter(v4), DeepseekV4HashRouter(v4))]
    assert (sites[0].groups, sites[0].scale, sites[0].bias) == ((4, 2, 2), 2.0, "e_score_correction_bias")
    assert (sites[1].groups, sites[1].renormalize, sites[1].score) == ((8, 3, 1), False, "softmax")
    assert (sites[2].score, sites[2].bias, sites[2].scale, sites[2].table) == (
        "sqrtsoftplus", "e_score_correction_bias", 1.5, None)
    assert (sites[3].score, sites[3].table, sites[3].bias) == ("sqrtsoftplus", "tid2eid", None)


@pytest.fixture(scope="module")
def grouped_v3(tmp_path_factory):
    """A DeepSeek-V3 checkpoint that routes within the best 2 of 4 groups of 16 experts."""
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2,
                              moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    path = tmp_path_factory.mktemp("grouped_v3")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return load_model(str(path), torch.float32, torch.device("cpu"))


def test_group_limited_routing_is_kept_and_a_kernel_ignoring_the_groups_rolled_back(grouped_v3, tmp_path):
    """moe_router on routing within the best groups, with its selection bias (zero in the checkpoint: the gate's
    second pass redraws it, so a kernel that forgets it is caught); a kernel choosing among all groups is rolled
    back."""
    plan = GatePlan((2,), steps=3, prompt_len=9)
    patches = apply(grouped_v3, [load_catalog()["moe_router"]])
    report = validate(patches, plan)
    assert report.passed and not report.rolled_back and report.recipes["moe_router"].calls > 0, report
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in report.constant_parameters
    unpatch(grouped_v3)
    assert_rolled_back(grouped_v3, plan, tmp_path, "moe_router", ("router_ignores_groups", "router_without_bias",
                                                                   "router_drops_last_block"))

