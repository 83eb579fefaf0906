"""The patch kinds, one class each: everything optiq does differently for a recipe's ``[patch] kind`` is here.

A kind says which ``[patch]`` field names its target, what a recipe of that kind takes over (two recipes that claim
the same place cannot both be applied), how it finds its sites in a model and builds their replacements from the
recipe's factory (``optiq.patching.replacements`` documents the factories' signatures), and, for the validation
gate, how a site's path is called on captured arguments and how the original path records them.

A kind raises ValueError from ``sites`` when the model is outside what it can patch; the recipe is then reported as
not applicable with that message. Factories are the user's code: each call goes through ``user_code.run``, so that
whatever one raises (a ValueError too) fails the recipe instead (``Patches.failed``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import TYPE_CHECKING, Any, Callable

from optiq.patching.changes import Change, Site, set_attribute, set_item, together
from optiq.patching.structure import NARROWS, STRUCTURES, takes_first
from optiq.patching.user_code import run

if TYPE_CHECKING:
    import torch

    from optiq.catalog.recipes import Recipe


class PatchKind:
    name: str  # the value of ``[patch] kind``
    target_field: str  # the ``[patch]`` field naming what it patches
    many_targets: bool = False  # whether that field is a list
    unit: str  # what its sites are, as counted in a summary
    narrows_by_name: bool = False  # whether ``[patch] names`` may narrow it to the sites under those names
    factory_arguments: tuple[str, str]  # what its factory is called with, in order

    def claims(self, recipe: Recipe) -> tuple[tuple[str, str], ...]:
        """What the recipe takes over, as (what, name) pairs."""
        raise NotImplementedError

    def sites(self, model: torch.nn.Module, recipe: Recipe, fusion: Callable, factory: Callable) -> list[Site]:
        raise NotImplementedError

    def has_site(self, model: torch.nn.Module, recipe: Recipe) -> bool:
        """Whether the recipe could patch something in the model, found without building a replacement (so a
        proposal names only recipes that can apply); True where only patching can tell."""
        return True

    def call(self, path: Any) -> Callable:
        """A site's path (original, replacement or reference) as one callable of the arguments ``recorder`` saved."""
        return path

    def input_scales(self, replacement: Any, args: tuple, kwargs: dict) -> tuple[float, ...]:
        """The powers of two the gate also runs a captured call at, with its activations scaled (``gate.per_recipe``):
        those the replacement names as ``input_scales``, a tuple or a function of the call, where its variant lives
        at activations the model's own never reach."""
        scales = getattr(replacement, "input_scales", ())
        return tuple(scales(*args, **kwargs) if callable(scales) else scales)

    def recorder(self, original: Any, calls: list, copy: Callable) -> Any:
        """The original path, appending ``copy((args, kwargs))`` of its inputs to ``calls`` at each call."""
        def record(*args, **kwargs):
            calls.append(copy((args, kwargs)))
            return original(*args, **kwargs)
        return record


class ModuleForward(PatchKind):
    """Instances of module classes get a new ``forward`` (``factory(module, fusion) -> forward``); ``modules = ["*"]``
    with ``[patch] structure`` takes every module that computes that structure (``optiq.patching.structure``),
    whatever its class; ``[patch] names`` narrows it to the instances under those attribute names."""

    name, target_field, many_targets, unit, narrows_by_name = "module_forward", "modules", True, "modules", True
    factory_arguments = ("module", "fusion")

    def claims(self, recipe):
        if recipe.patch_structure:
            return (("module structure", NARROWS.get(recipe.patch_structure, recipe.patch_structure)),)
        return tuple(("module class", target) for target in recipe.patch_target)

    def _targets(self, model, recipe):
        """(name, module) of every module the recipe's classes, names and structure take."""
        computes = STRUCTURES[recipe.patch_structure] if recipe.patch_structure else lambda module: True
        for name, module in model.named_modules():
            if ("*" in recipe.patch_target or type(module).__name__ in recipe.patch_target) and (
                    not recipe.patch_names or name.rsplit(".", 1)[-1] in recipe.patch_names) and computes(module):
                yield name, module

    def sites(self, model, recipe, fusion, factory):
        found = []
        for name, module in self._targets(model, recipe):
            label = name or type(module).__name__
            found.append(Site(label, module.forward, run(f"patch.with on {label}", factory, module, fusion),
                              lambda fn, module=module: set_attribute(module, "forward", fn)))
        return found

    def has_site(self, model, recipe):
        return next(self._targets(model, recipe), None) is not None


class Function(PatchKind):
    """A module-level function is replaced (``factory(original, fusion) -> function``): a bare name, in every
    modeling module that defines one of the model's classes (one for a plain LM); ``package.module:name``, in that
    module (optiq's decode engine looks its sampler up so, at every step)."""

    name, target_field, unit = "function", "function", "functions"
    factory_arguments = ("original", "fusion")

    def claims(self, recipe):
        return (("function", recipe.patch_target[0]),)

    def sites(self, model, recipe, fusion, factory):
        module_name, name, leading = _function_target(recipe.patch_target[0])
        if module_name:
            namespaces = [run(f"importing {module_name}", importlib.import_module, module_name)]
        else:
            namespaces = sorted({sys.modules[type(m).__module__] for m in model.modules()}, key=lambda ns: ns.__name__)
        found = []
        for namespace in (ns for ns in namespaces if callable(vars(ns).get(name))):
            original = _plain_function(vars(namespace)[name])
            if leading and not takes_first(original, leading):
                continue
            label = f"{namespace.__name__}.{name}"
            found.append(Site(label, original, run(f"patch.with on {label}", factory, original, fusion),
                              lambda fn, namespace=namespace: set_attribute(namespace, name, fn)))
        return found


def _function_target(target: str) -> tuple[str, str, tuple[str, ...]]:
    """(module, name, leading parameters) of a function patch's target ``[module:]name[(a, b, ...)]``. Parameters,
    where given, narrow it to the functions of that name that take them first: one name may stand for two
    computations (``apply_rotary_pos_emb(q, k, cos, sin)``, the llama family's rotation of q and k, and
    ``apply_rotary_pos_emb(x, cos, sin)``, DeepSeek-V4's of one tensor), and two recipes of one name but other
    parameters claim different functions."""
    spec, _, parameters = target.partition("(")
    module_name, _, name = spec.rpartition(":")
    return module_name, name.strip(), tuple(p.strip() for p in parameters.rstrip(")").split(",") if p.strip())


def _plain_function(value: Any) -> Any:
    """The function itself where the ``kernels`` package (a dependency of transformers from 5.25) turned a modeling
    module's function into an nn.Module instance that calls it (its class's forward closes over the function), so
    that a factory reads the function's own signature; any other value as it is."""
    import torch

    forward = getattr(type(value), "forward", None) if isinstance(value, torch.nn.Module) else None
    wrapped = [cell.cell_contents for cell in getattr(forward, "__closure__", None) or ()
               if inspect.isfunction(cell.cell_contents)]
    return wrapped[0] if len(wrapped) == 1 else value


class AttentionInterface(PatchKind):
    """An attention function and its mask function (``factory(fusion, replaced) -> (attention, mask)``, replaced
    being the pair the model ran: a registered implementation, or eager) registered under the recipe's name with
    transformers' AttentionInterface and AttentionMaskInterface, and the model pointed at it (a custom attention
    without its mask function gets mask=None in static-cache decode). The gate calls the pair as one: the mask from
    its recorded arguments, then the attention."""

    name, target_field, unit = "attention_interface", "interface", "interfaces"
    factory_arguments = ("fusion", "replaced")

    def claims(self, recipe):
        return (("the model's attention implementation", ""),)

    def sites(self, model, recipe, fusion, factory):
        # transformers is imported here, not at the top: the catalog reads these classes without loading a model.
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface as Registry

        name, current = recipe.patch_target[0], model.config._attn_implementation
        if current == "eager":  # each modeling module has its own eager forward (softcap, sinks, ...)
            original = (_eager_attention, AttentionMaskInterface._global_mapping["eager"])
        elif current in Registry._global_mapping and current in AttentionMaskInterface._global_mapping:
            original = (Registry._global_mapping[current], AttentionMaskInterface._global_mapping[current])
        else:
            raise ValueError(f"the model runs attention '{current}', which has no interface function to compare with")

        def bind(pair):
            return together(f"attention interface {name}", [
                set_item(Registry._global_mapping, name, pair[0]),
                set_item(AttentionMaskInterface._global_mapping, name, pair[1]), _set_attention(model, name)])

        label = f"attention interface {name} (was {current})"
        return [Site(label, original, run(f"patch.with on {label}", factory, fusion, original), bind)]

    def call(self, path):
        """The attention output alone: the weights an eager forward also returns are no part of the model's function
        (the decoder layer drops them), and sdpa and the kernels return None there."""
        attention, mask = path
        return lambda mask_kwargs, module, q, k, v, **kwargs: attention(module, q, k, v, mask(**mask_kwargs),
                                                                        **kwargs)[0]

    def input_scales(self, replacement, args, kwargs):
        mask_kwargs, module, q, k, v = args
        return super().input_scales(replacement[0], (module, q, k, v), kwargs)

    def recorder(self, original, calls, copy):
        attention, mask = original
        latest = {}

        def record_mask(**kwargs):
            latest["mask"] = copy(kwargs)
            return mask(**kwargs)

        def record_attention(module, q, k, v, attention_mask, **kwargs):
            calls.append(copy(((latest["mask"], module, q, k, v), kwargs)))
            return attention(module, q, k, v, attention_mask, **kwargs)

        return record_attention, record_mask


def _eager_attention(module, *args, **kwargs):
    """transformers' eager attention as the module's own modeling module defines it."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


def _set_attention(model: torch.nn.Module, name: str) -> Change:
    """Point the model (and its sub-configs) at an attention implementation through transformers' own setter."""
    before = model.config._attn_implementation
    return Change(f"attn_implementation={name}", lambda: model.set_attn_implementation(name),
                  lambda: model.set_attn_implementation(before))


KINDS: dict[str, PatchKind] = {kind.name: kind for kind in (ModuleForward(), Function(), AttentionInterface())}
