"""Patch a loaded model in place with recipes, and take every change back exactly.

Each recipe's ``fusion`` (the kernel) and ``[patch] with`` (a factory in ``optiq.patching.replacements``) are
resolved from their import paths; the factory builds the replacement around the injected kernel, so this package
knows nothing of Triton. The recipe's patch kind (``kinds``) finds its sites; each site's change
(``changes.Change``) keeps what was there before, so ``undo`` puts back the very objects that were there, recipe by
recipe or all at once.
"""

from __future__ import annotations

import importlib
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from optiq.errors import OptiqError
from optiq.patching.changes import Change, Site
from optiq.patching.kinds import KINDS

if TYPE_CHECKING:
    import torch

    from optiq.catalog.recipes import Recipe

_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Patches, for unpatch(model)


@dataclass
class Applied:
    """A recipe in effect: its resolved kernel and factory, its sites and the changes that installed them."""

    recipe: Recipe
    fusion: Callable
    factory: Callable
    sites: list[Site] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)

    @property
    def kind(self):
        return KINDS[self.recipe.patch_kind]


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


class Patches:
    """The recipes applied to one model, what each changed, and which were not applicable (with why)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.applied: dict[str, Applied] = {}
        self.not_applicable: dict[str, str] = {}
        self._suspended = False

    def summary(self) -> list[dict]:
        rows = [{"recipe": name, "status": "applied", a.kind.unit: len(a.sites), "sites": [s.label for s in a.sites]}
                for name, a in self.applied.items()]
        return rows + [{"recipe": name, "status": "not applicable", "reason": reason}
                       for name, reason in self.not_applicable.items()]

    def undo(self, name: str | None = None) -> None:
        """Restore what one recipe (or, with no name, every recipe) replaced, newest change first."""
        for recipe_name in [name] if name is not None else reversed(list(self.applied)):
            applied = self.applied.pop(recipe_name)
            if not self._suspended:
                for change in reversed(applied.changes):
                    change.undo()
        if not self.applied:
            _ACTIVE.pop(self.model, None)

    def install(self, applied: Applied) -> None:
        """Find the recipe's sites in the model and put their replacements in, or say why it does not apply."""
        recipe = applied.recipe
        try:
            sites = applied.kind.sites(self.model, recipe, applied.fusion, applied.factory)
        except ValueError as exc:
            self.not_applicable[recipe.name] = str(exc)
            return
        if not sites:
            self.not_applicable[recipe.name] = (f"no site in the model for its {recipe.patch_kind.replace('_', ' ')} "
                                                f"patch of {recipe.target_label}")
            return
        for site in sites:
            change = site.bind(site.replacement)
            change.redo()
            applied.sites.append(site)
            applied.changes.append(change)
        self.applied[recipe.name] = applied

    @contextmanager
    def rebuilt(self):
        """For the block, the same recipes built anew on the model's parameters as they are now, in place of these
        (replacements that concatenate weights when they are built, such as one QKV GEMM, see values of then)."""
        with self.suspended():
            fresh = Patches(self.model)
            for applied in self.applied.values():
                fresh.install(Applied(applied.recipe, applied.fusion, applied.factory))
            try:
                yield fresh
            finally:
                for applied in reversed(list(fresh.applied.values())):
                    for change in reversed(applied.changes):
                        change.undo()

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


def apply(model: torch.nn.Module, recipes: Iterable[Recipe], kernels: dict[str, Callable] | None = None) -> Patches:
    """Patch ``model`` in place with ``recipes``; the returned Patches lists what changed and undoes it.
    ``kernels`` gives a recipe a kernel of its own instead of its ``fusion`` (the gate's mutants)."""
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
        fusion = (kernels or {}).get(recipe.name) or resolve(recipe, "fusion", recipe.fusion)
        chosen.append((recipe, fusion, resolve(recipe, "patch.with", recipe.patch_with)))
    for recipe, fusion, factory in chosen:
        patches.install(Applied(recipe, fusion, factory))
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
