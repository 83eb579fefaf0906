"""The gate's rules: how far a fused path may be from the float64 run of the original path, per tolerance class,
and how that distance is measured.

Per recipe: ``err(fused) <= factor * err(unfused) + floor * eps(model dtype)`` at every call, ``err`` the norm of
the difference over the norm of the reference; ``exact`` means bitwise equal to the unfused path. Integer outputs
must be equal; a top-k pair (ids with weights of the same shape, as routers return) is compared as a set per row,
since which k were chosen is the function and their order within a row is not (torch.topk leaves it unspecified
among equal values, or at all with sorted=False, and MoE experts sum over the k).

End to end: relative logits error ``<= factor * err(unpatched) + E2E_FLOOR_EPS * eps(fp32)`` and top-1 agreement
``>= agreement(unpatched) - slack``, with factor and slack from the loosest tolerance among the recipes.
"""

from __future__ import annotations

import torch

# factor, floor (in eps of the model dtype). Why these:
# - exact_order: same roundings in the same order, so the fused error is the unfused one plus at most a rounding of
#   the output per fused multiply-add or differently rounded rsqrt/exp (1-2 ulp): 2x the unfused error plus 2 eps
#   (4 units of roundoff). A norm without eps (relative error eps_norm / mean(x^2), ~1e-3 on these models) or a
#   wrong rotation is orders of magnitude past it in fp32.
# - reassociation: a sum in another order has an error of the same distribution as the original order's but not the
#   same value; a per-call ratio of two such errors stays well inside 4 (the floor covers calls whose unfused error is
#   by chance near zero). A dropped cache position or a missing split is an O(1/length) change, far outside.
# - lossy: lower precision on purpose, so the unfused error says little; the floor is one bf16 rounding of every
#   input and the output (8 eps of bf16 in eps of the model dtype is applied below), and the end-to-end bound decides.
GATE = {"exact": (0.0, 0.0), "exact_order": (2.0, 2.0), "reassociation": (4.0, 4.0), "lossy": (4.0, 2.0)}
LOSSY_FLOOR = 2 * torch.finfo(torch.bfloat16).eps
ORDER = ["exact", "exact_order", "reassociation", "lossy"]  # loosest last
# End to end: the rounding an fp32 forward of a few dozen layers accumulates in its logits (tiny presets: ~2 eps).
E2E_FLOOR_EPS = 64
E2E_SLACK = {"exact": 0.0, "exact_order": 0.02, "reassociation": 0.05, "lossy": 0.1}  # top-1, non-fp32 models only


def sorted_by_id(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs with each row of a top-k pair (an integer tensor and the float tensors of its shape) sorted by id."""
    ids = next((t for t in outputs if not t.is_floating_point() and t.dim() and t.shape[-1] > 1
                and any(o.is_floating_point() and o.shape == t.shape for o in outputs)), None)
    if ids is None:
        return outputs
    order = ids.argsort(dim=-1)
    return [t.gather(-1, order) if t.shape == ids.shape else t for t in outputs]


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


def site_bound(tolerance: str, dtype: torch.dtype, err_unfused: float) -> float:
    """The largest error a fused call may have, given the unfused call's."""
    factor, floor = GATE[tolerance]
    floor_abs = max(floor * torch.finfo(dtype).eps, LOSSY_FLOOR if tolerance == "lossy" else 0.0)
    return factor * err_unfused + floor_abs


def loosest(tolerances) -> str:
    return max(tolerances, key=ORDER.index, default="exact")


def end_to_end_bounds(tolerance: str, dtype: torch.dtype, rel_err_unpatched: float,
                      top1_unpatched: float) -> tuple[float, float]:
    """(largest logits error, least top-1 agreement) a patched set whose loosest tolerance is ``tolerance`` may have;
    an fp32 model's greedy picks must all agree (its reference is its own unpatched decode)."""
    if tolerance == "exact":
        bound = 0.0
    else:
        bound = GATE[tolerance][0] * rel_err_unpatched + E2E_FLOOR_EPS * torch.finfo(torch.float32).eps
    return bound, top1_unpatched - (0.0 if dtype == torch.float32 else E2E_SLACK[tolerance])
