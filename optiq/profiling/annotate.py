"""Name every decoder layer and module role in the profiler's trace (record_function) and in Nsight (NVTX).

Roles are what an engineer fuses by: ``embed``, ``norm``, ``post_attn_norm``, ``branch_norm`` (a sandwich layer's
norms around its branches), ``qkv_proj``, ``qk_norm`` (per-head norms of q and k), ``rope``, ``kv_write``,
``attention``, ``repeat_kv`` (GQA's copy of the KV heads, inside attention), ``kv_expand`` (MLA's latent to keys and
values), ``o_proj``, ``mixer`` (a recurrent or linear-attention layer's), ``mlp``, ``moe_router``, ``experts``,
``lm_head``, ``sampling``. Modules get theirs from the module tree's structure (profiling.roles); functions (RoPE,
repeat_kv), the engine's cache writes and sampling by name. A range is named ``optiq/layer/<i>`` or
``optiq/role/<role>``; decode steps are ``optiq/step/<n>``. Annotation installs wrappers on the model's instances for
the duration of a ``with annotated(...)`` block and removes them after, so an unannotated model pays nothing.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch.profiler import record_function

from optiq.profiling.roles import decoder_layers, module_roles

try:  # the nvtx package works on every build; Nsight Systems shows its ranges, torch traces do not
    import nvtx as _nvtx
except ImportError:  # optiq steps aside: record_function ranges still name everything in the torch trace
    _nvtx = None

NVTX_AVAILABLE = _nvtx is not None


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


def module_ranges(model: torch.nn.Module) -> dict[str, str]:
    """Qualified submodule name -> range name, for decoder layers and every module with a role (profiling.roles)."""
    names = {qualified: f"optiq/role/{role}" for qualified, role in module_roles(model).items()}
    qualified_of = {id(module): qualified for qualified, module in model.named_modules()}
    for index, layer in enumerate(decoder_layers(model)):
        names[qualified_of[id(layer)]] = f"optiq/layer/{index}"
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
    for qualified, name in module_ranges(model).items():
        patch(modules[qualified], "forward", name)
    if engine is not None:
        if hasattr(engine.cache, "update"):  # transformers' caches; a model's own state may be written otherwise
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
