"""Model presets (real architectures' configs with seeded random weights) and local checkpoints.

Presets never download anything: each is a transformers config whose shapes match the named model's published config
(layers, heads, KV heads, head dim, intermediate size, vocabulary, RoPE), with weights drawn from a fixed seed. Decode
speed depends on shapes, not on weight values, so a preset measures what the real model would.

Correctness does depend on the values: transformers initialises norm weights to ones and biases to zeros, and on such
parameters a kernel that forgets the weight or the bias computes the same function, so the validation gate could not
tell. A preset therefore draws every parameter that initialisation leaves constant anew around its constant
(``redraw_constants``): ``c * (1 + CONSTANT_SPREAD * N(0, 1))`` for a nonzero ``c`` (norm weights around 1), ``ZERO_SPREAD
* N(0, 1)`` for zero (biases around 0), from the same seed; no element is left at the constant.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, DeepseekV2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig)

from optiq import zoo
from optiq.errors import OptiqError, first_line

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS = {
    # For tests: seconds on a CPU, same code paths as the real architectures.
    "tiny-llama": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-qwen3-moe": lambda: Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=256,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-deepseek-v2": lambda: DeepseekV2Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        vocab_size=256, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Shapes of Qwen/Qwen3-0.6B.
    "qwen3-0.6b": lambda: Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Shapes of meta-llama/Llama-3.2-1B.
    "llama-3.2-1b": lambda: LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}),
    # Shapes of meta-llama/Llama-3.1-8B.
    "llama-3.1-8b": lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}),
    # Shapes of Qwen/Qwen3-30B-A3B: 48 layers, 128 experts, 8 active per token.
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Shapes of google/gemma-3-1b: 26 layers, five sliding-window (512) layers to one global, one KV head of 256, GeGLU,
    # a 262k vocabulary tied to the LM head (rope bases: the config's defaults, 10k local and 1M global).
    "gemma-3-1b": lambda: Gemma3TextConfig(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True),
    # Shapes of microsoft/Phi-3-mini-4k-instruct: fused qkv_proj and gate_up_proj, 32 heads without GQA.
    "phi-3-mini": lambda: Phi3Config(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Shapes of mistralai/Mistral-7B-v0.3 (no sliding window).
    "mistral-7b": lambda: MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Shapes of deepseek-ai/DeepSeek-V2-Lite: MLA (512-wide compressed KV latent + 64-wide shared rope key, no q
    # compression), 27 layers of which the first is dense, 64 routed experts (6 per token) and 2 shared ones.
    "deepseek-v2-lite": lambda: DeepseekV2Config(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False,
        vocab_size=102400, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707}),
}

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}

SEED = 0
CONSTANT_SPREAD = 0.1  # relative spread of a redrawn nonzero constant: norm weights in about 0.7..1.3
ZERO_SPREAD = 0.02  # absolute spread of a redrawn zero, as transformers' initializer_range draws weights


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_preset(device: torch.device) -> str:
    """The model ``optiq profile`` and ``optiq apply-fusion`` use with no ``--model``: real-sized on a GPU."""
    return "qwen3-0.6b" if device.type == "cuda" else "tiny-llama"


def default_dtype(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in DTYPES:
        raise OptiqError(f"unknown dtype '{name}'; choose one of: {', '.join(sorted(set(DTYPES)))}")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise OptiqError(f"{torch.cuda.get_device_name(device)} cannot run bf16; use --dtype fp16 or fp32")
    return dtype


def is_random(spec: str) -> bool:
    """Whether ``spec`` names a model of seeded random weights (a preset or a tiny zoo config), not a checkpoint."""
    return spec in PRESETS or spec.startswith(zoo.PREFIX)


def load_config(spec: str):
    """A preset name, ``tiny:<model_type>`` (optiq.zoo) or a checkpoint directory -> its transformers config."""
    if spec in PRESETS:
        return PRESETS[spec]()
    if spec.startswith(zoo.PREFIX):
        return zoo.tiny_config(spec.removeprefix(zoo.PREFIX))
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise OptiqError(f"checkpoint directory {spec} has no config.json")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    raise OptiqError(f"unknown model '{spec}': not a preset ({', '.join(PRESETS)}), {zoo.PREFIX}<model type> "
                     "nor a checkpoint directory")


def constant_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the parameters whose elements are all one value (initialisation's ones and zeros)."""
    return [name for name, param in model.named_parameters() if bool((param == param.flatten()[0]).all())]


@torch.no_grad()
def redraw_constants(model: torch.nn.Module, seed: int = SEED) -> list[str]:
    """Draw every constant parameter anew around its constant (module docstring), on the parameter's device and in
    its dtype, from ``seed``; returns their names."""
    generator = torch.Generator().manual_seed(seed)
    names = constant_parameters(model)
    params = dict(model.named_parameters())
    for name in names:
        param = params[name]
        constant = param.flatten()[0].item()
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        drawn = constant * (1 + CONSTANT_SPREAD * noise) if constant else ZERO_SPREAD * noise
        param.copy_(drawn.to(param.dtype))
    return names


@contextmanager
def constants_redrawn(model: torch.nn.Module, seed: int = SEED):
    """The model with its constant parameters redrawn (``redraw_constants``) for the block, then put back."""
    params = dict(model.named_parameters())
    kept = {name: params[name].detach().clone() for name in constant_parameters(model)}
    redraw_constants(model, seed)
    try:
        yield list(kept)
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                params[name].copy_(value)


def random_model(config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model of ``config`` in eval mode on ``device``, with weights drawn from the fixed seed and none left
    constant (``redraw_constants``)."""
    torch.manual_seed(SEED)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    except Exception as exc:  # noqa: BLE001 - the architecture's own constructor: one line, not its traceback
        raise OptiqError(f"{config.model_type} does not build: {type(exc).__name__}: {first_line(exc)}") from None
    redraw_constants(model)
    return model


def load_model(spec: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model in eval mode on ``device``: seeded random weights for a preset, real ones for a checkpoint."""
    config = load_config(spec)
    if is_random(spec):
        model = random_model(config, dtype, device)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, local_files_only=True).to(device)
        except OSError as exc:
            raise OptiqError(f"cannot load checkpoint {spec}: {str(exc).splitlines()[0]}") from None
    return model.eval()
