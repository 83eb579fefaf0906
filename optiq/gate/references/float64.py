"""The float64 run of a patched site's original path, which both the original and the fused path are measured
against."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable

import torch

from optiq.gate.references import experts as reference_experts
from optiq.patching.structure import swiglu_experts


@contextmanager
def float64_path(original: Callable):
    """``original`` in float64: a module's forward runs on a float64 copy of the module (SwiGLU MoE experts through
    ``references.experts``, other experts through transformers' eager loop: grouped GEMMs have no float64 kernel).
    On exit the experts' forwards are dropped: each holds its module, a cycle that would keep every site's float64
    copy alive until a garbage collection."""
    owner = getattr(original, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        yield original
        return
    double = copy.deepcopy(owner).to(torch.float64)
    for module in double.modules():
        if swiglu_experts(module) is not None:
            module.forward = reference_experts.experts_forward(module)
        elif hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    try:
        yield double.forward if "forward" in vars(double) and original.__name__ == "forward" else \
            original.__func__.__get__(double)
    finally:
        for module in double.modules():
            vars(module).pop("forward", None)
