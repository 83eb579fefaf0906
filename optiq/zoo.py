"""transformers' causal-LM zoo, each model type shrunk to a config that builds in seconds on a CPU.

``tiny:<model_type>`` names such a model anywhere optiq takes ``--model``: the type's own config class with its
defaults, its widths cut to a few dozen, two layers (or one of each layer type the default config mixes) and a
small sliding window, so that every code path of the architecture (sliding and full attention, experts, shared
experts, MLA) runs at a context of a hundred positions. The weights are drawn like a preset's (models.random_model).

``decoder_only_text_types`` is the part of the zoo optiq is for: causal LMs that are neither encoder-decoders, nor
encoders that can also decode (they have a masked-LM head), nor wrappers around a text model (vision, audio).
"""

from __future__ import annotations

import dataclasses
import re

import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from optiq.errors import OptiqError, first_line

PREFIX = "tiny:"

# Widths every tiny config takes where its class has the field (directly or through its attribute map).
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "sliding_window": 32, "attention_chunk_size": 32,
    "max_position_embeddings": 2048, "first_k_dense_replace": 1, "index_num_heads": 2,
}
LAYERS = 2
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention",  # configs' names
                         "indexed_attention",  # DeepSeek-V3.2's and GLM-MoE-DSA's
                         "compressed_sparse_attention", "heavily_compressed_attention")  # DeepSeek-V4's


def config_value(config, *names: str):
    """The first of ``names`` the config sets to something truthy, or None. Reading a per-layer attribute of a
    heterogeneous config (Gemma-4's head_dim) raises transformers' own error; here it is just not set."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and kin
            value = None
        if value:
            return value
    return None


def not_a_text_decoder(model_type: str) -> str:
    """Why ``model_type`` is not a decoder-only text model, as a sentence ("" if it may be one): unknown to
    transformers, no causal-LM class, an encoder that can also decode (it has a masked-LM head), an encoder-decoder,
    or a wrapper around a text model (vision, audio: its config has sub-configs)."""
    if model_type not in CONFIG_MAPPING:
        return f"transformers {transformers.__version__} knows no model type '{model_type}'"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"'{model_type}' is not a causal language model (transformers has no causal-LM class for it)"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return f"'{model_type}' is an encoder (it has a masked-LM head), not a decoder-only causal LM"
    config_class = CONFIG_MAPPING[model_type]
    if getattr(config_class, "is_encoder_decoder", False):
        return f"'{model_type}' is an encoder-decoder model, not a decoder-only causal LM"
    if getattr(config_class, "sub_configs", None):
        return (f"'{model_type}' wraps a text model in a multimodal one (sub-configs "
                f"{', '.join(config_class.sub_configs)}); use the text model's own checkpoint")
    return ""


def decoder_only_text_types() -> list[str]:
    """The causal-LM model types that are decoder-only text models (``not_a_text_decoder``, and a default config
    that is no encoder-decoder), sorted."""
    kept = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if not_a_text_decoder(model_type):
            continue
        config_class = CONFIG_MAPPING[model_type]
        try:
            default = config_class()
        except Exception:  # noqa: BLE001 - a config that needs arguments is not one a shrunken default can build
            kept.append(model_type)
            continue
        if not getattr(default, "is_encoder_decoder", False):
            kept.append(model_type)
    return kept


def _fields(config_class) -> set[str]:
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    return names | set(getattr(config_class, "attribute_map", {}))


def tiny_config(model_type: str):
    """The config of ``model_type`` shrunk as the module docstring says. A config whose validators reject the tiny
    widths (widths tied to each other in ways TINY does not know) keeps its own widths and gets only two layers and
    the tiny vocabulary."""
    if model_type not in CONFIG_MAPPING:
        raise OptiqError(f"unknown model type '{model_type}': transformers {transformers.__version__} has no config "
                         "for it")
    config_class = CONFIG_MAPPING[model_type]
    try:
        default = config_class()
    except Exception as exc:  # noqa: BLE001 - the config's own validation, in one line
        raise OptiqError(f"{model_type}'s default config does not build: {first_line(exc)}") from None
    fields = _fields(config_class) | set(vars(default))
    widths = {name: value for name, value in TINY.items() if name in fields}
    if config_value(default, "num_experts_per_tok") and "num_experts_per_tok" in widths:
        widths["num_experts_per_tok"] = min(widths["num_experts_per_tok"], default.num_experts_per_tok)
    if config_value(default, "kv_lora_rank"):  # MLA: one KV head per query head, the head_dim its rope's
        widths.update({name: value for name, value in (("num_key_value_heads", TINY["num_attention_heads"]),
                                                       ("head_dim", TINY["qk_rope_head_dim"])) if name in widths})
    if "rotary_dim" in fields and config_value(default, "rotary_dim"):  # GPT-J, CodeGen: rotary dims of a head
        widths["rotary_dim"] = TINY["head_dim"] // 2
    vocab = TINY["vocab_size"]
    depth = {"vocab_size": vocab, **{name: 0 for name in ("pad_token_id", "bos_token_id", "eos_token_id")
                                     if isinstance(config_value(default, name), int)
                                     and config_value(default, name) >= vocab},
             **{name: vocab for name in fields if name.endswith("vocab_size")  # Inkling 2's unpadded_vocab_size:
                and isinstance(config_value(default, name), int)}}  # its LM head's width
    if config_value(default, "attention_types"):  # GPT-Neo: [[pattern, repeats]] must cover the layers
        depth["attention_types"] = [[["global", "local"], LAYERS // 2]]
    default_types = list(config_value(default, "layer_types") or [])
    kinds = list(dict.fromkeys(default_types))
    if kinds == ["linear_attention"]:  # a default of state-space layers only (Bamba, GraniteMoeHybrid), which
        if "attn_layer_indices" in fields:  # their code cannot run: it builds attention masks from the cache
            depth["attn_layer_indices"] = [LAYERS - 1]
        else:
            kinds = ["linear_attention", "full_attention"]
    if config_value(default, "num_kv_shared_layers"):  # Gemma-3n: the last layers reuse the keys and values of
        kinds = kinds * 2  # the last earlier layer of their type, so each type needs a layer that shares and one
        depth["num_kv_shared_layers"] = len(kinds) // 2  # that is shared
    for name in sorted(fields):  # lists of layers by index (Zamba 2's hybrid_layer_ids): the shrunk layers of the
        listed_ids = config_value(default, name)  # types the default's listed layers have
        if name.endswith(("_layer_ids", "_layer_indices")) and isinstance(listed_ids, list) and default_types:
            wanted = {default_types[i] for i in listed_ids if isinstance(i, int) and 0 <= i < len(default_types)}
            depth[name] = [i for i, kind in enumerate(kinds) if kind in wanted]
    sections = [name for name in fields if re.fullmatch(r"n(um)?_\w+_layers", name) and name != "num_hidden_layers"
                and isinstance(config_value(default, name), int)]
    if len(sections) > 1 and sum(getattr(default, name) for name in sections) == default.num_hidden_layers:
        depth.update(dict.fromkeys(sections, 1))  # the stack in sections (Dory's input, looped, output layers):
        kinds = [kinds[i % len(kinds)] for i in range(len(sections))] if kinds else kinds  # one layer each
    # One layer of each type where the config takes a list; where the types follow from offsets and periods
    # (Jamba), as many layers as it takes for each type to appear.
    listed = {**depth, "num_hidden_layers": max(LAYERS, len(kinds)), **({"layer_types": kinds} if len(kinds) > 1
                                                                         else {})}
    patterned = {**depth, "num_hidden_layers": max([LAYERS] + [default_types.index(k) + 1 for k in kinds
                                                               if k in default_types])}
    errors = []
    for shrunk in ({**widths, **listed}, {**widths, **patterned}, listed, patterned):
        try:
            return config_class(**shrunk)
        except Exception as exc:  # noqa: BLE001 - a validator that ties widths together: try fewer changes
            errors.append(first_line(exc))
    raise OptiqError(f"{model_type} does not build from a shrunken config: {errors[0]}")
