"""The gate's rules: how far a fused path may be from the float64 run of the original path, per tolerance class,
and how that distance is measured.

Per recipe, at every call: ``err(fused) <= factor * err(unfused) + floor * eps(float32)``, ``err`` the norm of the
difference from the float64 reference over the norm of the reference: a relative error, so the floor is in ulps of
float32 at the output's magnitude, the precision every kernel of the catalog accumulates and rounds its intermediates
in (a fused path's reorderings move its result by a few such roundings). It is far below a half-precision output's
own rounding: a bf16 site's bound is ``factor`` times its unfused error and hardly more, never a fixed number that
could dwarf the site's own error. ``exact`` means bitwise equal to the unfused path. Integer outputs must be equal; a
top-k pair (ids with weights of the same shape, as routers return) is compared as a set per row, since which k were
chosen is the function and their order within a row is not (torch.topk leaves it unspecified among equal values, or
at all with sorted=False, and MoE experts sum over the k).

End to end: relative logits error ``<= factor * err(unpatched) + E2E_FLOOR_EPS * eps(fp32)`` and top-1 agreement
``>= agreement(unpatched) - slack``, with factor and slack from the loosest tolerance among the recipes.
"""

from __future__ import annotations

import torch

# (factor, floor in ulps of float32 at the output's magnitude). Why these (the distributions are in BENCHMARKS.md;
# scripts/gate_margins.py measures them):
# - exact_order: same roundings in the same order, so a correct fused path's error is the unfused one's up to a
#   rounding of an intermediate per differently rounded rsqrt, exp or fused multiply-add; in bf16 the output's
#   rounding hides those (fused/unfused at most 1.0 on the presets). A forgotten weight or eps, or a wrong rotation,
#   is many times past it.
# - reassociation: a sum in another order has an error of the same distribution as the original order's, not the
#   same value; over the thousands of elements of a call the ratio of two such errors stays near 1. A dropped cache
#   position or split, or partial sums kept in bf16 (2-3x the unfused error), is outside.
# - lossy: lower precision on purpose, so the unfused error says little: the floor is one bf16 rounding of every
#   input and the output (LOSSY_FLOOR ulps of bf16), and the end-to-end bound decides.
GATE = {"exact": (0.0, 0.0), "exact_order": (1.5, 2.0), "reassociation": (1.5, 2.0), "lossy": (4.0, 0.0)}
LOSSY_FLOOR = 2.0  # in ulps of bf16 at the output's magnitude
ORDER = ["exact", "exact_order", "reassociation", "lossy"]  # loosest last
# End to end: the rounding an fp32 forward of a few dozen layers accumulates in its logits (tiny presets: ~2 eps).
E2E_FLOOR_EPS = 64
# Even an exact recipe's logits move a little: every CUDA graph captured anew may get other cuBLAS kernels (measured:
# 0.0134 against 0.0133 unpatched on qwen3-0.6b with the sampler alone patched).
E2E_FACTOR = {"exact": 1.25, "exact_order": 1.25, "reassociation": 1.5, "lossy": 4.0}
# top-1, non-fp32 models only: a half-precision model's logits tie often enough (bf16 keeps 8 bits) that two correct
# argmaxes breaking ties differently disagree with the reference's picks on a percent or two of the steps
E2E_SLACK = {"exact": 0.02, "exact_order": 0.02, "reassociation": 0.05, "lossy": 0.1}


def topk_ids(outputs: list[torch.Tensor]) -> torch.Tensor | None:
    """The ids of a top-k pair among the outputs (an integer tensor of k > 1 a row, with a float tensor of its shape:
    a router's choice and weights), or None."""
    return next((t for t in outputs if not t.is_floating_point() and t.dim() and t.shape[-1] > 1
                 and any(o.is_floating_point() and o.shape == t.shape for o in outputs)), None)


def sorted_by_id(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs with each row of a top-k pair (an integer tensor and the float tensors of its shape) sorted by id."""
    ids = topk_ids(outputs)
    if ids is None:
        return outputs
    order = ids.argsort(dim=-1)
    return [t.gather(-1, order) if t.shape == ids.shape else t for t in outputs]


def unlike(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> str:
    """How a fused path's outputs differ in kind from the original path's, as "returned ..." ("" if they do not):
    their number, or an output's shape, device or dtype (a floating output must have the original's dtype, an
    integer one may be any integer type). A kernel that returns float64, or a tensor on the meta device, computes
    something the model would not run with, however close its values."""
    if len(outputs) != len(reference):
        return f"returned {len(outputs)} tensor(s) where the original returns {len(reference)}"
    for number, (out, want) in enumerate(zip(outputs, reference), 1):
        dtype_differs = out.dtype != want.dtype if want.is_floating_point() else out.is_floating_point()
        for what, got, expected, differs in (
                ("shape", list(out.shape), list(want.shape), out.shape != want.shape),
                ("device", out.device, want.device, out.device != want.device),
                ("dtype", out.dtype, want.dtype, dtype_differs)):
            if differs:
                return f"returned output {number} with {what} {got} where the original's is {expected}"
    return ""


def error(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The relative distance of ``outputs`` from ``reference``: inf for another shape or a differing integer."""
    if len(outputs) != len(reference) or any(o.shape != r.shape for o, r in zip(outputs, reference)):
        return float("inf")
    diff = ref = 0.0
    for out, want in zip(sorted_by_id(outputs), sorted_by_id(reference)):
        if not want.is_floating_point():
            if not torch.equal(out.to(want.dtype), want):
                return float("inf")
            continue
        diff += (out.double() - want.double()).norm().item() ** 2
        ref += want.double().norm().item() ** 2
    return (diff / ref) ** 0.5 if ref > 0 else diff ** 0.5


def site_bound(tolerance: str, err_unfused: float) -> float:
    """The largest error a fused call may have, given the unfused call's."""
    factor, floor = GATE[tolerance]
    if tolerance == "lossy":
        return factor * err_unfused + LOSSY_FLOOR * torch.finfo(torch.bfloat16).eps
    return factor * err_unfused + floor * torch.finfo(torch.float32).eps


def loosest(tolerances) -> str:
    return max(tolerances, key=ORDER.index, default="exact")


def end_to_end_bounds(tolerance: str, dtype: torch.dtype, rel_err_unpatched: float, top1_unpatched: float,
                      picks: int) -> tuple[float, float]:
    """(largest logits error, least top-1 agreement over ``picks`` greedy picks) a patched set whose loosest
    tolerance is ``tolerance`` may have; an fp32 model's greedy picks must all agree (its reference is its own
    unpatched decode). The top-1 slack is the tolerance's, or three standard errors of a disagreement count of the
    unpatched model's rate over that many picks if more: at concurrency 1, 64 picks, a random-weight model's
    near-ties flip a few picks either way (a correct rmsnorm measured 58 of 64 against the unpatched 61)."""
    bound = E2E_FACTOR[tolerance] * rel_err_unpatched + E2E_FLOOR_EPS * torch.finfo(torch.float32).eps
    if dtype == torch.float32:
        return bound, top1_unpatched
    disagreement = 1.0 - top1_unpatched
    noise = 3.0 * (disagreement * (1.0 - disagreement) / max(picks, 1)) ** 0.5
    return bound, top1_unpatched - max(E2E_SLACK[tolerance], noise)
