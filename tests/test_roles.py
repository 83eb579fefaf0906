"""Module roles come from the module tree's structure: models whose attributes are named otherwise (Phi-3's fused
qkv_proj registered after o_proj, GPT-2's c_attn/c_proj of Conv1D, Mamba's mixer) get the roles Llama gets."""

import pytest
import torch

from transformers import AutoModelForCausalLM

from optiq.models import load_config, load_model
from optiq.profiling.roles import decoder_layers, module_roles


def _layer0(model_spec: str) -> tuple[dict[str, str], str]:
    model = load_model(model_spec, torch.float32, torch.device("cpu"))
    names = {id(m): q for q, m in model.named_modules()}
    prefix = names[id(decoder_layers(model)[0])]
    return {q.removeprefix(prefix + "."): r for q, r in module_roles(model).items() if q.startswith(prefix + ".")}, \
        prefix


@pytest.mark.parametrize("spec, expected", [
    ("tiny-llama", {"input_layernorm": "norm", "post_attention_layernorm": "post_attn_norm",
                    "self_attn": "attention", "self_attn.q_proj": "qkv_proj", "self_attn.k_proj": "qkv_proj",
                    "self_attn.v_proj": "qkv_proj", "self_attn.o_proj": "o_proj", "mlp": "mlp"}),
    ("tiny:phi3", {"input_layernorm": "norm", "post_attention_layernorm": "post_attn_norm",
                   "self_attn": "attention", "self_attn.qkv_proj": "qkv_proj", "self_attn.o_proj": "o_proj",
                   "mlp": "mlp"}),
    ("tiny:gpt2", {"ln_1": "norm", "ln_2": "post_attn_norm", "attn": "attention", "attn.c_attn": "qkv_proj",
                   "attn.c_proj": "o_proj", "mlp": "mlp"}),
    ("tiny:mamba", {"norm": "norm", "mixer": "mixer"}),
    ("tiny:gemma3_text", {"input_layernorm": "norm", "post_attention_layernorm": "branch_norm",
                          "pre_feedforward_layernorm": "branch_norm", "post_feedforward_layernorm": "branch_norm",
                          "self_attn": "attention", "self_attn.q_proj": "qkv_proj", "self_attn.k_proj": "qkv_proj",
                          "self_attn.v_proj": "qkv_proj", "self_attn.o_proj": "o_proj",
                          "self_attn.q_norm": "qk_norm", "self_attn.k_norm": "qk_norm", "mlp": "mlp"}),
    ("tiny:olmo2", {"post_attention_layernorm": "branch_norm", "post_feedforward_layernorm": "branch_norm",
                    "self_attn": "attention", "self_attn.q_proj": "qkv_proj", "self_attn.k_proj": "qkv_proj",
                    "self_attn.v_proj": "qkv_proj", "self_attn.o_proj": "o_proj", "self_attn.q_norm": "norm",
                    "self_attn.k_norm": "norm", "mlp": "mlp"}),  # post-norm; q and k normed over all heads at once
])
def test_roles_of_a_decoder_layer(spec, expected):
    roles, _ = _layer0(spec)
    assert roles == expected


def test_moe_and_mla_roles():
    """Experts (3-D weights), the router (a row per expert), shared experts beside them, MLA's latent expansion."""
    model = load_model("tiny-deepseek-v2", torch.float32, torch.device("cpu"))
    roles = module_roles(model)
    assert roles["model.layers.1.mlp.experts"] == "experts"
    assert roles["model.layers.1.mlp.gate"] == "moe_router"
    assert roles["model.layers.1.mlp.shared_experts"] == "mlp"
    assert roles["model.layers.0.self_attn.kv_b_proj"] == "kv_expand"
    assert roles["model.layers.0.self_attn.kv_a_layernorm"] == "norm"
    assert roles["model.norm"] == "norm" and roles["lm_head"] == "lm_head"
    assert roles["model.embed_tokens"] == "embed"


def test_a_norm_without_a_learned_scale_is_a_norm():
    """DiffLlama's group norm inside attention has no weight: a norm all the same (a width of its own, not a head's),
    and no error."""
    roles, _ = _layer0("tiny:diffllama")
    assert roles["self_attn.groupnorm"] == "norm" and roles["self_attn.o_proj"] == "o_proj"


@pytest.mark.parametrize("preset, device", [("tiny-deepseek-v4", "cpu"), ("deepseek-v4-flash", "meta")])
def test_deepseek_v4_roles(preset, device):
    """DeepSeek-V4: the hyper-connections (mHC) are neither mixer nor MLP; the compressor and the indexer nested in
    it are roles of their own, holding their projections, and the indexer's scorer is the indexer's (a decode step
    calls it alone); both halves of the grouped output projection are o_proj; every layer type is attention. At the
    real widths too (meta tensors: 40.6 B parameters, no memory)."""
    if device == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(preset))
    else:
        model = load_model(preset, torch.float32, torch.device(device))
    roles = module_roles(model)
    layer_types = model.config.layer_types
    for index, kind in enumerate(layer_types):
        layer = f"model.layers.{index}"
        assert roles[f"{layer}.attn_hc"] == roles[f"{layer}.ffn_hc"] == "mhc"
        assert roles[f"{layer}.self_attn"] == "attention" and roles[f"{layer}.mlp"] == "mlp"
        assert roles[f"{layer}.self_attn.o_a_proj"] == roles[f"{layer}.self_attn.o_b_proj"] == "o_proj"
        assert roles[f"{layer}.self_attn.q_b_proj"] == "qkv_proj"
        assert roles[f"{layer}.mlp.experts"] == "experts" and roles[f"{layer}.mlp.gate"] == "moe_router"
        assert roles[f"{layer}.mlp.shared_experts"] == "mlp"
        compressor = f"{layer}.self_attn.compressor"
        assert roles.get(compressor) == (None if kind == "sliding_attention" else "compressor"), kind
        assert roles.get(f"{compressor}.indexer") == ("indexer" if kind == "compressed_sparse_attention" else None)
        assert roles.get(f"{compressor}.indexer.scorer") == roles.get(f"{compressor}.indexer")
        assert not any(name.startswith(f"{compressor}.") and role != "indexer" for name, role in roles.items())
    assert {"sliding_attention", "compressed_sparse_attention"} <= set(layer_types) or device == "meta"
    assert roles["model.hc_head"] == "mhc" and roles["model.norm"] == "norm"


def test_an_indexer_inside_attention_is_its_own_role():
    """DeepSeek-V3.2's family: the indexer that picks the attended positions, inside MLA attention."""
    roles, _ = _layer0("tiny:deepseek_v32")
    assert roles["self_attn"] == "attention" and roles["self_attn.indexer"] == "indexer"
    assert not any(name.startswith("self_attn.indexer.") for name in roles)
