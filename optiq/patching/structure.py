"""Sites found by what a module computes rather than by what its class is called, so a recipe applies to a model it
was not written for (Phi-3's, Gemma's or a user's norm) and the gate decides whether it stays.

A structure is a predicate on a module that returns what the replacement needs to know about the site, or None.
It looks at the module's parameters and attributes, then runs the module once on a float64 copy, with a random input
and random parameters, and compares the result with the structure's formula: a module that has the right parameters
but computes something else (another normalisation, an extra scale) does not match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

EPS_ATTRIBUTES = ("variance_epsilon", "eps")  # HF's names for a norm's epsilon
PROBE_ROWS = 4


@dataclass(frozen=True)
class NormSite:
    eps_attribute: str  # where the module keeps its epsilon (read at call time)
    offset: bool  # the weight is applied as 1 + w (Gemma), not w


def rms_norm(module: torch.nn.Module) -> NormSite | None:
    """An RMSNorm-like module: one weight vector and an eps, no other parameter or submodule, and output
    ``x * rsqrt(mean(x^2) + eps)`` scaled by ``w`` or by ``1 + w`` over the last dim."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1 or next(module.children(), None) is not None:
        return None
    eps_attribute = next((name for name in EPS_ATTRIBUTES if type(getattr(module, name, None)) in (int, float)), None)
    if eps_attribute is None:
        return None
    weight = params["weight"]
    probe = copy.deepcopy(module).to(torch.float64)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, weight.shape[0], dtype=torch.float64, generator=generator).to(weight.device)
    with torch.no_grad():  # a weight of its own, never a constant one: with all ones, 2 x normed would pass as 1 + w
        probe.weight.copy_(0.5 + 0.2 * torch.randn(weight.shape, dtype=torch.float64, generator=generator))
    try:
        with torch.no_grad():
            got = probe(x)
    except Exception:  # a forward of another signature is another structure
        return None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(module, eps_attribute))
    w = probe.weight.detach()
    for offset, scale in ((False, w), (True, 1.0 + w)):
        # HF computes a norm in fp32 whatever its input: agreement to fp32's precision is a match
        if torch.allclose(got, normed * scale, rtol=1e-4, atol=1e-6):
            return NormSite(eps_attribute, offset)
    return None


STRUCTURES = {"rms_norm": rms_norm}
