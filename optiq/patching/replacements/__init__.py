"""Factories that build the replacements recipes install; each gets its fusion injected and never imports a kernel.

The contract, one per ``[patch] kind`` of a recipe:

- ``module_forward``: ``factory(module, fusion) -> forward``. Called once per matching module instance; the result is
  installed as that instance's ``forward`` (a plain function, ``self`` already bound by closure). Anything derived from
  the weights (concatenated, interleaved) is computed here, once; the module's parameters stay untouched.
- ``function``: ``factory(original, fusion) -> replacement`` with the original's signature; it replaces the function in
  the architecture's modeling module (or in the module its import path names, such as the decode engine's sampler)
  and may call ``original`` for cases the fusion does not cover.
- ``attention_interface``: ``factory(fusion, replaced) -> (attention_function, mask_function)``, registered under the
  recipe's interface name with transformers' AttentionInterface and AttentionMaskInterface; ``replaced`` is the
  (attention, mask) pair of the implementation the model ran, for the calls the fusion does not cover. The mask
  function's result is what the attention function receives as ``attention_mask``.

A factory raises ValueError when the module it is given is outside what the fusion can compute; the recipe is then
reported as not applicable with that message.

A ``module_forward`` replacement may also take ``residual=`` and return ``residual + output``, adding it inside its
last kernel (the decoder layer's add after the MLP then costs no launch of its own); it says so with a
``takes_residual`` attribute, and callers go through ``plus_residual``. An attention or MLP replacement may take
``norm=`` too (a ``FoldedNorm``: the RMSNorm its input has not been through yet), folding the norm into its first
GEMM, and says so with ``takes_norm``; it then takes ``residual=`` as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FoldedNorm:
    """An RMSNorm a decoder layer hands, unrun, to the module after it: that module's first GEMM normalises its rows
    itself, with the norm's weight folded into the GEMM's weight columns (``folded_into``), so the norm's kernel and
    the round trip of the normalised rows through memory are gone. ``module`` serves a path that runs the norm as
    it is (a call the fused path does not take)."""
    module: torch.nn.Module
    eps: float
    offset: bool  # scales by 1 + w (Gemma's), not w
    _folds: dict = field(default_factory=dict, compare=False, repr=False)

    def folded_into(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, H] with column j scaled by the norm's w_j (1 + w_j), in fp32 and rounded once: made at the
        first call for this weight and again whenever the norm's weight has changed since (a reload, the gate's
        redraw of a constant weight), never on a call that finds it current."""
        scale = self.module.weight
        key = (weight.data_ptr(), scale.data_ptr(), scale._version)
        folded = self._folds.get(weight.data_ptr())
        if folded is None or folded[0] != key:
            factor = scale.detach().float() + 1.0 if self.offset else scale.detach().float()
            folded = (key, (weight.float() * factor).to(weight.dtype))
            self._folds[weight.data_ptr()] = folded
        return folded[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def plus_residual(module, x, residual=None):
    """``residual + module(x)`` (``module(x)`` without a residual): in one call when the module's forward takes
    ``residual=``, else as HF adds it."""
    if residual is None:
        return module(x)
    if getattr(module.forward, "takes_residual", False):
        return module(x, residual=residual)
    return residual + module(x)
