"""The validation gate: a patched model must compute the function the unpatched one computes.

Two checks, both against a higher-precision reference rather than against the model's own rounding (``references``),
with the bounds of ``rules``:

1. Per recipe (``per_recipe``): the real inputs of every patched site, recorded during one decode step of the
   unpatched model at each concurrency of the plan, at its longest context and a position short of it
   (``plan.capture_points``, ``capture``), run through the original and the fused path (twice), each compared with
   the original path in float64; at the first point also with the inputs scaled down to where a norm's eps
   matters. A model with constant parameters (a checkpoint's all-ones norm weights) is checked a second time with
   them redrawn (``models.constants_redrawn``).
2. End to end (``end_to_end``): teacher-forced greedy decode at every concurrency of the plan (``plan``), in the
   engine mode that will be measured, against an fp32 reference.

A recipe that fails its gate is undone (alone) and reported with the numbers that failed it; the others stay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from optiq.gate.capture import capture_inputs
from optiq.gate.end_to_end import baselines, check_end_to_end
from optiq.gate.per_recipe import check_recipe, combine
from optiq.gate.plan import GatePlan
from optiq.models import constant_parameters, constants_redrawn
from optiq.patching import Patches
from optiq.record import EndToEndVerdict, RecipeVerdict

__all__ = ["GatePlan", "Validation", "validate"]


@dataclass
class Validation:
    recipes: dict[str, RecipeVerdict] = field(default_factory=dict)
    end_to_end: list[EndToEndVerdict] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    capture_seconds: float = 0.0  # recording the patched sites' inputs during one decode step per concurrency
    baseline_seconds: float = 0.0  # all the decodes every end-to-end check compares with: reference and unpatched
    reference_seconds: float = 0.0  # the part of baseline_seconds in the fp32 reference decode of a half-precision
    # model (0 for an fp32 model, whose reference is its unpatched decode)
    reference_mode: str = ""  # the engine mode that reference decoded in: the plan's, or eager where a step of it
    # could not be captured
    constant_parameters: list[str] = field(default_factory=list)  # the model's parameters of one value throughout

    @property
    def passed(self) -> bool:
        return not self.rolled_back and all(e.passed for e in self.end_to_end)


def check_per_recipe(patches: Patches, plan: GatePlan, report: Validation, how: str = "") -> None:
    """The per-recipe checks on the inputs of each of the plan's capture steps, folded into ``report``; the recipes
    already failed are not checked again. Each capture is dropped before the next one is made."""
    points = plan.capture_points()
    for batch, context in points:
        started = time.perf_counter()
        with torch.inference_mode():
            captured = capture_inputs(patches, plan, batch, context)
        report.capture_seconds += time.perf_counter() - started
        where = f", {batch} sequences at context {context}{how}"
        with torch.inference_mode():
            for name, sites in captured.items():
                if name in report.recipes and not report.recipes[name].passed:
                    continue
                started = time.perf_counter()
                verdict = check_recipe(patches, name, sites, where, scaled=(batch, context) == points[0])
                verdict.seconds = time.perf_counter() - started
                report.recipes[name] = combine(report.recipes[name], verdict) if name in report.recipes else verdict


def validate(patches: Patches, plan: GatePlan = GatePlan(), found: tuple | None = None) -> Validation:
    """Gate every applied recipe, undo those that fail, then check the survivors end to end; a recipe that fails end
    to end on its own is undone too, and if the set still fails only together, all of it is. ``found``: the
    end-to-end baselines of this model and plan (``end_to_end.baselines``), when already computed."""
    report = Validation(constant_parameters=constant_parameters(patches.model))
    for name, (recipe, why) in patches.failed.items():  # its code failed before any check: rejected with why
        report.recipes[name] = RecipeVerdict(name, recipe.tolerance, False, why)
        report.rolled_back.append(name)
    if not patches.applied:
        return report
    # The baselines before the per-recipe checks, though a set the checks reject all of would not need them: no fused
    # kernel runs in them, so kernels compiled ahead in other processes meanwhile (compile_ahead) are ready for both.
    started = time.perf_counter()
    found, report.reference_seconds, report.reference_mode = found or baselines(patches, plan)
    report.baseline_seconds = time.perf_counter() - started
    check_per_recipe(patches, plan, report)
    if report.constant_parameters:  # a checkpoint's all-ones norm weights or zero biases would hide a kernel that
        # ignores them: a second pass with them drawn anew, the recipes rebuilt on those values
        with constants_redrawn(patches.model), patches.rebuilt() as redrawn:
            redrawn_note = f", {len(report.constant_parameters)} constant parameters redrawn"
            for name, (recipe, why) in redrawn.failed.items():
                report.recipes[name] = RecipeVerdict(name, recipe.tolerance, False, why + redrawn_note)
            check_per_recipe(redrawn, plan, report, how=redrawn_note)
    for result in report.recipes.values():
        if result.passed and result.calls == 0:  # a site that decode never reaches (the model rotates by another
            # function, say): nothing was checked, and nothing would be gained
            result.passed, result.reason = False, "no call in a decode step: none of its sites run there"
    for name, result in report.recipes.items():
        if not result.passed and name in patches.applied:
            patches.undo(name)
            report.rolled_back.append(name)
    kept = list(patches.applied)
    if not kept:
        return report

    def check(names: list[str]) -> list[EndToEndVerdict]:
        return check_end_to_end(patches, names, found, plan.mode)

    report.end_to_end = check(kept)
    if all(e.passed for e in report.end_to_end):
        return report
    for name in kept:
        failed = next((e for e in check([name]) if not e.passed), None)
        if failed is not None:
            report.recipes[name].passed = False
            report.recipes[name].reason = f"end to end at concurrency {failed.concurrency}: " + (
                failed.problem or f"logits error {failed.rel_err:.3g} (bound {failed.bound:.3g}), top-1 "
                                  f"{failed.top1:.3f} (min {failed.min_top1:.3f})")
    together = [n for n in kept if report.recipes[n].passed]
    if together:
        report.end_to_end = check(together)
        if not all(e.passed for e in report.end_to_end):
            for name in together:
                report.recipes[name].passed = False
                report.recipes[name].reason = "fails end to end only together with the other recipes"
    for name in kept:
        if not report.recipes[name].passed:
            patches.undo(name)
            report.rolled_back.append(name)
    return report
