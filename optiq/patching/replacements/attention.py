"""Attention: one GEMM for the Q, K and V projections (alone, or with norms, RoPE and the cache write fused after it),
and a decode attention kernel behind an HF interface."""

from __future__ import annotations

import inspect
import math
import sys
import weakref

import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from optiq.patching.structure import AttentionSite, qkv_attention, qkv_projections, rotary_layout


def _concatenated(projections) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """(weight, bias, split sizes) of linear projections of one input as one, concatenated here, once: a projection
    without a bias gets zeros in the concatenated one (adding zero leaves its outputs as they were), none where no
    projection has one."""
    weight = torch.cat([p.weight for p in projections]).detach()
    bias = None
    if any(p.bias is not None for p in projections):
        bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                          for p in projections]).detach()
    return weight, bias, [p.out_features for p in projections]


def _fused_qkv_weights(attn: torch.nn.Module,
                       site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """(weight, bias, split sizes) of the Q, K and V projections of the attention ``site`` as one: a fused
    qkv_proj's own, or the three concatenated."""
    if site.fused_sizes:
        bias = attn.qkv_proj.bias
        return attn.qkv_proj.weight.detach(), None if bias is None else bias.detach(), list(site.fused_sizes)
    return _concatenated([attn.q_proj, attn.k_proj, attn.v_proj])


def _attend(attn: torch.nn.Module, q, k, v, attention_mask, input_shape, arguments: dict, kwargs: dict):
    """HF's attention function for the module's implementation (looked up at call time, so an attention interface
    patched underneath applies), handed ``arguments`` (what the module's own forward hands it: the scale, a cap,
    sinks, a window), then o_proj."""
    implementation = attn.config._attn_implementation
    attention = (sys.modules[type(attn).__module__].eager_attention_forward if implementation == "eager"
                 else AttentionInterface._global_mapping[implementation])
    out, weights = attention(attn, q, k, v, attention_mask, dropout=0.0, **arguments, **kwargs)
    return attn.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _pop_cache(kwargs: dict):
    """The KV cache, passed as ``cache=`` (transformers 5.24) or ``past_key_values=`` (5.17), taken out of kwargs."""
    cache, legacy = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    return legacy if cache is None else cache


def _rotation(attn: torch.nn.Module, modeling, hidden_states: torch.Tensor, position_embeddings):
    """The layout in which the modeling module's ``apply_rotary_pos_emb`` turns the module's heads at this call's
    cos width (structure.rotary_layout); None where the call has no rotation (a NoPE layer is handed None) or the
    function is not one rope knows, (q, k, cos, sin) on whole heads: the module's own forward serves those calls."""
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2
            and isinstance(position_embeddings[0], torch.Tensor) and position_embeddings[0].ndim == 3):
        return None
    return rotary_layout(getattr(modeling, "apply_rotary_pos_emb", None), attn.head_dim,
                         position_embeddings[0].shape[-1], hidden_states.dtype)


def qkv_proj_forward(attn: torch.nn.Module, fusion):
    """The attention's own forward, with its Q, K and V projections served by one GEMM: the first of the three to
    be called runs the GEMM over their concatenated weights and each of them, handed that same input (the same
    tensor object), returns its slice of the output; one handed another input runs the GEMM again on that
    one (a forward that projects two inputs pays for it; the re-measurement tells). Nothing else of the forward is
    replaced, so whatever the model does around the projections (norms, rotations, gates, caches) is its own, with
    other recipes' patches underneath."""
    site = qkv_projections(attn)
    if site is None:
        raise ValueError(f"{type(attn).__name__} has no Q, K and V linear projections of one input")
    projections = [getattr(attn, name) for name in site.names]
    weight, bias, sizes = _concatenated(projections)
    own_forward = attn.forward

    def forward(*args, **kwargs):
        shared = {}  # this call's GEMM: its input and the three outputs

        def served(index: int, own):
            def project(x: torch.Tensor) -> torch.Tensor:
                if not isinstance(x, torch.Tensor) or x.shape[-1] != weight.shape[1]:
                    return own(x)
                if shared.get("input") is not x:
                    shared.update(input=x, outputs=fusion(x, weight, sizes, bias))
                return shared["outputs"][index]
            return project

        installed = [vars(projection).get("forward") for projection in projections]
        for index, projection in enumerate(projections):
            projection.forward = served(index, projection.forward)
        try:
            return own_forward(*args, **kwargs)
        finally:
            for projection, before in zip(projections, installed):
                if before is None:
                    del projection.forward
                else:
                    projection.forward = before

    return forward


_WRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> fill counters of the layers written


def _advance(cache, length: int) -> None:
    """Advance the fill counters of the static layers attention_prologue wrote this step, in one launch."""
    counters = _WRITTEN.pop(cache, [])
    if counters:
        torch._foreach_add_(counters, length)


def _advance_after_update(last, cache) -> None:
    """Have the last static layer's own ``update`` advance the counters left pending, where its module does not run
    the kernel (a layer whose forward is not attention_prologue's site: Cohere 2's global layers, which skip the
    rotation), so that they are advanced before the next step's mask reads them, as the kernel's last layer does.
    Once per cache; with nothing pending it adds nothing."""
    if getattr(last.update, "advances_pending", False):
        return
    update, cache_ref = last.update, weakref.ref(cache)

    def update_and_advance(key_states, value_states, *args, **kwargs):
        out = update(key_states, value_states, *args, **kwargs)
        if cache_ref() is not None:
            _advance(cache_ref(), key_states.shape[-2])
        return out

    update_and_advance.advances_pending = True
    last.update = update_and_advance


def _static_layers(cache) -> list:
    """The cache's layers that attention_prologue_forward writes: transformers' static ones, once allocated."""
    return [layer for layer in cache.layers if type(layer).__name__ == "StaticLayer" and layer.is_initialized]


def attention_prologue_forward(attn: torch.nn.Module, fusion):
    """HF's llama-family attention forward whose prologue (Q/K/V GEMM, Qwen3's q/k norms, RoPE, the cache write) is
    two launches, when the layer's cache is transformers' static one: the kernel writes k and v at the layer's fill
    counter. The counters of the layers it wrote advance as StaticLayer.update advances them, but all in one launch,
    when the last static layer is done (one add per layer was a kernel and a launch gap each, 28-32 per decode step),
    through the kernel or through its own update where that layer is not a site; a layer its own forward serves (a
    NoPE layer among rotating ones) advances its own. The
    rotation is the modeling module's ``apply_rotary_pos_emb``, in the layout it turns whole heads in
    (``structure.rotary_layout``). Other caches, a cache not yet allocated, and a rotation of part of a head or of
    a layout rope does not know take the module's own forward."""
    site = qkv_attention(attn)
    if site is None:
        raise ValueError(f"{type(attn).__name__} is not a llama-family attention (structure qkv_attention)")
    weight, bias, sizes = _fused_qkv_weights(attn, site)
    arguments = dict(site.arguments)
    q_norm, k_norm, norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), site.qk_norm
    rounding = norm.rounding() if norm else {}
    own_forward = type(attn).forward.__get__(attn)
    modeling = sys.modules[type(attn).__module__]

    def forward(hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layers = _static_layers(cache) if cache is not None else []
        layer = cache.layers[attn.layer_idx] if cache is not None else None
        layout = _rotation(attn, modeling, hidden_states, position_embeddings)
        if not any(mine is layer for mine in layers) or layout is None or layout.rotated != attn.head_dim:
            out = own_forward(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              **kwargs)
            if layers and layer is layers[-1]:
                _advance(cache, hidden_states.shape[1])
            return out
        cos, sin = position_embeddings
        norms = (q_norm.weight, k_norm.weight, getattr(q_norm, norm.eps_attribute), norm.offset) if norm else ()
        _pop_cache(kwargs)
        batch, length = hidden_states.shape[:2]
        q = fusion(hidden_states, weight, sizes, bias, attn.head_dim, cos, sin, layer.keys, layer.values,
                   layer.cumulative_length.expand(batch), *norms, **rounding, **layout.switches())
        _WRITTEN.setdefault(cache, []).append(layer.cumulative_length)
        if layer is layers[-1]:
            _advance(cache, length)
        else:
            _advance_after_update(layers[-1], cache)
        return _attend(attn, q, layer.keys, layer.values, attention_mask, hidden_states.shape[:-1], arguments, kwargs)

    return forward


def _query_length(kwargs: dict) -> int:
    """How many query tokens a mask call is for: transformers 5.24 passes ``q_length``, 5.17 ``cache_position``."""
    positions = kwargs.get("cache_position")
    return kwargs["q_length"] if positions is None else positions.shape[0]


def _filled_length(kwargs: dict) -> torch.Tensor:
    """Cache positions filled once this step's tokens are written, from a mask call's arguments: the last query
    position + 1 (5.17's ``cache_position``), or ``q_offset`` + ``q_length`` (5.24's; a device tensor for a static
    cache). Nothing is read back to the host."""
    positions = kwargs.get("cache_position")
    if positions is not None:
        return positions[-1] + 1
    return torch.as_tensor(kwargs.get("q_offset", 0), device=kwargs.get("device")) + kwargs["q_length"]


def _decode_spans(kwargs: dict) -> torch.Tensor | None:
    """What each sequence's one new token attends, from a mask call's arguments, in a form the attention function
    tells from any mask: int64 [batch], the filled lengths, for a causal mask; int64 [2, batch], the first and
    one-past-last position, for a sliding window's (``local_size``: key k is in where k > q - window, so the span
    starts at filled - window) or a chunk's (``local_size`` too: the span starts at the query's chunk, ``_chunked``
    tells which); for one token under any other mask (padding, a custom overlay such as Gemma 3's
    image tokens, DeepSeek-V4's gathered window and compressed entries), bool [batch, keys], which keys it sees,
    as sdpa's mask says it. None for a prompt."""
    if _query_length(kwargs) != 1:
        return None
    kv_offset = kwargs.get("kv_offset", 0)
    window = kwargs.get("local_size")
    chunked = None if window is None else _chunked(kwargs.get("config"), window)
    if kwargs.get("attention_mask") is not None or kwargs.get("use_vmap") or not isinstance(kv_offset, int) \
            or kv_offset != 0 or (window is not None and chunked is None):
        options = {name: value for name, value in kwargs.items() if not name.startswith("allow_is_")}
        allowed = sdpa_mask(**options, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return allowed[:, 0, 0].contiguous()
    filled = _filled_length(kwargs).reshape(1).to(torch.int64)
    if window is None:
        return filled.repeat(kwargs["batch_size"])
    start = (filled - 1) // window * window if chunked else (filled - window).clamp_min(0)
    return torch.stack([start, filled]).repeat(1, kwargs["batch_size"])


def _chunked(config, size: int) -> bool | None:
    """Whether a mask of ``local_size`` ``size`` is chunked attention's (a query sees the keys of its own chunk of
    ``size`` positions: Llama 4, whose masks transformers hands ``local_size`` too) rather than a sliding window's
    (the last ``size`` keys), from which of the two the model's config sets to that size; None where it sets neither
    or both. From the config, not by asking the mask function: that reads a device tensor (the left padding), a
    sync a CUDA graph's capture does not allow."""
    window, chunk = (getattr(config, name, None) == size for name in ("sliding_window", "attention_chunk_size"))
    return None if window == chunk else chunk


# What transformers' attention functions may be asked for that the decode kernel does not compute (Inkling's sinks
# tensor, T5-style position bias, block-sparse indices); such calls take the implementation the interface replaced.
UNSUPPORTED = ("sinks", "position_bias", "block_indices")


def _kernel_computes(query, key, value, kwargs: dict) -> bool:
    """Whether the decode kernel computes this call: one query token per sequence, keys and values of one shape
    (not MLA's narrower values) and of the query's dtype, nothing asked of it that it does not do (UNSUPPORTED);
    GPT-OSS's ``s_aux`` sinks are one logit per query head."""
    sinks = kwargs.get("s_aux")
    return (query.ndim == key.ndim == value.ndim == 4 and query.shape[2] == 1 and key.shape == value.shape
            and query.dtype == key.dtype == value.dtype and query.shape[1] % key.shape[1] == 0
            and not any(kwargs.get(n) is not None for n in UNSUPPORTED)
            and (sinks is None or tuple(sinks.shape) == (query.shape[1],)))


def _spans(attention_mask, key_length: int) -> dict | None:
    """The kernel's lengths, and starts or visible where the call has them, when the attention mask is what
    _decode_spans returns; None for a real mask."""
    if not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.dtype == torch.bool and attention_mask.ndim == 2:
        lengths = torch.full(attention_mask.shape[:1], key_length, dtype=torch.int64, device=attention_mask.device)
        return {"lengths": lengths, "visible": attention_mask}
    if attention_mask.dtype != torch.int64:
        return None
    if attention_mask.ndim == 1:
        return {"lengths": attention_mask}
    if attention_mask.ndim == 2 and attention_mask.shape[0] == 2:
        return {"lengths": attention_mask[1], "starts": attention_mask[0]}
    return None


def _span_mask(spans: dict, key_length: int, additive: torch.dtype | None) -> torch.Tensor:
    """The [batch, 1, 1, key_length] mask the spans stand for: boolean (True = attend) as sdpa takes it, or additive
    (0 or the dtype's minimum) as eager attention forwards take it."""
    lengths = spans["lengths"]
    positions = torch.arange(key_length, device=lengths.device)
    attend = positions < lengths[:, None]
    if "starts" in spans:
        attend &= positions >= spans["starts"][:, None]
    if "visible" in spans:
        attend &= spans["visible"]
    attend = attend[:, None, None]
    if additive is None:
        return attend
    return torch.zeros(attend.shape, dtype=additive, device=lengths.device).masked_fill(~attend,
                                                                                         torch.finfo(additive).min)


def decode_attention_interface(fusion, replaced):
    """(attention, mask) for one name: decode steps (one query token, attending one span of the cache) run
    ``fusion`` over each sequence's span; everything else runs ``replaced``, the (attention, mask) pair of the
    implementation the model ran (sdpa, or the modeling module's eager forward with its additive mask).

    For a decode step the mask function returns the spans (_decode_spans) instead of a mask: the attention function
    sees an integer or a 2D boolean tensor and knows it may use the kernel, or, for a call the kernel does not
    compute, turns it into the mask ``replaced`` takes. The module's ``sliding_window`` argument is not read: like
    sdpa, the kernel attends what the mask lets in. The kernel gets ``starts``, ``softcap``, ``sinks`` and
    ``visible`` only where the call has them, so a kernel of the plain signature (q, k, v, lengths, scale) serves
    every model without those variants."""
    replaced_attention, replaced_mask = replaced
    eager = replaced_mask is AttentionMaskInterface._global_mapping["eager"]
    # the variants the replaced implementation computes: a modeling module's own eager forward its model's, a
    # registered one those its signature names (sdpa has no softcap and no sinks: Gemma 2 under sdpa runs
    # uncapped, and the kernel computes what the model ran)
    named = None if eager else inspect.signature(replaced_attention).parameters

    def mask(**kwargs):
        spans = _decode_spans(kwargs)
        return replaced_mask(**kwargs) if spans is None else spans

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        spans = _spans(attention_mask, key.shape[2])
        if spans is not None and _kernel_computes(query, key, value, kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            variants = {"starts": spans.get("starts"), "visible": spans.get("visible"),
                        **{name: kwargs.get(given) for name, given in (("softcap", "softcap"), ("sinks", "s_aux"))
                           if named is None or given in named}}
            return fusion(query, key, value, spans["lengths"], scale,
                          **{name: given for name, given in variants.items() if given is not None}), None
        if spans is not None:
            attention_mask = _span_mask(spans, key.shape[2], query.dtype if eager else None)
        return replaced_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    attention.input_scales = softcap_scales
    return attention, mask


def softcap_scales(module, query, key, value, scaling=None, softcap=None, **kwargs) -> tuple[float, ...]:
    """The power of two that lifts this call's largest score to between a sixteenth and an eighth of the logit cap
    (its query times it), for the gate to run the call at as well. Random weights give scores of a few thousandths,
    which a cap of 50 leaves straight to a part in 10^9, so a kernel that forgot the cap computes the same there and
    is wrong at a trained model's scores. Lifted, the cap bends the largest scores by a part in 10^3 (a forgotten cap
    moves the output by 1e-4 or more, hundreds of fp32 roundings) while the softmax stays well conditioned: at
    scores near the cap every rounding of a score is amplified, and a correct kernel's error would scatter past
    the bound. Nothing for a call without a cap."""
    if not softcap or query.shape[1] % key.shape[1]:
        return ()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    grouped = query.float().reshape(key.shape[0], key.shape[1], -1, query.shape[-1])
    largest = (grouped @ key.float().transpose(-1, -2)).abs().max().item() * scale
    factor = 2.0 ** math.ceil(math.log2(softcap / 16 / largest)) if largest > 0 else 1.0
    return (factor,) if factor != 1.0 else ()
