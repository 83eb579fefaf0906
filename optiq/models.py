"""Model presets (real architectures' configs with seeded random weights) and local checkpoints.

Presets never download anything: each is a transformers config whose shapes match the named model's published config
(layers, heads, KV heads, head dim, intermediate size, vocabulary, RoPE), with weights drawn from a fixed seed. Decode
speed depends on shapes, not on weight values, so a preset measures what the real model would.

Correctness does depend on the values: transformers initialises norm weights to ones and biases to zeros, and on such
parameters a kernel that forgets the weight or the bias computes the same function, so the validation gate could not
tell. A preset therefore draws every parameter that initialisation leaves constant anew around its constant
(``redraw_constants``): ``c * (1 + CONSTANT_SPREAD * N(0, 1))`` for a nonzero ``c`` (norm weights around 1), ``ZERO_SPREAD
* N(0, 1)`` for zero (biases around 0), from the same seed; no element is left at the constant.

A checkpoint directory is checked before anything is built from it (``checkpoint_config``, ``check_weights``), each
problem one line: config.json must be a regular file of UTF-8 JSON holding an object of at most
``MAX_CONFIG_BYTES``; its ``model_type`` one transformers knows as a decoder-only text model (an encoder such as
BERT, an encoder-decoder or a vision model is refused, saying which it is); no ``auto_map``, since optiq never runs
a checkpoint's own code; every field of the type its config class gives it; at most ``MAX_LAYERS`` layers and
``MAX_EXPERTS`` experts; a model that builds (on the meta device, allocating nothing); and safetensors weights that
are whole (the header's tensors all within the file) and hold at least the model's parameters, so that a truncated
or mismatched file is not loaded half random.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from transformers import (CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, DeepseekV2Config, DeepseekV4Config,
                          Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, PretrainedConfig, Qwen3Config,
                          Qwen3MoeConfig)

from optiq import zoo
from optiq.errors import OptiqError, first_line

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# DeepSeek-V4's parts at widths a CPU runs in seconds: windows small enough (2 and 4 tokens) that a short prompt
# closes several and the indexer keeps 4 of them.
_TINY_V4 = dict(
    hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, q_lora_rank=48, o_groups=2,
    o_lora_rank=40, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=3, index_head_dim=16, index_topk=4,
    sliding_window=8, vocab_size=256, max_position_embeddings=2048,
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})

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
    # One layer of each of DeepSeek-V4's attention types, hash and learned routing.
    "tiny-deepseek-v4": lambda: DeepseekV4Config(
        **_TINY_V4, num_hidden_layers=3,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"]),
    # deepseek-v4-flash's relation to its published model at tiny-deepseek-v4's widths, for the tests of the
    # whole-model estimate: 2 of the 7 layers DeepseekV4Config lays out by default (PUBLISHED), one kind of the
    # seven's (heavily compressed attention with learned routing) missing from the two.
    "tiny-deepseek-v4-flash": lambda: DeepseekV4Config(
        **_TINY_V4, num_hidden_layers=2, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"]),
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
    # Shapes of deepseek-ai/DeepSeek-V4-Flash (DeepseekV4Config's defaults: hidden 4096, 64 heads of 512 sharing one
    # KV head, mHC with 4 streams, 256 experts of 2048 with 6 per token, CSA every 4 tokens with a 512-entry indexer,
    # HCA every 128), 6 of its 43 layers so that one H200 holds them with C = 64's cache: 3 compressed-sparse and 3
    # heavily-compressed attention layers, the first 3 hash-routed as the model's are.
    "deepseek-v4-flash": lambda: DeepseekV4Config(
        num_hidden_layers=6, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"] * 3,
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3),
}


class Published(NamedTuple):
    """The published model a preset stands for where the preset holds only some of its layers: its name, and its
    config at full depth (the preset's widths, the model's own layer mix)."""
    name: str
    config: Callable[[], PretrainedConfig]


# Presets that hold some of a deeper published model's layers: bench measures the preset, profiles its layers and
# extrapolates the step to the published depth beside that model's floor (optiq.measure.depth).
PUBLISHED = {
    "deepseek-v4-flash": Published("DeepSeek-V4-Flash", DeepseekV4Config),  # its defaults: 43 layers, 23 HCA + 20 CSA
    "tiny-deepseek-v4-flash": Published("a tiny DeepSeek-V4",
                                        lambda: DeepseekV4Config(**_TINY_V4, num_hidden_layers=7)),
}

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}

SEED = 0
MAX_CONFIG_BYTES = 16 << 20  # the largest config.json read: real ones are a few KB (a label map makes some ~1 MB)
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on a file's JSON header
MAX_LAYERS = 1024  # the deepest model a config may describe (the largest published ones have ~200 layers)
MAX_EXPERTS = 4096  # routed experts a layer (published MoEs have up to a few hundred)
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
    if spec.strip() and path.is_dir():  # Path("") is the working directory
        return checkpoint_config(path)
    raise OptiqError(f"unknown model '{spec}': not a preset ({', '.join(PRESETS)}), {zoo.PREFIX}<model type> "
                     "nor a checkpoint directory")


def _read_config(path: Path) -> dict:
    """config.json's object, or a one-line reason it is not one (module docstring). Its kind is checked before it is
    opened: a FIFO would wait for a writer."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise OptiqError(f"{path} is not a regular file")
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise OptiqError(f"checkpoint directory {path.parent} has no config.json") from None
    except OSError as exc:
        raise OptiqError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise OptiqError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a model's config is a few KB")
    if not data.strip():
        raise OptiqError(f"{path} is empty")
    try:
        config = json.loads(data.decode())
    except UnicodeDecodeError as exc:
        raise OptiqError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise OptiqError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise OptiqError(f"{path} is not valid JSON (nested too deeply)") from None
    if not isinstance(config, dict):
        raise OptiqError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config


def _json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _mistyped(data: dict, default) -> str:
    """The first field of ``data`` whose value is not of the type its config class's default has, as a sentence
    ("" if none is): a boolean stays a boolean, a string a string, a number a number (an integer one where the
    default is an integer; token ids may also be lists of them). Fields without a default value (None, lists,
    objects) are the model's own to check."""
    for key, value in data.items():
        try:
            expected = getattr(default, key, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute that raises when read as one value
            continue
        if expected is None or value is None:
            continue
        if isinstance(expected, bool):
            ok = isinstance(value, bool)
        elif isinstance(expected, int) and key.endswith("token_id"):
            ok = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
        elif isinstance(expected, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
                isinstance(expected, float) or float(value).is_integer())
        elif isinstance(expected, str):
            ok = isinstance(value, str)
        else:
            continue
        if not ok:
            kind = "an integer" if type(expected) is int else _json_type(expected)
            shown = json.dumps(value)
            return f"field '{key}' must be {kind}, not {shown if len(shown) <= 40 else shown[:40] + '...'}"
    return ""


def checkpoint_config(path: Path):
    """The transformers config of checkpoint directory ``path``, checked as the module docstring says, its model
    built on the meta device to prove the config describes one."""
    file = path / "config.json"
    data = _read_config(file)
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise OptiqError(f"{file} has no model_type (a string such as \"llama\"), so no architecture to build")
    if "auto_map" in data:
        raise OptiqError(f"{file} has an auto_map: the checkpoint brings its own model code, and optiq never runs "
                         "a checkpoint's code; use a model type transformers has")
    problem = zoo.not_a_text_decoder(model_type)
    if problem:
        raise OptiqError(f"{file}: {problem}; optiq measures decoder-only text models")
    config_class = CONFIG_MAPPING[model_type]
    try:
        default = config_class()
    except Exception:  # noqa: BLE001 - a config class that needs arguments has no defaults to compare with
        default = None
    problem = _mistyped(data, default) if default is not None else ""
    if problem:
        raise OptiqError(f"{file}: {problem}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the config class's own validation, in one line
        raise OptiqError(f"{file} does not make a {model_type} config: {type(exc).__name__}: {first_line(exc)}") \
            from None
    if getattr(config, "is_encoder_decoder", False):
        raise OptiqError(f"{file}: this {model_type} is an encoder-decoder model; optiq measures decoder-only text "
                         "models")
    layers = zoo.config_value(config, "num_hidden_layers")
    if not isinstance(layers, int) or not 0 < layers <= MAX_LAYERS:
        raise OptiqError(f"{file}: num_hidden_layers must be an integer from 1 to {MAX_LAYERS}, not {layers!r}")
    experts = zoo.config_value(config, "num_experts", "num_local_experts", "n_routed_experts")
    if experts is not None and not (isinstance(experts, int) and experts <= MAX_EXPERTS):
        raise OptiqError(f"{file}: the number of experts must be an integer up to {MAX_EXPERTS}, not {experts!r}")
    return config


def parameters_on_meta(config) -> int:
    """The number of parameters of the causal LM ``config`` describes, counted on the meta device (nothing is
    allocated); a config its model cannot be built from is a one-line error."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - the architecture's own constructor: one line, not its traceback
        raise OptiqError(f"{config.model_type} does not build from its config: {type(exc).__name__}: "
                         f"{first_line(exc)}") from None
    return sum(p.numel() for p in model.parameters())


def _safetensors_elements(path: Path) -> int:
    """The number of elements the tensors of a safetensors file hold, after checking the file is whole: a header
    that fits, of JSON, whose tensors all lie within the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            (header_len,) = struct.unpack("<Q", file.read(8))
            if not 0 < header_len <= min(MAX_SAFETENSORS_HEADER, size - 8):
                raise OptiqError(f"{path} is not a safetensors file, or is truncated (header of {header_len} bytes in "
                                 f"a file of {size})")
            header = json.loads(file.read(header_len))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise OptiqError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise OptiqError(f"{path} is not a safetensors file (its header is not a JSON object)")
    elements, end = 0, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            elements += math.prod(int(n) for n in entry["shape"])
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise OptiqError(f"{path} is not a safetensors file (tensor {name[:60]!r} has no shape and offsets)") \
                from None
    if 8 + header_len + end > size:
        raise OptiqError(f"{path} is truncated: its tensors need {8 + header_len + end} bytes, the file has {size}")
    return elements


def check_weights(path: Path, config) -> None:
    """A checkpoint's safetensors weights are whole and hold at least the parameters its config describes
    (``_safetensors_elements``; shards through model.safetensors.index.json). Other formats are left to
    transformers' loader; a quantized checkpoint (fewer elements than parameters by design) is not counted."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError,
                AttributeError):
            raise OptiqError(f"{index} is not a safetensors index (an object with a weight_map)") from None
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return
    missing = [shard for shard in shards if not isinstance(shard, str) or not (path / shard).is_file()]
    if missing:
        raise OptiqError(f"checkpoint {path} lacks the weight file {str(missing[0])[:80]} its index names")
    elements = sum(_safetensors_elements(path / shard) for shard in shards)
    needed = parameters_on_meta(config)
    if elements < needed and not getattr(config, "quantization_config", None):
        raise OptiqError(f"checkpoint {path}: its weights hold {elements:,} values, but its config.json describes a "
                         f"model of {needed:,} parameters")


def learned_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and the float buffers a checkpoint holds (persistent ones: DeepSeek-V3's selection
    bias, not a rotary table it recomputes), by name."""
    persistent = model.state_dict(keep_vars=True).keys()
    buffers = {name: b for name, b in model.named_buffers() if b.is_floating_point() and name in persistent}
    return {**dict(model.named_parameters()), **buffers}


def constant_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the learned tensors (``learned_tensors``) whose elements are all one value (initialisation's ones
    and zeros; a selection bias that starts at zero); one of one element (mHC's scales) when it holds exactly 0 or
    1."""
    return [name for name, param in learned_tensors(model).items() if _is_constant(param)
            and (param.numel() > 1 or param.item() in (0.0, 1.0))]


def _is_constant(tensor: torch.Tensor) -> bool:
    """Every element one value (an empty tensor holds none)."""
    return tensor.numel() > 0 and bool((tensor == tensor.flatten()[0]).all())


@torch.no_grad()
def redraw_constants(model: torch.nn.Module, seed: int = SEED) -> list[str]:
    """Draw every constant parameter anew around its constant (module docstring), on the parameter's device and in
    its dtype, from ``seed``; returns their names."""
    generator = torch.Generator().manual_seed(seed)
    names = constant_parameters(model)
    params = learned_tensors(model)
    for name in names:
        param = params[name]
        param.copy_(_around(param.flatten()[0].item(), param.shape, generator).to(param.dtype))
    return names


def _around(constant: float, shape, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    return constant * (1 + CONSTANT_SPREAD * noise) if constant else ZERO_SPREAD * noise


@torch.no_grad()
def draw_routing_tables(model: torch.nn.Module, seed: int = SEED) -> list[str]:
    """Draw the routing buffers that initialisation leaves constant, as a checkpoint would hold them; returns their
    names. A hash-routing table (an integer buffer [vocabulary, experts per token], DeepSeek-V4's ``tid2eid``) at
    zero sends every token to expert 0 as many times as it picks experts, so a kernel that mixed up the picks could
    not be told apart: each token gets distinct random experts. A per-expert score bias (a float buffer as long as
    the expert count, DeepSeek-V3's ``e_score_correction_bias``) is drawn around its constant as a parameter is."""
    config = model.config.get_text_config(decoder=True)
    experts = zoo.config_value(config, "num_experts", "num_local_experts", "n_routed_experts")
    per_token = zoo.config_value(config, "num_experts_per_tok")
    vocab = zoo.config_value(config, "vocab_size")
    if not (experts and per_token):
        return []
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for name, buffer in model.named_buffers():
        if not _is_constant(buffer):
            continue
        if not buffer.is_floating_point() and tuple(buffer.shape) == (vocab, per_token):
            value = torch.rand(vocab, experts, generator=generator).argsort(dim=1)[:, :per_token]
        elif buffer.is_floating_point() and tuple(buffer.shape) == (experts,):
            value = _around(buffer.flatten()[0].item(), buffer.shape, generator)
        else:
            continue
        buffer.copy_(value.to(buffer.dtype))
        drawn.append(name)
    return drawn


@contextmanager
def constants_redrawn(model: torch.nn.Module, seed: int = SEED):
    """The model with its constant parameters redrawn (``redraw_constants``) for the block, then put back."""
    params = learned_tensors(model)
    kept = {name: params[name].detach().clone() for name in constant_parameters(model)}
    redraw_constants(model, seed)
    try:
        yield list(kept)
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                params[name].copy_(value)


def free_bytes(device: torch.device) -> int:
    """Bytes ``device`` can still allocate: the GPU's free memory, or the host's available memory (Linux's
    MemAvailable: free pages and the caches it can drop)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def random_model(config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model of ``config`` in eval mode on ``device``, with weights drawn from the fixed seed and none left
    constant (``redraw_constants``), routing tables included (``draw_routing_tables``). A model whose weights
    cannot fit in the memory ``device`` has free is a one-line error before anything is allocated, not the
    kernel's out-of-memory kill."""
    try:
        needed = parameters_on_meta(config) * dtype.itemsize
    except OptiqError:  # a model the meta device cannot build: its real build below says why, in its own words
        needed = 0
    if needed > (free := free_bytes(device)):
        raise OptiqError(f"{config.model_type}'s weights take {needed / 2**30:.1f} GiB in {str(dtype)[6:]}, more "
                         f"than the {free / 2**30:.1f} GiB free on {device}")
    torch.manual_seed(SEED)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    except Exception as exc:  # noqa: BLE001 - the architecture's own constructor: one line, not its traceback
        raise OptiqError(f"{config.model_type} does not build: {type(exc).__name__}: {first_line(exc)}") from None
    redraw_constants(model)
    draw_routing_tables(model)
    return model


def load_model(spec: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model in eval mode on ``device``: seeded random weights for a preset, real ones for a checkpoint."""
    config = load_config(spec)
    if is_random(spec):
        model = random_model(config, dtype, device)
    else:
        check_weights(Path(spec), config)
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, config=config, dtype=dtype,
                                                         local_files_only=True).to(device)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers' loader: one line, not its traceback
            raise OptiqError(f"cannot load checkpoint {spec}: {type(exc).__name__}: {first_line(exc)}") from None
    return model.eval()
