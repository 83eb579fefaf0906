"""Presets have the real models' shapes; checkpoints load offline; bad names fail clearly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optiq.errors import OptiqError
from optiq.models import PRESETS, load_config, load_model, resolve_dtype

# Parameter counts of the published checkpoints (safetensors metadata of the real models).
PUBLISHED_PARAMETERS = {
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-30b-a3b": 30_532_122_624,
    "gemma-3-1b": 999_885_952,
    "phi-3-mini": 3_821_079_552,
    "mistral-7b": 7_248_023_552,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_preset_has_the_real_models_parameter_count(preset):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(preset))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[preset]


def test_deepseek_v2_lite_preset_has_the_model_cards_size():
    """The model card gives 15.7B parameters (no exact count published beside it): MLA, 64 + 2 experts, 27 layers."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config("deepseek-v2-lite"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 15.7
    attention = model.model.layers[0].self_attn
    assert (attention.kv_lora_rank, attention.qk_rope_head_dim, attention.num_heads) == (512, 64, 16)
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV2MLP"  # first_k_dense_replace = 1
    assert len(model.model.layers[1].mlp.experts.gate_up_proj) == 64


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v4"])
def test_no_preset_parameter_is_left_constant(preset):
    """Norm weights are drawn around 1 and biases around 0, never at the constant initialisation leaves them at, so a
    kernel that forgets either computes another function; the draw is the same every time."""
    from optiq.models import CONSTANT_SPREAD, constant_parameters

    model = load_model(preset, torch.float32, torch.device("cpu"))
    assert constant_parameters(model) == []
    norm = model.model.norm.weight
    assert (norm != 1).all() and abs(norm.mean().item() - 1) < CONSTANT_SPREAD and norm.std() > CONSTANT_SPREAD / 2
    again = load_model(preset, torch.float32, torch.device("cpu"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_preset_attention_shapes():
    llama = load_config("llama-3.1-8b")
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (32, 8, 128)
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["rope_theta"] == 500000.0
    moe = load_config("qwen3-30b-a3b")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)


def test_presets_are_seeded():
    a = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    b = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.model.layers[0].mlp.up_proj.weight.std() > 0


def test_unknown_model_lists_the_presets():
    with pytest.raises(OptiqError) as info:
        load_config("llama-9000")
    for name in PRESETS:
        assert name in str(info.value)


def test_checkpoint_directory_round_trip(tmp_path):
    """A local checkpoint (real weights via from_pretrained, offline) computes what was saved."""
    original = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    original.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    ids = torch.randint(256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)


def test_checkpoint_directory_without_config(tmp_path):
    with pytest.raises(OptiqError, match="no config.json"):
        load_config(str(tmp_path))


def test_unknown_dtype():
    with pytest.raises(OptiqError, match="unknown dtype"):
        resolve_dtype("fp8", torch.device("cpu"))


def test_a_dtype_the_gpu_cannot_run_is_a_clear_error(monkeypatch):
    """A pre-Ampere GPU has no bf16: said in one line with what to use instead (no GPU needed to check the rule)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(OptiqError, match="Tesla V100-SXM2-32GB cannot run bf16; use --dtype fp16 or fp32"):
        resolve_dtype("bf16", torch.device("cuda"))
    assert resolve_dtype("fp16", torch.device("cuda")) == torch.float16


def test_deepseek_v4_flash_preset_keeps_the_models_widths_and_layer_mix():
    """6 of V4-Flash's 43 layers at DeepseekV4Config's widths: 40.6 B parameters (81 GB in bf16, one H200 with room
    for C = 64), compressed-sparse and heavily-compressed attention alternating, the first three hash-routed."""
    config = load_config("deepseek-v4-flash")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 40.6
    assert config.layer_types.count("compressed_sparse_attention") == config.layer_types.count(
        "heavily_compressed_attention") == 3
    assert config.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3
    assert (config.hidden_size, config.n_routed_experts, config.hc_mult, config.index_topk) == (4096, 256, 4, 512)


def test_routing_tables_are_drawn_as_a_checkpoint_holds_them():
    """DeepSeek-V4's hash-routing table picks distinct experts for each token (initialised to zeros it sends every
    token to expert 0 twice), and its learned routers' score bias is no constant."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.shape == (256, 2) and bool((table[:, 0] != table[:, 1]).all()) and table.unique().numel() == 8
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.unique().numel() == bias.numel() and bias.abs().max() < 0.2
