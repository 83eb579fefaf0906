"""Factories that build the replacements recipes install; each gets its fusion injected and never imports a kernel.

The contract, one per ``[patch] kind`` of a recipe:

- ``module_forward``: ``factory(module, fusion) -> forward``. Called once per matching module instance; the result is
  installed as that instance's ``forward`` (a plain function, ``self`` already bound by closure). Anything derived from
  the weights (concatenated, interleaved) is computed here, once; the module's parameters stay untouched.
- ``function``: ``factory(original, fusion) -> replacement`` with the original's signature; it replaces the function in
  the architecture's modeling module and may call ``original`` for cases the fusion does not cover.
- ``attention_interface``: ``factory(fusion) -> (attention_function, mask_function)``, registered under the recipe's
  interface name with transformers' AttentionInterface and AttentionMaskInterface. The mask function's result is what
  the attention function receives as ``attention_mask``.
- ``engine``: ``factory(engine, fusion) -> method``, installed on that DecodeEngine instance.

A factory raises ValueError when the module it is given is outside what the fusion can compute; the recipe is then
reported as not applicable with that message.
"""
