"""Patch a loaded model in place with recipes, and take every change back exactly.

Each recipe's ``fusion`` (the kernel) and ``[patch] with`` (a factory in ``optiq.patching.replacements``) are
resolved from their import paths; the factory builds the replacement around the injected kernel, so this package
knows nothing of Triton. The recipe's patch kind (``kinds``) finds its sites; each site's change
(``changes.Change``) keeps what was there before, so ``undo`` puts back the very objects that were there, recipe by
recipe or all at once.

A recipe's code is the user's (``user_code``): a fusion module that does not import (a syntax error, an exception,
sys.exit, an import that hangs), a factory that does not take the kind's two arguments, raises or hangs, fails that
recipe alone: it is left out and ``Patches.failed`` says why, while the others are applied. ``broken`` finds the
failures that need no model (imports and signatures) before any work, so that a broken recipe fails in seconds.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from optiq.errors import OptiqError
from optiq.patching.changes import Change, Site
from optiq.patching.kinds import KINDS
from optiq.patching.user_code import (FAILURES, UserCodeFailed, build_deadline, deadline, describe,
                                      import_deadline)

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
    kernel_calls: int = 0  # calls of the kernel through its sites, so the gate knows one that hands every call back

    def counted_fusion(self) -> Callable:
        """The kernel as the replacements get it: counting its calls (its signature kept, for the replacements that
        read which parameters it takes)."""
        @functools.wraps(self.fusion)
        def fusion(*args, **kwargs):
            self.kernel_calls += 1
            return self.fusion(*args, **kwargs)

        return fusion

    @property
    def kind(self):
        return KINDS[self.recipe.patch_kind]


def resolve(recipe: Recipe, field_name: str, path: str) -> Callable:
    """Import ``package.module:name`` (within ``user_code.import_deadline``); failure names the recipe, the field,
    the path and what went wrong, in one line."""
    module_name, _, attribute = path.partition(":")
    try:
        with deadline(import_deadline()):
            module = importlib.import_module(module_name)
            target = getattr(module, attribute, None)
    except FAILURES as exc:
        raise OptiqError(f"recipe '{recipe.name}': {field_name} '{path}' does not resolve: importing {module_name} "
                         f"{describe(exc)}") from None
    if target is None:
        raise OptiqError(f"recipe '{recipe.name}': {field_name} '{path}' does not resolve: {module_name} has no "
                         f"'{attribute}'")
    if not callable(target):
        raise OptiqError(f"recipe '{recipe.name}': {field_name} '{path}' is not callable")
    return target


def resolve_code(recipe: Recipe) -> tuple[Callable, Callable]:
    """The recipe's kernel and factory, the factory checked to take its kind's two arguments."""
    fusion = resolve(recipe, "fusion", recipe.fusion)
    factory = resolve(recipe, "patch.with", recipe.patch_with)
    arguments = KINDS[recipe.patch_kind].factory_arguments
    try:
        inspect.signature(factory).bind(*arguments)
    except TypeError:
        raise OptiqError(f"recipe '{recipe.name}': patch.with '{recipe.patch_with}' must take ({', '.join(arguments)}),"
                         f" not {inspect.signature(factory)}") from None
    except ValueError:  # no signature to read (a builtin): its call will tell
        pass
    return fusion, factory


def broken(recipes: Iterable[Recipe]) -> dict[str, str]:
    """{recipe: why} for those whose kernel or factory does not resolve (``resolve_code``): what can be known of a
    recipe's code without a model."""
    found = {}
    for recipe in recipes:
        try:
            resolve_code(recipe)
        except OptiqError as exc:
            found[recipe.name] = str(exc)
    return found


class Patches:
    """The recipes applied to one model, what each changed, which were not applicable and which failed (with why)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.applied: dict[str, Applied] = {}
        self.not_applicable: dict[str, str] = {}
        self.failed: dict[str, tuple[Recipe, str]] = {}  # name -> the recipe whose code failed, and why (module
        # docstring)
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
        """Find the recipe's sites in the model and put their replacements in, or say why it does not apply or why it
        failed (then none of its changes stays)."""
        recipe = applied.recipe
        try:
            with deadline(build_deadline(sum(p.numel() for p in self.model.parameters()))):
                sites = applied.kind.sites(self.model, recipe, applied.counted_fusion(), applied.factory)
                for site in sites:
                    built = site.replacement if isinstance(site.replacement, tuple) else (site.replacement,)
                    if not all(map(callable, built)):
                        raise UserCodeFailed(f"patch.with on {site.label} returned a {type(site.replacement).__name__}"
                                             f", not {'functions' if len(built) > 1 else 'a function'}")
                    change = site.bind(site.replacement)
                    change.redo()
                    applied.changes.append(change)
                    applied.sites.append(site)
        except ValueError as exc:  # the kind's own: a model outside what it patches (a factory's is UserCodeFailed)
            self.not_applicable[recipe.name] = str(exc)
            return
        except FAILURES as exc:
            for change in reversed(applied.changes):
                change.undo()
            self.failed[recipe.name] = recipe, f"building its replacements: {describe(exc)}"
            return
        if not sites:
            self.not_applicable[recipe.name] = (f"no site in the model for its {recipe.patch_kind.replace('_', ' ')} "
                                                f"patch of {recipe.target_label}")
            return
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
        try:
            fusion, factory = resolve_code(recipe)
        except OptiqError as exc:
            patches.failed[recipe.name] = recipe, str(exc)
            continue
        chosen.append((recipe, (kernels or {}).get(recipe.name) or fusion, factory))
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
