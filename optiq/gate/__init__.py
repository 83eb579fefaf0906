"""The validation gate: a patched model must compute the function the unpatched one computes.

Two checks, both against a higher-precision reference rather than against the model's own rounding (``references``),
with the bounds of ``rules``:

1. Per recipe (``per_recipe``): the real inputs of every patched site, recorded during one decode step of the
   unpatched model (``capture``), run through the original and the fused path, each compared with the original
   path in float64.
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
from optiq.gate.per_recipe import check_recipe
from optiq.gate.plan import GatePlan
from optiq.models import constant_parameters
from optiq.patching import Patches
from optiq.record import EndToEndVerdict, RecipeVerdict

__all__ = ["GatePlan", "Validation", "validate"]


@dataclass
class Validation:
    recipes: dict[str, RecipeVerdict] = field(default_factory=dict)
    end_to_end: list[EndToEndVerdict] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    capture_seconds: float = 0.0  # recording the patched sites' inputs during one decode step
    baseline_seconds: float = 0.0  # all the decodes every end-to-end check compares with: reference and unpatched
    reference_seconds: float = 0.0  # the part of baseline_seconds in the fp32 reference decode of a half-precision
    # model (0 for an fp32 model, whose reference is its unpatched decode)
    reference_mode: str = ""  # the engine mode that reference decoded in: the plan's, or eager where a step of it
    # could not be captured
    constant_parameters: list[str] = field(default_factory=list)  # the model's parameters of one value throughout

    @property
    def passed(self) -> bool:
        return not self.rolled_back and all(e.passed for e in self.end_to_end)


def validate(patches: Patches, plan: GatePlan = GatePlan()) -> Validation:
    """Gate every applied recipe, undo those that fail, then check the survivors end to end; a recipe that fails end
    to end on its own is undone too, and if the set still fails only together, all of it is."""
    report = Validation(constant_parameters=constant_parameters(patches.model))
    if not patches.applied:
        return report
    started = time.perf_counter()
    with torch.inference_mode():
        captured = capture_inputs(patches, plan)
    report.capture_seconds = time.perf_counter() - started
    # The baselines before the per-recipe checks, though a set the checks reject all of would not need them: no fused
    # kernel runs in them, so kernels compiled ahead in other processes meanwhile (compile_ahead) are ready for both.
    started = time.perf_counter()
    found, report.reference_seconds, report.reference_mode = baselines(patches, plan)
    report.baseline_seconds = time.perf_counter() - started
    with torch.inference_mode():
        for name, sites in captured.items():
            started = time.perf_counter()
            report.recipes[name] = check_recipe(patches, name, sites)
            report.recipes[name].seconds = time.perf_counter() - started
    for name, result in report.recipes.items():
        if not result.passed:
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
            report.recipes[name].reason = (f"end to end at concurrency {failed.concurrency}: logits error "
                                           f"{failed.rel_err:.3g} (bound {failed.bound:.3g}), top-1 {failed.top1:.3f} "
                                           f"(min {failed.min_top1:.3f})")
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
