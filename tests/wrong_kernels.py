"""Deliberately wrong kernels, each a bug a real fusion has shipped with (the validation gate must reject every one),
and user recipes that point at them."""

import re
from importlib import resources
from pathlib import Path

import torch

from optiq.decode_caches.deepseek_v4 import window_slots
from optiq.fusions.attention_prologue import attention_prologue
from optiq.fusions.decode_attention import decode_attention_reference
from optiq.fusions.greedy_sample import greedy_sample_reference
from optiq.fusions.indexer_scores import indexer_scores_reference
from optiq.fusions.linear import grouped_linear_reference
from optiq.fusions.mla_decode import mla_decode_reference
from optiq.fusions.moe_experts import moe_experts_reference
from optiq.fusions.moe_router import route_reference
from optiq.fusions.qkv_proj import qkv_proj_reference
from optiq.fusions.rmsnorm import rmsnorm_reference
from optiq.fusions.rope import rope_reference, trailing_rope_reference
from optiq.fusions.softmax_pool import softmax_pool_reference
from optiq.fusions.swiglu import swiglu_reference
from optiq.patching.structure import stream_mixing


def user_recipe(directory: Path, base: str, name: str, **fields: str):
    """A user recipe file in ``directory``: the built-in ``base`` renamed, with top-level or [patch] string fields
    replaced (``with_`` for ``with``), or added at the top where ``base`` has none (``replaces``); returns it as the
    catalog loads it."""
    from optiq.catalog.recipes import load_catalog

    text = resources.files("optiq.builtin_recipes").joinpath(f"{base}.toml").read_text()
    for key, value in {"name": name, **fields}.items():
        key = key.rstrip("_")
        text, found = re.subn(rf'^{key} = ".*"$', f'{key} = "{value}"', text, count=1, flags=re.M)
        text = text if found else f'{key} = "{value}"\n{text}'
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.toml").write_text(text)
    return load_catalog([str(directory)])[name]


_accumulators: dict[tuple, torch.Tensor] = {}


def norm_without_eps(x, weight, eps, offset=False, out=None):
    """RMSNorm that forgot eps: off by eps / mean(x^2), about 1e-3 relative on the tiny presets."""
    return rmsnorm_reference(x, weight, 0.0, offset)


def norm_without_weight(x, weight, eps, offset=False, out=None):
    """RMSNorm that forgot the learned weight: the same function wherever the weights are all ones."""
    return rmsnorm_reference(x, torch.zeros_like(weight) if offset else torch.ones_like(weight), eps, offset)


def norm_weight_on_half(x, weight, eps, offset=False, out=None):
    """RMSNorm that applies the weight to the first half of the hidden size only (ones on the rest)."""
    half = weight.clone()
    half[weight.shape[-1] // 2:] = 0.0 if offset else 1.0
    return rmsnorm_reference(x, half, eps, offset)


def linear_without_bias(x, weight, bias=None):
    """A linear layer that forgot its bias: the same function wherever the biases are all zeros."""
    return x @ weight.T


def stale_rmsnorm(x, weight, eps, offset=False, out=None):
    """RMSNorm into an accumulator that is never zeroed: right on its first call, then each call adds the last."""
    acc = _accumulators.setdefault((tuple(x.shape), x.dtype), torch.zeros_like(x))
    acc += rmsnorm_reference(x, weight, eps, offset)
    return acc.clone()


def rope_wrong_way(q, k, cos, sin):
    """RoPE rotated by -angle (sin negated), in place as the real kernel."""
    q_out, k_out = rope_reference(q, k, cos, -sin)
    q.copy_(q_out)
    k.copy_(k_out)
    return q, k


def attention_drops_last(q, k_cache, v_cache, lengths, scale):
    """Decode attention that stops one position short: the token being decoded never sees itself."""
    return decode_attention_reference(q, k_cache, v_cache, lengths - 1, scale)


def experts_first_choice_only(x, top_k_index, top_k_weights, w_gate_up, w_down):
    """MoE experts that keep each token's first expert and drop the others (a top-k loop bound off by k - 1)."""
    return moe_experts_reference(x, top_k_index[:, :1], top_k_weights[:, :1], w_gate_up, w_down)


def prologue_writes_one_slot_early(x, w_qkv, split_sizes, bias, head_dim, cos, sin, k_cache, v_cache, positions,
                                   *norms):
    """An attention prologue that writes the new token's k and v one slot before the fill counter."""
    return attention_prologue(x, w_qkv, split_sizes, bias, head_dim, cos, sin, k_cache, v_cache, positions - 1, *norms)


def qkv_without_bias(x, w_qkv, split_sizes, bias=None):
    """Q, K and V as one GEMM that forgot the concatenated bias: the same function wherever the biases are zero."""
    return qkv_proj_reference(x, *w_qkv.split(list(split_sizes)))


def qkv_keys_as_values(x, w_qkv, split_sizes, bias=None):
    """Q, K and V as one GEMM whose split hands the keys back as the values too (an offset off by one width)."""
    q, k, _ = qkv_proj_reference(x, *w_qkv.split(list(split_sizes)),
                                 *(bias.split(list(split_sizes)) if bias is not None else ()))
    return q, k, k


def router_drops_last_expert(logits, top_k, renormalize, scale, out_dtype):
    """A router whose expert loop stops one short: the last expert is never chosen."""
    return route_reference(logits[:, :-1], top_k, renormalize, scale, out_dtype)


def router_ignores_groups(logits, top_k, groups=1, topk_group=1, group_top=2, **routing):
    """A router that chooses among all experts where the model keeps its best groups' only (DeepSeek-V3's
    group-limited choice dropped): the same experts whenever the best experts lie in the best groups."""
    return route_reference(logits, top_k, **routing)


def router_without_bias(logits, top_k, bias=None, **routing):
    """A router that chooses on the scores alone, its selection bias forgotten: the same experts wherever the bias
    is zero (a checkpoint's initial one)."""
    return route_reference(logits, top_k, **routing)


def router_drops_last_block(logits, top_k, **routing):
    """A router whose loop over experts stops a block short: the last eighth of the experts are never chosen (their
    logits read as -inf), which routing repeats every step if decode's few tokens never pick them."""
    masked = logits.clone()
    masked[:, -max(1, logits.shape[-1] // 8):] = float("-inf")
    return route_reference(masked, top_k, **routing)


def sampler_blind_to_first_block(logits, out=None):
    """A sampler whose tiles start one tile in: the first eighth of the vocabulary is never picked, which a step's
    random logits, their maxima in a few places, may never show."""
    blind = logits.clone()
    blind[..., :max(1, logits.shape[-1] // 8)] = float("-inf")
    return greedy_sample_reference(blind)


def sampler_last_of_ties(logits, out=None):
    """A sampler whose combine keeps the later of two equal maxima (torch.argmax keeps the first): random logits
    never tie."""
    return logits.shape[-1] - 1 - greedy_sample_reference(logits.flip(-1))


def mla_drops_last(q_lat, q_pe, c_cache, pe_cache, lengths, scale):
    """MLA decode that stops one position short: the new token's own latent is never attended to."""
    return mla_decode_reference(q_lat, q_pe, c_cache, pe_cache, lengths - 1, scale)


def linear_skips_last_k_column(x, weight, bias=None):
    """A GEMM whose K loop stops one column short (a masked tail tile that is never loaded)."""
    return torch.nn.functional.linear(x[..., :-1], weight[:, :-1], bias)


def gate_up_swapped(x, w_gate_up, activation="silu"):
    """The gate/up GEMM that reads the interleaved rows the other way round: act(up) * gate."""
    gate, up = (torch.nn.functional.linear(x, w_gate_up[i::2]) for i in (0, 1))
    return swiglu_reference(torch.cat((up, gate), dim=-1), activation)


def swiglu_always_silu(gate_up, out=None, activation="silu"):
    """A SwiGLU kernel that ignores the activation it is asked for: right on Llama, wrong on Gemma's GeGLU."""
    return swiglu_reference(gate_up, "silu")


def raising_norm(x, weight, eps, offset=False, out=None):
    """A kernel that fails at launch."""
    raise RuntimeError("out of shared memory")


def attention_whole_blocks_only(q, k_cache, v_cache, lengths, scale):
    """Decode attention whose split loop covers whole 16-position blocks only: a partial last block is dropped, which
    a context that is a multiple of 16 never shows."""
    return decode_attention_reference(q, k_cache, v_cache, lengths // 16 * 16, scale)


def mixing_single_iteration(streams, fn, base, scale, norm_eps, hc_eps, iterations):
    """A hyper-connection whose Sinkhorn loop ignores its count and normalises once (columns only): comb is no longer
    doubly stochastic. (One iteration short would be no bug on these weights: Sinkhorn has converged to fp32's
    precision long before the 20th.)"""
    return stream_mixing(streams, fn, base, scale, norm_eps, hc_eps, 1)


def mixing_without_base(streams, fn, base, scale, norm_eps, hc_eps, iterations):
    """A hyper-connection that forgot its learned base (HF initialises it to zeros)."""
    return stream_mixing(streams, fn, torch.zeros_like(base), scale, norm_eps, hc_eps, iterations)


def grouped_linear_shifted_blocks(x, weight, groups):
    """A grouped projection that takes each group through its neighbour's block of weight rows (an off-by-one
    group offset)."""
    blocks = weight.view(groups, weight.shape[0] // groups, -1)
    return grouped_linear_reference(x, blocks.roll(1, dims=0).reshape_as(weight), groups)


def grouped_linear_as_one_block(x, weight, groups):
    """A grouped projection computed as if its weight were one dense [N, G K] matrix over the flattened groups'
    inputs (the block-diagonal structure lost), where the shapes allow it."""
    flat = x.flatten(-2)
    dense = weight.repeat(1, groups)[:, :flat.shape[-1]]
    return torch.nn.functional.linear(flat, dense).view(*x.shape[:-1], -1) / groups


def attention_ignores_visibility(q, k_cache, v_cache, lengths, scale, sinks=None, visible=None):
    """Decode attention over gathered keys that attends all of them: the window's unfilled slots and the compressed
    entries not yet closed or not selected are weighed too."""
    return decode_attention_reference(q, k_cache, v_cache, lengths, scale, sinks=sinks)


def attention_without_sinks(q, k_cache, v_cache, lengths, scale, sinks=None, visible=None):
    """Decode attention that drops the sink logits from each softmax's denominator."""
    return decode_attention_reference(q, k_cache, v_cache, lengths, scale, visible=visible)


def trailing_rope_wrong_way(x, cos, sin):
    """DeepSeek-V4's rotation by -angle."""
    return trailing_rope_reference(x, cos, -sin)


def trailing_rope_half_split(x, cos, sin):
    """DeepSeek-V4's rotated channels paired as the llama family pairs them (i with i + R) instead of interleaved."""
    rotated = 2 * cos.shape[-1]
    head = x[..., -rotated:]
    interleaved = torch.stack(head.chunk(2, dim=-1), dim=-1).flatten(-2)
    turned = trailing_rope_reference(torch.cat([x[..., :-rotated], interleaved], dim=-1), cos, sin)[..., -rotated:]
    return torch.cat([x[..., :-rotated], torch.cat([turned[..., 0::2], turned[..., 1::2]], dim=-1)], dim=-1)


def experts_without_clamp(x, top_k_index, top_k_weights, w_gate_up, w_down, limit=None):
    """MoE experts that ignore DeepSeek-V4's SwiGLU clamp: right wherever no product passes the limit."""
    return moe_experts_reference(x, top_k_index, top_k_weights, w_gate_up, w_down)


def indexer_scores_without_relu(q, k, weights, scale):
    """A lightning indexer that forgot the ReLU: a key's negative dot products with some heads count against it."""
    return (q.float() @ k.float().transpose(-1, -2) * weights.float().unsqueeze(-1)).sum(dim=-2) * scale


def indexer_scores_heads_alike(q, k, weights, scale):
    """A lightning indexer that weighs every head alike, at the heads' mean weight (one weight read per sequence
    instead of one per head)."""
    return indexer_scores_reference(q, k, weights.float().mean(dim=-1, keepdim=True).expand(weights.shape), scale)


def _window(kv, gate, positions, rate, overlap):
    """The window's slots as optiq's V4 cache gathers them."""
    rows, offsets = torch.arange(kv.shape[0], device=kv.device), torch.arange(rate, device=kv.device)
    return window_slots(kv, gate, positions, rate, overlap, rows, offsets)


def pool_over_the_features(kv, gate, positions, rate, overlap=0):
    """A compressor's pooling that takes the softmax along the features instead of the window's slots."""
    values, gates = _window(kv, gate, positions, rate, overlap)
    return (values * gates.softmax(dim=2).to(values.dtype)).sum(dim=1)


def pool_without_the_last_slot(kv, gate, positions, rate, overlap=0):
    """A compressor's pooling that stops a slot short of the window (the position just written)."""
    values, gates = _window(kv, gate, positions, rate, overlap)
    return softmax_pool_reference(values[:, :-1], gates[:, :-1])
