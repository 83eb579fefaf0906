"""Hyper-connections (``structure.hyper_connection``, DeepSeek-V4's mHC) through a fused mixing kernel."""

from __future__ import annotations

import torch

from optiq.patching.structure import hyper_connection


def hyper_connection_forward(module: torch.nn.Module, fusion):
    """The module's pre / post / comb weights and collapse as the fusion computes them, from its own parameters
    (read at call time) and the constants its forward uses."""
    site = hyper_connection(module)
    if site is None:
        raise ValueError(f"{type(module).__name__} does not compute a hyper-connection's stream mixing")

    def forward(hidden_streams: torch.Tensor):
        return fusion(hidden_streams, module.fn, module.base, module.scale, site.norm_eps, site.hc_eps,
                      site.iterations)

    return forward
