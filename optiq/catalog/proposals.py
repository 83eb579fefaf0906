"""Proposals: the catalog's recipes ranked by the GPU time and kernels of the attribution table they would replace.

A recipe covers the kernels whose module role and op class it names (in traces without roles, the op class alone).
Its predicted saving is an upper bound, the covered time itself; the fused kernel's own time is what apply-fusion's
re-measurement tells.
"""

from __future__ import annotations

import pandas as pd
import torch

from optiq.catalog.recipes import Recipe
from optiq.errors import OptiqError
from optiq.patching.kinds import KINDS
from optiq.record import Proposal
from optiq.traces.attribution import NO_ROLE


def _coverage(recipe: Recipe, kernels: pd.DataFrame, has_roles: bool) -> pd.Series:
    covered = kernels["op_class"].isin(recipe.op_classes)
    if has_roles and recipe.roles:
        covered &= kernels["role"].isin(recipe.roles)
    return covered


def with_sites(catalog: dict[str, Recipe], model: torch.nn.Module) -> dict[str, Recipe]:
    """The recipes with a site in ``model`` (``PatchKind.has_site``): the candidates to propose for it, found once
    for all its concurrencies. A precision flip proposed for a router that computes in the model's dtype would keep
    the plain routing recipe out."""
    return {name: recipe for name, recipe in catalog.items() if KINDS[recipe.patch_kind].has_site(model, recipe)}


def propose(catalog: dict[str, Recipe], kernels: pd.DataFrame, model_type: str | None) -> list[Proposal]:
    """Rank the recipes applicable to ``model_type`` (None: a foreign trace, all of them) against ``kernels``, the
    per-step weighted kernel table (``optiq.traces.attribution.weighted_kernels``); given a model, ``catalog`` is
    ``with_sites`` of it.

    Greedy, largest first: each kernel counts for one recipe only, so the proposals' savings add up, and a recipe
    that patches a place an earlier proposal patches is dropped."""
    time_us = kernels["dur"] * kernels["w"]
    total_us = float(time_us.sum())
    has_roles = bool((kernels["role"] != NO_ROLE).any())
    candidates = {name: recipe for name, recipe in catalog.items()
                  if model_type is None or recipe.applies_to(model_type)}
    unclaimed = pd.Series(True, index=kernels.index)
    taken: set[tuple] = set()
    proposals = []
    while candidates:
        coverage = {name: _coverage(r, kernels, has_roles) & unclaimed for name, r in candidates.items()}
        name = max(coverage, key=lambda n: (float(time_us[coverage[n]].sum()), float(kernels["w"][coverage[n]].sum())))
        covered, recipe = coverage[name], candidates.pop(name)
        if not covered.any():
            break
        if taken.intersection(recipe.claims):
            continue
        taken.update(recipe.claims)
        unclaimed &= ~covered
        places = (kernels[covered].assign(t=time_us[covered]).groupby(["role", "op_class"], observed=True)["t"]
                  .sum().sort_values(ascending=False))
        covered_us = float(places.sum())
        where = ", ".join(f"{cls} in {role} {100 * t / total_us:.1f}%" for (role, cls), t in places.head(3).items())
        kernels_per_step = float(kernels["w"][covered].sum())
        proposals.append(Proposal(
            recipe=name, covered_ms_per_step=covered_us / 1e3, covered_pct=100 * covered_us / total_us,
            kernels_per_step=kernels_per_step, where=where,
            why=f"{name}: replaces {where} ({kernels_per_step:.0f} kernels/step)"))
    return proposals


def propose_all(catalog: dict[str, Recipe], kernels: dict[int, pd.DataFrame], model: torch.nn.Module,
                rejected=()) -> dict[int, list[Proposal]]:
    """The proposals per concurrency of the model's profiled kernel tables, leaving out ``rejected`` recipes."""
    candidates = with_sites({n: r for n, r in catalog.items() if n not in rejected}, model)
    return {c: propose(candidates, k, model.config.model_type) for c, k in kernels.items()}


def named_recipes(requested: str, catalog: dict[str, Recipe]) -> list[str]:
    """The recipes a comma-separated ``requested`` names, which must exist, each once."""
    names = list(dict.fromkeys(n.strip() for n in requested.split(",") if n.strip()))
    unknown = [n for n in names if n not in catalog]
    if unknown:
        raise OptiqError(f"unknown recipe(s) {', '.join(unknown)}; the catalog has: {', '.join(catalog)}")
    return names


def choose_recipes(requested: str, catalog: dict[str, Recipe], proposals: dict[int, list[Proposal]],
                   min_share: float) -> list[str]:
    """``auto``: every proposal covering at least ``min_share`` % of the step at some concurrency, largest first, but
    none that patches what a larger one patches (concurrencies may rank rivals differently); otherwise the named
    recipes (``named_recipes``)."""
    if requested != "auto":
        return named_recipes(requested, catalog)
    best: dict[str, float] = {}
    for found in proposals.values():
        for p in found:
            best[p.recipe] = max(best.get(p.recipe, 0.0), p.covered_pct)
    chosen, taken = [], set()
    for name, share in sorted(best.items(), key=lambda item: -item[1]):
        if share >= min_share and not taken.intersection(catalog[name].claims):
            chosen.append(name)
            taken.update(catalog[name].claims)
    return chosen
