"""RMSNorm-like modules (``structure.rms_norm``) through a fused norm kernel."""

from __future__ import annotations

import torch

from optiq.patching.structure import rms_norm


def rmsnorm_forward(module: torch.nn.Module, fusion):
    """The module's norm as one kernel: its weight and eps read at call time (so a reloaded weight is seen), applied
    as ``w`` or ``1 + w``, before or after the rounding, as the module does (a user's fusion without
    ``weight_first`` still serves the Llama and Gemma kinds)."""
    site = rms_norm(module)
    if site is None:
        raise ValueError(f"{type(module).__name__} does not compute an RMSNorm")

    own_forward = type(module).forward.__get__(module)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:  # a gated norm (Mamba-2's, given its gate): not the structure the kernel computes
            return own_forward(hidden_states, *args, **kwargs)
        return fusion(hidden_states, module.weight, getattr(module, site.eps_attribute), site.offset,
                      **site.rounding())

    return forward
