"""The per-recipe check: at the model's shapes, each patched site's original and fused paths run on the inputs
``capture`` recorded, both measured against the float64 run of the original (``rules`` says how close is close).
The fused path runs twice in a row, so a kernel that carries state from one call into the next (a stale
accumulator) shows on its second call even at a single site."""

from __future__ import annotations

import math

import torch

from optiq.gate.capture import fresh, tensors
from optiq.gate.references.float64 import float64_path
from optiq.gate.rules import GATE, error, site_bound
from optiq.patching import Patches
from optiq.patching.changes import Site
from optiq.record import RecipeVerdict


def check_recipe(patches: Patches, name: str, sites: list[tuple[Site, list]]) -> RecipeVerdict:
    applied = patches.applied[name]
    kind, tolerance, dtype = applied.kind, applied.recipe.tolerance, next(patches.model.parameters()).dtype
    result = RecipeVerdict(name, tolerance, True, "passed")
    worst = -float("inf")
    with patches.suspended():
        for site, calls in sites:
            original, fused = kind.call(site.original), kind.call(site.replacement)
            with float64_path(site.original) as exact:
                reference = kind.call(exact)
                for args, kwargs in calls:
                    result.calls += 1
                    want = tensors(reference(*fresh(args, torch.float64), **fresh(kwargs, torch.float64)))
                    unfused = tensors(original(*fresh(args), **fresh(kwargs)))
                    try:
                        runs = [tensors(fused(*fresh(args), **fresh(kwargs))) for _ in range(2)]
                    except Exception as exc:  # a user's kernel may fail in any way; the recipe fails, the run goes on
                        return RecipeVerdict(name, tolerance, False, f"{site.label}: the fused path raised "
                                             f"{type(exc).__name__}: {exc}", result.calls, site=site.label)
                    err_unfused = error(unfused, want)
                    err_fused = max(error(run, want) for run in runs)
                    bound = site_bound(tolerance, dtype, err_unfused)
                    if tolerance == "exact":
                        ok = all(error(run, unfused) == 0.0 and all(torch.equal(a, b) for a, b in zip(run, unfused))
                                 for run in runs)
                    else:
                        ok = err_fused <= bound
                    excess = err_fused - bound
                    if not ok or excess > worst:
                        worst = excess if ok else float("inf")
                        result.err_fused, result.err_unfused, result.bound, result.site = (err_fused, err_unfused,
                                                                                           bound, site.label)
                        result.margin = err_fused / err_unfused if err_unfused else math.nan
                    if not ok:
                        result.passed = False
                        rule = ("not bit-identical to the unfused path" if tolerance == "exact" else
                                f"error {err_fused:.3g} > {GATE[tolerance][0]:g} x unfused {err_unfused:.3g} + floor "
                                f"= {bound:.3g}")
                        second = " on its second run" if error(runs[0], want) <= bound < err_fused else ""
                        result.reason = f"{site.label} (call {result.calls}){second}: {rule}"
                        return result
    return result
