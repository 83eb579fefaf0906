"""Patch a loaded model in place with recipes, and take every change back exactly.

Each recipe's ``fusion`` (the kernel) and ``[patch] with`` (a factory in optiq.patches) are resolved from their import
paths; the factory builds the replacement around the injected kernel, so this module knows nothing of Triton. Every
change is recorded as a name bound in a namespace (an instance's ``forward``, a modeling module's function, an
interface registry's key, the model's attention implementation) with what was there before, so ``undo`` puts back the
very objects that were there, recipe by recipe or all at once.
"""

from __future__ import annotations

import importlib
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from optiq.errors import OptiqError
from optiq.recipes import Recipe

_ABSENT = object()
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Patches, for unpatch(model)


@dataclass
class Change:
    """One reversible edit: ``redo`` makes it, ``undo`` restores what was there before."""

    label: str
    redo: Callable[[], None]
    undo: Callable[[], None]


def _set_attribute(owner: Any, name: str, value: Any) -> Change:
    """Bind ``owner.name``; undo restores the owner's own previous binding, or deletes it when there was none (so an
    instance falls back to its class's method again)."""
    before = vars(owner).get(name, _ABSENT)

    def undo():
        if before is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return Change(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}", lambda: setattr(owner, name, value),
                  undo)


def _set_item(mapping: dict, key: str, value: Any) -> Change:
    before = mapping.get(key, _ABSENT)

    def undo():
        if before is _ABSENT:
            del mapping[key]
        else:
            mapping[key] = before

    return Change(f"registry[{key!r}]", lambda: mapping.__setitem__(key, value), undo)


def _set_attention(model: torch.nn.Module, name: str) -> Change:
    """Point the model (and its sub-configs) at an attention implementation through transformers' own setter."""
    before = model.config._attn_implementation
    return Change(f"attn_implementation={name}", lambda: model.set_attn_implementation(name),
                  lambda: model.set_attn_implementation(before))


def _together(label: str, changes: list[Change]) -> Change:
    def redo():
        for change in changes:
            change.redo()

    def undo():
        for change in reversed(changes):
            change.undo()

    return Change(label, redo, undo)


@dataclass
class Site:
    """One place a recipe changed: what ran there before, what runs there now, and how to put a callable there.

    For an attention interface, ``original`` and ``replacement`` are (attention function, mask function) pairs."""

    label: str
    original: Any
    replacement: Any
    bind: Callable[[Any], Change]


@dataclass
class Applied:
    """A recipe in effect: its resolved kernel and factory, its sites and the changes that installed them."""

    recipe: Recipe
    fusion: Callable
    factory: Callable
    sites: list[Site] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        unit = {"module_forward": "modules", "function": "functions", "attention_interface": "interfaces",
                "engine": "engines"}[self.recipe.patch_kind]
        return {unit: len(self.engines) if unit == "engines" else len(self.sites)}


def resolve(recipe: Recipe, field_name: str, path: str) -> Callable:
    """Import ``package.module:name``; failure names the recipe, the field and the path."""
    module_name, _, attribute = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise OptiqError(f"recipe '{recipe.name}': {field_name} '{path}' does not resolve ({exc})") from None
    if not callable(target):
        raise OptiqError(f"recipe '{recipe.name}': {field_name} '{path}' is not callable")
    return target


def _module_sites(model: torch.nn.Module, recipe: Recipe, fusion: Callable, factory: Callable) -> list[Site]:
    """Every instance of the recipe's classes (only those under its attribute names, when it gives some)."""
    sites = []
    for name, module in model.named_modules():
        if type(module).__name__ in recipe.patch_target and (
                not recipe.patch_names or name.rsplit(".", 1)[-1] in recipe.patch_names):
            sites.append(Site(name or type(module).__name__, module.forward, factory(module, fusion),
                              lambda fn, module=module: _set_attribute(module, "forward", fn)))
    return sites


def _function_sites(model: torch.nn.Module, recipe: Recipe, fusion: Callable, factory: Callable) -> list[Site]:
    """The function in every modeling module that defines one of the model's classes (one for a plain LM)."""
    name = recipe.patch_target[0]
    namespaces = {sys.modules[type(m).__module__] for m in model.modules()}
    sites = []
    for namespace in sorted((ns for ns in namespaces if callable(vars(ns).get(name))), key=lambda ns: ns.__name__):
        original = vars(namespace)[name]
        sites.append(Site(f"{namespace.__name__}.{name}", original, factory(original, fusion),
                          lambda fn, namespace=namespace: _set_attribute(namespace, name, fn)))
    return sites


def _attention_sites(model: torch.nn.Module, recipe: Recipe, fusion: Callable, factory: Callable) -> list[Site]:
    name, current = recipe.patch_target[0], model.config._attn_implementation
    if current not in AttentionInterface._global_mapping or current not in AttentionMaskInterface._global_mapping:
        raise ValueError(f"the model runs attention '{current}', which has no interface function to compare with")
    original = (AttentionInterface._global_mapping[current], AttentionMaskInterface._global_mapping[current])

    def bind(pair):
        return _together(f"attention interface {name}", [
            _set_item(AttentionInterface._global_mapping, name, pair[0]),
            _set_item(AttentionMaskInterface._global_mapping, name, pair[1]), _set_attention(model, name)])

    return [Site(f"attention interface {name} (was {current})", original, factory(fusion), bind)]


def engine_site(applied: Applied, engine) -> Site:
    """The site an engine recipe has on one DecodeEngine."""
    method = applied.recipe.patch_target[0]
    if not callable(getattr(engine, method, None)):
        raise OptiqError(f"recipe '{applied.recipe.name}': the decode engine has no method '{method}'")
    return Site(f"engine.{method}", getattr(engine, method), applied.factory(engine, applied.fusion),
                lambda fn: _set_attribute(engine, method, fn))


_SITES = {"module_forward": _module_sites, "function": _function_sites, "attention_interface": _attention_sites}


class Patches:
    """The recipes applied to one model, what each changed, and which were not applicable (with why)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.applied: dict[str, Applied] = {}
        self.not_applicable: dict[str, str] = {}
        self._suspended = False

    def summary(self) -> list[dict]:
        rows = [{"recipe": name, "status": "applied", **a.counts, "sites": [s.label for s in a.sites]}
                for name, a in self.applied.items()]
        return rows + [{"recipe": name, "status": "not applicable", "reason": reason}
                       for name, reason in self.not_applicable.items()]

    def _install(self, applied: Applied, site: Site) -> None:
        change = site.bind(site.replacement)
        if not self._suspended:
            change.redo()
        applied.sites.append(site)
        applied.changes.append(change)

    def attach(self, engine) -> None:
        """Install the engine recipes on a DecodeEngine (each engine is its own site; ``detach`` before dropping it)."""
        for applied in self.applied.values():
            if applied.recipe.patch_kind == "engine" and engine not in applied.engines:
                self._install(applied, engine_site(applied, engine))
                applied.engines.append(engine)

    def detach(self, engine) -> None:
        for applied in self.applied.values():
            if engine in applied.engines:
                index = applied.engines.index(engine)  # an engine recipe's sites and changes are its engines'
                change = applied.changes.pop(index)
                applied.sites.pop(index)
                applied.engines.pop(index)
                if not self._suspended:
                    change.undo()

    def undo(self, name: str | None = None) -> None:
        """Restore what one recipe (or, with no name, every recipe) replaced, newest change first."""
        for recipe_name in [name] if name is not None else reversed(list(self.applied)):
            applied = self.applied.pop(recipe_name)
            if not self._suspended:
                for change in reversed(applied.changes):
                    change.undo()
        if not self.applied:
            _ACTIVE.pop(self.model, None)

    @contextmanager
    def suspended(self):
        """The unpatched model for the duration (every change undone, then redone in order)."""
        changes = [c for a in self.applied.values() for c in a.changes]
        for change in reversed(changes):
            change.undo()
        self._suspended = True
        try:
            yield self.model
        finally:
            self._suspended = False
            for change in [c for a in self.applied.values() for c in a.changes]:
                change.redo()


def apply(model: torch.nn.Module, recipes: Iterable[Recipe], engine=None) -> Patches:
    """Patch ``model`` in place with ``recipes`` (engine recipes also on ``engine``, and on any engine ``attach``ed
    later); the returned Patches lists what changed and undoes it."""
    if model in _ACTIVE:
        raise OptiqError("the model is already patched; unpatch it before applying recipes again")
    patches = Patches(model)
    model_type = model.config.model_type
    chosen, claimed = [], {}
    for recipe in recipes:
        if not recipe.applies_to(model_type):
            patches.not_applicable[recipe.name] = (f"architecture '{model_type}' is not among "
                                                   f"{', '.join(recipe.architectures)}")
            continue
        for claim in recipe.claims:
            if claim in claimed:
                kind, target = claim
                raise OptiqError(f"recipes '{claimed[claim]}' and '{recipe.name}' both patch the {kind}"
                                 f"{f' {target}' if target else ''}; choose one")
            claimed[claim] = recipe.name
        chosen.append((recipe, resolve(recipe, "fusion", recipe.fusion), resolve(recipe, "patch.with",
                                                                                 recipe.patch_with)))
    for recipe, fusion, factory in chosen:
        applied = Applied(recipe, fusion, factory)
        if recipe.patch_kind == "engine":
            patches.applied[recipe.name] = applied
            continue
        try:
            sites = _SITES[recipe.patch_kind](model, recipe, fusion, factory)
        except ValueError as exc:
            patches.not_applicable[recipe.name] = str(exc)
            continue
        if not sites:
            patches.not_applicable[recipe.name] = (f"the model has no {recipe.patch_kind.replace('_', ' ')} "
                                                   f"{recipe.target_label}")
            continue
        for site in sites:
            patches._install(applied, site)
        patches.applied[recipe.name] = applied
    if engine is not None:
        patches.attach(engine)
    if patches.applied:
        _ACTIVE[model] = patches
    return patches


def patches_of(model: torch.nn.Module) -> Patches | None:
    return _ACTIVE.get(model)


def unpatch(model: torch.nn.Module) -> None:
    """Undo every recipe applied to ``model`` (nothing to do if it is not patched)."""
    patches = _ACTIVE.get(model)
    if patches is not None:
        patches.undo()
