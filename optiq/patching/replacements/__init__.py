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
``takes_residual`` attribute, and callers go through ``plus_residual``.
"""


def branch_output(output):
    """The hidden states a decoder layer's branch (its attention, its MLP) returns: the first element of a tuple
    (attention weights, a MoE's router scores beside it), or the tensor itself where the module returns one alone
    (a linear-attention layer's mixer)."""
    return output[0] if isinstance(output, tuple) else output


def plus_residual(module, x, residual=None):
    """``residual + module(x)`` (``module(x)`` without a residual; either way its hidden states, ``branch_output``):
    in one call when the module's forward takes ``residual=``, else as HF adds it."""
    if residual is None:
        return branch_output(module(x))
    if getattr(module.forward, "takes_residual", False):
        return module(x, residual=residual)
    return residual + branch_output(module(x))
