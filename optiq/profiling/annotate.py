"""Name every decoder layer and module role in the profiler's trace (record_function) and in Nsight (NVTX).

Roles are what an engineer fuses by: ``embed``, ``norm``, ``post_attn_norm``, ``qkv_proj``, ``qk_norm`` (Qwen3's
per-head norms of q and k), ``rope``, ``kv_write``,
``attention``, ``repeat_kv`` (GQA's copy of the KV heads, inside attention), ``kv_expand`` (MLA's latent to keys and
values), ``o_proj``, ``mlp``, ``moe_router``, ``experts``, ``lm_head``, ``sampling``. A range is named
``optiq/layer/<i>`` or ``optiq/role/<role>``; decode steps are ``optiq/step/<n>``. Annotation installs wrappers on the
model's instances for the duration of a ``with annotated(...)`` block and removes them after, so an unannotated model
pays nothing.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch.profiler import record_function

try:  # the nvtx package works on every build; Nsight Systems shows its ranges, torch traces do not
    import nvtx as _nvtx
except ImportError:  # optiq steps aside: record_function ranges still name everything in the torch trace
    _nvtx = None

NVTX_AVAILABLE = _nvtx is not None

# Module attribute names -> role; matched against the last component of each submodule's qualified name.
_ROLE_BY_NAME = {
    "embed_tokens": "embed",
    "input_layernorm": "norm", "norm": "norm",
    "q_norm": "qk_norm", "k_norm": "qk_norm",  # their own role: the attention prologue fuses them with rope
    "post_attention_layernorm": "post_attn_norm",  # its own role: add_rmsnorm fuses this norm only
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "qkv_proj": "qkv_proj",
    # MLA (DeepSeek-V2/V3): q and the compressed KV latent are projections; expanding the latent is its own role
    "q_a_proj": "qkv_proj", "q_b_proj": "qkv_proj", "kv_a_proj_with_mqa": "qkv_proj", "kv_b_proj": "kv_expand",
    "q_a_layernorm": "norm", "kv_a_layernorm": "norm", "shared_experts": "mlp",
    "self_attn": "attention", "o_proj": "o_proj",
    "mlp": "mlp", "gate": "moe_router", "experts": "experts",
    "shared_expert": "mlp", "shared_expert_gate": "moe_router",
    "lm_head": "lm_head",
}


@contextlib.contextmanager
def range_(name: str):
    """One named range in both the torch trace and (when nvtx is installed) Nsight Systems."""
    with record_function(name):
        if _nvtx is None:
            yield
        else:
            with _nvtx.annotate(name, domain="optiq"):
                yield


def _wrap(func, name: str):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with range_(name):
            return func(*args, **kwargs)

    return wrapper


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: its module list as long as the config's layer count (``model.layers`` in most of
    transformers, ``transformer.h`` in GPT-2's family, ``backbone.layers`` in Mamba's), found without names."""
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    return next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), [])


def module_roles(model: torch.nn.Module) -> dict[str, str]:
    """Qualified submodule name -> range name, for decoder layers and every module with a known role."""
    names = {}
    layer_ids = {id(layer): i for i, layer in enumerate(decoder_layers(model))}
    for qualified, module in model.named_modules():
        if id(module) in layer_ids:
            names[qualified] = f"optiq/layer/{layer_ids[id(module)]}"
        elif qualified.rsplit(".", 1)[-1] in _ROLE_BY_NAME and qualified:
            names[qualified] = f"optiq/role/{_ROLE_BY_NAME[qualified.rsplit('.', 1)[-1]]}"
    return names


@contextlib.contextmanager
def annotated(model: torch.nn.Module, engine=None):
    """Within the block, the model's layers and roles (and RoPE, and the engine's cache writes and sampling) emit
    named ranges."""
    patched: list[tuple[object, str, object]] = []  # (owner, attribute, original or None if it was not set)

    def patch(owner, attribute, name):
        original = owner.__dict__.get(attribute)
        patched.append((owner, attribute, original))
        setattr(owner, attribute, _wrap(getattr(owner, attribute), name))

    modules = dict(model.named_modules())
    for qualified, name in module_roles(model).items():
        patch(modules[qualified], "forward", name)
    if engine is not None:
        patch(engine.cache, "update", "optiq/role/kv_write")
        patch(sys.modules[type(engine).__module__], "sample_greedy", "optiq/role/sampling")
    modeling = {type(module).__module__ for module in model.modules()
                if type(module).__module__.startswith("transformers.models.")}
    for module_name in sorted(modeling | {"transformers.integrations.sdpa_attention"}):
        module = sys.modules.get(module_name)
        for function, role in (("apply_rotary_pos_emb", "rope"), ("apply_rotary_emb", "rope"),
                               ("repeat_kv", "repeat_kv")):
            if module is not None and hasattr(module, function):
                patch(module, function, f"optiq/role/{role}")
    try:
        yield
    finally:
        for owner, attribute, original in reversed(patched):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
