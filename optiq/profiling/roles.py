"""Module roles from the shape of the module tree, not from what its classes or attributes are called, so that a model
optiq was never fitted to (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``, a user's own names) is attributed as Llama is.

A decoder layer's children are its norms (a weight vector, perhaps a bias, and an eps), and the parts that compute
with weight matrices: the first is the token mixer, the last (when there are two or more) the MLP. The mixer is
attention unless the config says its layer is of another kind, or it holds a convolution (state-space and
linear-attention mixers do; they are ``mixer``). Inside attention, the last registered projection that writes the
hidden size is ``o_proj``, one that reads the compressed KV latent (MLA) ``kv_expand``, the others ``qkv_proj``, a
norm a head wide ``qk_norm``. Inside the MLP, a module holding one weight per expert (a 3-D parameter, or a module
list as long as the expert count) is ``experts``, a matrix with a row per expert ``moe_router``, a dense MLP beside
them (shared experts) ``mlp``. Of a layer's norms the first is ``norm``; with exactly two, the second is
``post_attn_norm`` (the norm after the residual add that add_rmsnorm fuses); with more (Gemma's and GLM-4's
four: a norm on each side of each branch), the others are ``branch_norm``, which sandwich_norm fuses with the adds,
and so are both of a post-norm layer's two (OLMo 2's, each after its branch: no input norm, as
``structure.sandwich_norm_decoder_layer`` finds it).

Hyper-connections (DeepSeek-V4's mHC) keep several residual streams: a module whose own weight matrix reads all of
them (an input width that is a multiple of the hidden size) is ``mhc``, wherever it sits, and is neither the layer's
mixer nor its MLP. Inside attention a sub-block with projections of its own (DeepSeek-V4's compressor, the indexer
of V3.2 and V4) is one role for all it holds: ``indexer`` where it writes the indexer's heads
(``index_n_heads`` x ``index_head_dim``), and so is every sub-block inside it (V4's scorer, which a decode step on
optiq's static cache calls without the indexer's forward), else ``compressor`` when the config compresses the KV
(``compress_rates``), else part of ``attention``; the grouped half of a grouped output projection (writing
``o_groups`` x ``o_lora_rank``) is ``o_proj`` as the projection after it is.
"""

from __future__ import annotations

import torch

from optiq.patching.structure import EPS_ATTRIBUTES, sandwich_norm_decoder_layer
from optiq.zoo import ATTENTION_LAYER_TYPES, config_value


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: its module list as long as the config's layer count (``model.layers`` in most of
    transformers, ``transformer.h`` in GPT-2's family, ``backbone.layers`` in Mamba's)."""
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    return next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), [])


def is_norm(module: torch.nn.Module) -> bool:
    """A normalisation: torch's LayerNorm or RMSNorm, or any leaf module whose parameters are a weight vector (and
    perhaps a bias) and which keeps an eps."""
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return True
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"} or next(module.children(), None):
        return False
    return any(type(getattr(module, name, None)) in (int, float) for name in EPS_ATTRIBUTES)


def _is_projection(module: torch.nn.Module) -> bool:
    """A weight matrix applied to activations: nn.Linear, GPT-2's Conv1D, any leaf with a 2-D weight that is not an
    embedding."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return (next(module.children(), None) is None and weight is not None and weight.dim() == 2
            and not isinstance(module, torch.nn.Embedding))


def _computes(module: torch.nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def is_stream_mixer(module: torch.nn.Module, hidden: int) -> bool:
    """A hyper-connection: a module without child projections whose own weight matrix reads several residual
    streams of the hidden size at once (its input width k * hidden, k >= 2)."""
    own = [p for p in module.parameters(recurse=False) if p.dim() == 2]
    return bool(own) and not any(_is_projection(m) for m in module.modules()) and all(
        p.shape[1] % hidden == 0 and p.shape[1] >= 2 * hidden for p in own)


def module_roles(model: torch.nn.Module) -> dict[str, str]:
    """Qualified submodule name -> role, for every module whose role the structure shows (module docstring)."""
    config = model.config.get_text_config(decoder=True)
    names = {id(module): qualified for qualified, module in model.named_modules()}
    roles: dict[str, str] = {}
    for module, role in ((model.get_input_embeddings(), "embed"), (model.get_output_embeddings(), "lm_head")):
        if module is not None and id(module) in names:
            roles[names[id(module)]] = role
    layer_types = list(config_value(config, "layer_types") or [])
    for index, layer in enumerate(decoder_layers(model)):
        kind = layer_types[index] if index < len(layer_types) else "attention"
        _layer_roles(layer, names[id(layer)], kind, config, roles)
    inside_layers = tuple(f"{names[id(layer)]}." for layer in decoder_layers(model))
    hidden = config_value(config, "hidden_size")
    for qualified, module in model.named_modules():
        if qualified and qualified not in roles and not qualified.startswith(inside_layers):
            if is_norm(module):
                roles[qualified] = "norm"  # the final norm
            elif hidden and is_stream_mixer(module, hidden):
                roles[qualified] = "mhc"  # the streams' last collapse, before the final norm
    return roles


def _layer_roles(layer: torch.nn.Module, prefix: str, kind: str, config, roles: dict[str, str]) -> None:
    children = list(layer.named_children())
    norms = [name for name, child in children if is_norm(child)]
    hidden = config_value(config, "hidden_size")
    mixers = [name for name, child in children if hidden and is_stream_mixer(child, hidden)]
    for name in mixers:
        roles[f"{prefix}.{name}"] = "mhc"
    parts = [(name, child) for name, child in children if name not in norms + mixers and _computes(child)]
    post_norm = len(norms) == 2 and (site := sandwich_norm_decoder_layer(layer)) is not None and not site.input
    for position, name in enumerate(norms):
        roles[f"{prefix}.{name}"] = ("branch_norm" if post_norm or position and len(norms) > 2 else
                                     "norm" if position == 0 else "post_attn_norm")
    if not parts:
        return
    mixer_name, mixer = parts[0]
    is_attention = kind in ATTENTION_LAYER_TYPES and not any(isinstance(m, torch.nn.Conv1d) for m in mixer.modules())
    if is_attention:
        roles[f"{prefix}.{mixer_name}"] = "attention"
        _attention_roles(mixer, f"{prefix}.{mixer_name}", config, roles)
    else:
        roles[f"{prefix}.{mixer_name}"] = "mixer"
    if len(parts) >= 2:
        mlp_name, mlp = parts[-1]
        roles[f"{prefix}.{mlp_name}"] = "mlp"
        _mlp_roles(mlp, f"{prefix}.{mlp_name}", config, roles)


def _widths(module: torch.nn.Module) -> tuple[int, int]:
    """(input, output) width of a projection: nn.Linear's, GPT-2's Conv1D (weight stored [in, out]) or a weight's."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    if hasattr(module, "nx"):
        return module.nx, module.nf
    return module.weight.shape[1], module.weight.shape[0]


def _sub_block_role(block: torch.nn.Module, outermost: bool, config) -> str | None:
    """The role of a sub-block of attention (module docstring), or None where it is part of what encloses it."""
    indexer_width = (config_value(config, "index_n_heads") or 0) * (config_value(config, "index_head_dim") or 0)
    nested = {id(m) for _, child in _sub_blocks(block) for m in child.modules()}
    own = [m for m in block.modules() if _is_projection(m) and id(m) not in nested]
    if indexer_width and any(_widths(m)[1] == indexer_width for m in own):
        return "indexer"
    return "compressor" if outermost and config_value(config, "compress_rates", "compress_ratios") else None


def _sub_blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The children of ``module`` that hold projections of their own below them (not a projection or a norm)."""
    return [(name, child) for name, child in module.named_children()
            if next(child.children(), None) is not None and any(_is_projection(m) for m in child.modules())]


def _attention_roles(attn: torch.nn.Module, prefix: str, config, roles: dict[str, str]) -> None:
    pending = [(name, child, True, None) for name, child in _sub_blocks(attn)]
    inside: set[int] = set()  # the modules of sub-blocks: their projections and norms are the sub-block's
    while pending:
        name, block, outermost, enclosing = pending.pop()
        inside.update(id(m) for m in block.modules())
        role = "indexer" if enclosing == "indexer" else _sub_block_role(block, outermost, config)
        if role:
            roles[f"{prefix}.{name}"] = role
        pending.extend((f"{name}.{child_name}", child, False, role) for child_name, child in _sub_blocks(block))
    projections = [(name, m) for name, m in attn.named_modules() if name and _is_projection(m) and id(m) not in inside]
    latent = config_value(config, "kv_lora_rank")
    head_dim = config_value(config, "head_dim", "qk_head_dim")
    hidden = config_value(config, "hidden_size")
    grouped_width = (config_value(config, "o_groups") or 0) * (config_value(config, "o_lora_rank") or 0)
    # o_proj writes the residual stream: of the projections as wide as it, the one registered last (Llama's q_proj is
    # as wide too; Phi-3 registers o_proj before qkv_proj)
    back = [name for name, m in projections if _widths(m)[1] == hidden] or [name for name, _ in projections[1:]]
    for name, module in projections:
        if back and name == back[-1]:
            role = "o_proj"
        elif grouped_width and _widths(module)[1] == grouped_width:
            role = "o_proj"  # the grouped half of a grouped output projection, which feeds the other
        elif latent and _widths(module)[0] == latent:
            role = "kv_expand"
        else:
            role = "qkv_proj"
        roles[f"{prefix}.{name}"] = role
    for name, module in attn.named_modules():
        if name and id(module) not in inside and is_norm(module):
            weight = getattr(module, "weight", None)  # None: a norm without a learned scale
            per_head = head_dim and weight is not None and weight.shape[0] == head_dim
            roles[f"{prefix}.{name}"] = "qk_norm" if per_head else "norm"


def _mlp_roles(mlp: torch.nn.Module, prefix: str, config, roles: dict[str, str]) -> None:
    experts = config_value(config, "num_experts", "num_local_experts", "n_routed_experts")
    if not experts:
        return
    found_experts = []
    for name, module in mlp.named_modules():
        if not name or any(name.startswith(f"{e}.") for e in found_experts):
            continue
        holds_experts = (isinstance(module, torch.nn.ModuleList) and len(module) == experts) or any(
            p.dim() >= 3 for p in module.parameters(recurse=False))
        if holds_experts:
            roles[f"{prefix}.{name}"] = "experts"
            found_experts.append(name)
            continue
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None and weight.dim() == 2 and weight.shape[0] == experts:
            roles[f"{prefix}.{name}"] = "moe_router"
        elif "." not in name and _computes(module) and not _is_projection(module):
            roles[f"{prefix}.{name}"] = "mlp"  # a dense MLP beside the experts (shared experts)
