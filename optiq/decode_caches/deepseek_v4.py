"""DeepSeek-V4's static decode cache: every layer's state in device buffers indexed by absolute position, so that a
decode step has static shapes, no host synchronisation and no branch on a tensor's value, and a CUDA graph captures it.

HF's own cache (DeepseekV4HCACache, DeepseekV4CSACache) grows its compressor buffers by concatenation, counts the
compressed entries in host ints and branches on how many tokens a call brought; a graph holds none of that, and a
rewind needs a copy of the whole cache. Here a step at position ``p`` writes only what belongs to ``p``:

* ``window``: the sliding-window K=V of every position (HF keeps the last ``sliding_window - 1`` and the new one,
  so a step attends to positions ``p - sliding_window + 1 .. p``, gathered from the buffer);
* ``kv`` / ``gate``: each compressor's projections of every position, the gate with its ``position_bias`` already
  added (HF adds it before the softmax, and the CSA overlap state it keeps is the biased gate), so the window
  containing ``p`` can be pooled from buffers at every step;
* ``entries``: each compressor's compressed entry of every window, slot ``p // rate``, rewritten at each step of
  the window from its (possibly partial) positions and visible only once the window is closed: a mask of
  ``(p + 1) // rate`` entries, which is what HF's cache holds at position ``p``.

Since nothing of position ``q > p`` is ever read at ``p``, moving the engine's position counter back to any length
from the prefill's on is a whole rewind. The CSA overlap (window ``w - 1``'s Ca half) is read from that window's
buffered positions, and window 0's "no prior window" (zero kv, -inf gate) is a ``torch.where`` on ``w == 0``.

The prefill stays HF's: it runs on HF's own cache, which ``absorb`` converts (the sliding keys it kept, the
compressor buffers' remainder, the compressed entries, the overlap state). Given this cache, the attention's
forward (``_install_decode_forward``) takes the step through the module's own submodules and HF's
``apply_rotary_pos_emb`` and attention function, looked up when called, so the numbers follow the installed
transformers and any recipe that patched them; given any other, it is HF's.
"""

from __future__ import annotations

import copy
import functools
import sys
import types

import torch
from transformers import DynamicCache
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, bidirectional_mask_function, eager_mask,
                                      sdpa_mask)

from optiq.decode_caches.base import StaticDecodeCache, converted_tensor
from optiq.errors import OptiqError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _hf(attention: torch.nn.Module) -> types.ModuleType:
    """The modeling module the attention comes from: its functions are looked up at each call, as HF's forward does
    (a recipe's ``function`` patch of them applies here too)."""
    return sys.modules[type(attention).__module__]


def _rows_at(buffer: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[b, index[b, j]]`` for [batch, positions, ...] and an index [batch, n]: a gather of static shape.
    ``rows`` is ``arange(batch)``, made once with the cache: in a captured step every arange is a kernel."""
    return buffer[rows[:, None], index]


def _write(buffer: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
    """``buffer[b, index[b]] = value[b]`` in place, for an index [batch] on the device (``rows`` as for
    ``_rows_at``). No cast: the buffer has the dtype HF gives the value, and a buffer that had another would fail
    here rather than round silently."""
    buffer.index_put_((rows, index), value)


def _mask(implementation_mask, **kwargs) -> torch.Tensor | None:
    """The attention implementation's mask, but for HF's eager one made here: ``eager_mask`` turns sdpa's boolean
    mask into 0 / min with a ``torch.tensor(0.0)`` made on the host at every call, a copy no CUDA graph captures;
    the same values are filled in on the device instead."""
    if implementation_mask is not eager_mask:
        return implementation_mask(**kwargs)
    dtype = kwargs.pop("dtype")
    allowed = sdpa_mask(**kwargs, allow_is_causal_skip=False)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                      torch.finfo(dtype).min)


def _output_dtype(norm: torch.nn.Module, width: int, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype ``norm`` gives an input of ``dtype``: its weights' (fp32 in transformers 5.25) or the input's."""
    return norm(torch.zeros(1, 1, width, dtype=dtype, device=device)).dtype


def window_slots(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rate: int, overlap: int,
                 rows: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of the window of ``rate`` positions holding positions[b], gathered from the per-position buffers
    kv and gate [batch, positions, width]: (kv, gate) [batch, slots, width - overlap]. With ``overlap`` (CSA's two
    series) the previous window's first ``overlap`` features come first (kv 0 and gate -inf before the first
    window), then this window's features from ``overlap`` on. ``rows`` and ``offsets`` are ``arange(batch)`` and
    ``arange(rate)``, made once with the cache."""
    start = positions // rate * rate
    slots = start[:, None] + offsets  # [batch, rate]
    window_kv, window_gate = _rows_at(kv, rows, slots), _rows_at(gate, rows, slots)
    if not overlap:
        return window_kv, window_gate
    first = (start == 0)[:, None, None]
    previous = (slots - rate).clamp(min=0)
    prior_kv = _rows_at(kv, rows, previous)[..., :overlap].masked_fill(first, 0.0)
    prior_gate = _rows_at(gate, rows, previous)[..., :overlap].masked_fill(first, float("-inf"))
    return (torch.cat([prior_kv, window_kv[..., overlap:]], dim=1),
            torch.cat([prior_gate, window_gate[..., overlap:]], dim=1))


def pool_window(window_kv: torch.Tensor, window_gate: torch.Tensor) -> torch.Tensor:
    """A window's slots' kv [batch, slots, features] weighted by the softmax over the slots of their gates (in fp32
    or wider, the weights then in kv's dtype, as HF's compressor computes it) and summed: [batch, features]."""
    # The softmax taken along the last dim of a transposed copy: torch's softmax over a middle dim is a kernel that
    # spends ~24 us on HCA's [1, 128, 512] at one row.
    weights = window_gate.transpose(1, 2).softmax(dim=-1, dtype=torch.promote_types(window_gate.dtype, torch.float32))
    return (window_kv * weights.transpose(1, 2).to(window_kv.dtype)).sum(dim=1)


def pool_position(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rate: int, overlap: int,
                  rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The compressed entry, before its norm, of the window holding positions[b]: ``pool_window`` of its
    ``window_slots``, [batch, width - overlap]. Looked up at each call, so a recipe may replace it (a ``function``
    patch of ``optiq.decode_caches.deepseek_v4:pool_position``) and graphs capture the replacement."""
    return pool_window(*window_slots(kv, gate, positions, rate, overlap, rows, offsets))


class _Compression:
    """One compressor's state (a layer's, or a CSA indexer's): per-position projections and per-window entries.

    ``overlap`` is CSA's two-series layout: ``kv_proj`` gives ``2 * head_dim`` features, the first half (Ca) pooled
    into the next window's entry and the second (Cb) into its own, so an entry pools ``2 * rate`` slots."""

    def __init__(self, compressor: torch.nn.Module, overlap: bool, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.rate, self.overlap, self.head_dim = compressor.compress_rate, overlap, compressor.head_dim
        width = compressor.kv_proj.out_features
        gate_dtype = torch.promote_types(dtype, compressor.position_bias.dtype)  # HF adds the bias, promoting
        entry_dtype = _output_dtype(compressor.kv_norm, self.head_dim, dtype, device)  # of the pooled kv's norm
        # Whole windows (the last one's positions past max_len are pooled, never seen), and zeros, not empty: a
        # masked slot is multiplied by a zero weight, which a NaN of garbage would survive.
        windows = -(-max_len // self.rate)
        self.kv = torch.zeros(batch, windows * self.rate, width, dtype=dtype, device=device)
        self.gate = torch.zeros(batch, windows * self.rate, width, dtype=gate_dtype, device=device)
        self.entries = torch.zeros(batch, windows, self.head_dim, dtype=entry_dtype, device=device)
        self.rows, self.offsets, self.slots = (torch.arange(n, device=device) for n in (batch, self.rate, windows))

    def absorb(self, cache_layer, name: str, compressor: torch.nn.Module, length: int, rows: slice) -> None:
        """Fill ``rows`` from HF's cache layer after their prefill of ``length`` positions: the buffer's remainder
        (the open window's positions), the compressed entries of the closed windows and, for CSA, the Ca half of the
        last closed window (HF's overlap state, the gate already biased)."""
        closed = length // self.rate
        remainder = cache_layer.buffer_kv[name]
        if remainder is not None and remainder.shape[1]:
            start = closed * self.rate
            self.kv[rows, start:length] = remainder
            self.gate[rows, start:length] = (cache_layer.buffer_gate[name]
                                             + compressor.position_bias[:remainder.shape[1]])
        if closed:
            self.entries[rows, :closed] = cache_layer.compressed_kv[name]
        if self.overlap and closed:
            last = slice((closed - 1) * self.rate, closed * self.rate)
            self.kv[rows, last, :self.head_dim] = cache_layer.overlap_kv[name]
            self.gate[rows, last, :self.head_dim] = cache_layer.overlap_gate[name]

    def step(self, compressor: torch.nn.Module, hidden_states: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Write position ``position`` [batch]'s projections, pool the window containing it into its slot, and
        return how many entries are visible [batch] (the closed windows)."""
        hf = _hf(compressor)
        kv = compressor.kv_proj(hidden_states)[:, 0]
        gate = compressor.gate_proj(hidden_states)[:, 0] + compressor.position_bias[position % self.rate]
        _write(self.kv, self.rows, position, kv)
        _write(self.gate, self.rows, position, gate)
        window = position // self.rate
        start = window * self.rate
        pooled = pool_position(self.kv, self.gate, position, self.rate, self.head_dim if self.overlap else 0,
                               self.rows, self.offsets)
        pooled = compressor.kv_norm(pooled)[:, None]  # [batch, 1, head_dim]
        cos, sin = compressor.rotary_emb(pooled, position_ids=start[:, None], layer_type=compressor.rope_layer_type)
        pooled = hf.apply_rotary_pos_emb(pooled.unsqueeze(1), cos, sin).squeeze(1)
        _write(self.entries, self.rows, window, pooled[:, 0])
        return (position + 1) // self.rate

    def converted(self, dtype: torch.dtype | None, scale: float | None) -> _Compression:
        copied = copy.copy(self)
        copied.kv, copied.gate, copied.entries = (converted_tensor(t, dtype, scale)
                                                  for t in (self.kv, self.gate, self.entries))
        return copied

    def visible(self, count: torch.Tensor) -> torch.Tensor:
        """[batch, slots]: which entries a query sees, the first ``count`` of each sequence."""
        return self.slots[None] < count[:, None]


class _Layer:
    """One attention layer's state: the sliding window, and the compressor's (and the indexer's) for CSA and HCA."""

    def __init__(self, attention: torch.nn.Module, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.sliding_window = attention.sliding_window
        self.rows = torch.arange(batch, device=device)
        self.recent = torch.arange(1 - self.sliding_window, 1, device=device)  # a step's window, relative to it
        self.mask_dtype = dtype  # HF's masks have the dtype of the embeddings
        self.window = torch.zeros(batch, max_len, attention.head_dim, device=device,
                                  dtype=_output_dtype(attention.kv_norm, attention.head_dim, dtype, device))
        compressor = attention.compressor
        self.compression = self.indexing = None
        if compressor is not None:
            csa = attention.layer_type == CSA
            self.compression = _Compression(compressor, csa, batch, max_len, dtype, device)
            if csa:
                self.indexing = _Compression(compressor.indexer, True, batch, max_len, dtype, device)
                self.top_k = min(compressor.indexer.index_topk, self.indexing.entries.shape[1])

    def absorb(self, attention: torch.nn.Module, cache_layer, length: int, rows: slice) -> None:
        kept = cache_layer.keys[:, 0]  # [rows, kept, head_dim]: the last positions before ``length``
        self.window[rows, length - kept.shape[1]:length] = kept
        if self.compression is not None:
            self.compression.absorb(cache_layer, "compressor", attention.compressor, length, rows)
        if self.indexing is not None:
            self.indexing.absorb(cache_layer, "indexer", attention.compressor.indexer, length, rows)

    def converted(self, dtype: torch.dtype | None, scale: float | None) -> _Layer:
        copied = copy.copy(self)
        copied.window = converted_tensor(self.window, dtype, scale)
        copied.mask_dtype = dtype or self.mask_dtype
        copied.compression, copied.indexing = (None if c is None else c.converted(dtype, scale)
                                               for c in (self.compression, self.indexing))
        return copied

    def attend(self, attention: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
               position_ids: torch.Tensor):
        """One token per sequence through the module's own parts, as HF's forward computes it, over the keys this
        layer gives instead of HF's concatenations."""
        hf = _hf(attention)
        cos, sin = position_embeddings[attention.rope_layer_type]
        hidden_shape = (*hidden_states.shape[:2], -1, attention.head_dim)
        q_residual = attention.q_a_norm(attention.q_a_proj(hidden_states))
        q = attention.q_b_norm(attention.q_b_proj(q_residual).view(hidden_shape).transpose(1, 2))
        q = hf.apply_rotary_pos_emb(q, cos, sin)
        kv = attention.kv_norm(attention.kv_proj(hidden_states)).view(hidden_shape).transpose(1, 2)
        kv = hf.apply_rotary_pos_emb(kv, cos, sin)
        keys, seen = self.keys(attention, kv, hidden_states, q_residual, position_ids)
        # The keys a query does not see, said as HF's masks say it (padding, a 2D attention_mask, over a full mask),
        # through the implementation's own mask function, as HF's model builds its masks: a recipe's attention
        # interface registers its own, which reads that convention and which the gate records.
        implementation = attention.config._attn_implementation
        mask = _mask(ALL_MASK_ATTENTION_FUNCTIONS[implementation], batch_size=seen.shape[0], q_length=1,
                     kv_length=seen.shape[1], mask_function=bidirectional_mask_function, attention_mask=seen,
                     dtype=self.mask_dtype, device=seen.device)
        interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(implementation, hf.eager_attention_forward)
        attn_output, attn_weights = interface(attention, q, keys, keys, mask, dropout=0.0, scaling=attention.scaling,
                                              sliding_window=attention.sliding_window, s_aux=attention.sinks)
        attn_output = hf.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = attn_output.reshape(*hidden_states.shape[:2], attention.config.o_groups, -1)
        return attention.o_b_proj(attention.o_a_proj(grouped).flatten(2)), attn_weights

    def keys(self, attention: torch.nn.Module, kv: torch.Tensor, hidden_states: torch.Tensor,
             q_residual: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's entries; return the keys (= values) a query at ``position_ids`` [batch, 1] attends to,
        [batch, 1, n, head_dim], and which of them it sees, [batch, n]: the sliding window, oldest first, then the
        closed compressed entries (HCA: all, CSA: the indexer's top-k)."""
        position = position_ids[:, 0]
        _write(self.window, self.rows, position, kv[:, 0, 0])
        recent = position[:, None] + self.recent
        keys, seen = [_rows_at(self.window, self.rows, recent.clamp(min=0))], [recent >= 0]
        if self.compression is not None:
            count = self.compression.step(attention.compressor, hidden_states, position)
            if self.indexing is None:
                keys.append(self.compression.entries)
                seen.append(self.compression.visible(count))
            else:
                picked = self._top_k(attention.compressor.indexer, hidden_states, q_residual, position_ids)
                keys.append(_rows_at(self.compression.entries, self.rows, picked))
                seen.append(picked < count[:, None])
        keys = torch.cat(keys, dim=1)[:, None]  # promoting as HF's concatenation does
        return keys, torch.cat(seen, dim=1)

    def _top_k(self, indexer: torch.nn.Module, hidden_states: torch.Tensor, q_residual: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        """The indexer's picks [batch, top_k] among the closed entries, as HF's indexer scores them; a pick past the
        closed ones (fewer closed than top_k) is its -1 sentinel's case, masked by the caller."""
        hf = _hf(indexer)
        count = self.indexing.step(indexer, hidden_states, position_ids[:, 0])
        cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual).view(*hidden_states.shape[:2], -1, indexer.head_dim).transpose(1, 2)
        q = hf.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
        scores = indexer.scorer(q, self.indexing.entries, hidden_states)[:, 0]  # [batch, slots]
        scores = scores.masked_fill(~self.indexing.visible(count), float("-inf"))
        return scores.topk(self.top_k, dim=-1).indices


_INSTALLED: set[type] = set()  # the attention classes whose forward takes static-cache steps


def _install_decode_forward(attention_class: type) -> None:
    """Make the attention class's forward take a step on the static cache, and leave every other call (the prefill,
    HF's own cache, no cache, the gate's references) to HF's forward untouched. On the class, once: the modules
    stay as they were (a profiler's wrapper on an instance calls this forward as it would HF's), and what reads
    the class's forward (its signature, its name) finds HF's through ``functools.wraps``."""
    if attention_class in _INSTALLED:
        return
    hf_forward = attention_class.forward

    @functools.wraps(hf_forward)
    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, StaticDeepseekV4Cache):
            return cache.layers[self.layer_idx].attend(self, hidden_states, position_embeddings, position_ids)
        return hf_forward(self, hidden_states, position_embeddings, position_ids, attention_mask, **kwargs)

    attention_class.forward = forward
    _INSTALLED.add(attention_class)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "DeepseekV4Attention"]


class StaticDeepseekV4Cache(StaticDecodeCache):
    """The whole model's static decode state, one ``_Layer`` per attention layer (by ``layer_idx``), allocated at
    construction for ``batch`` sequences of ``max_len`` positions, so that a concurrency that does not fit fails
    before any work. Each tensor has the dtype HF's own code gives it when the model computes in ``dtype`` (the gate
    promoted by the fp32 ``position_bias``, a norm's output as that norm makes it), so storing a step is exact.

    Building it installs the decode forward on the model's attention class (``_install_decode_forward``)."""

    # The model builds no mask for a step (HF's forward takes a dict of masks per layer type as ready): each layer's
    # decode forward builds its own, over the keys it attends to.
    step_kwargs = {"attention_mask": {SLIDING: None}}

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.prefilled = 0
        attentions = _attention_modules(model)
        with torch.no_grad():
            self.layers = {a.layer_idx: _Layer(a, batch, max_len, dtype, device) for a in attentions}
        for attention_class in {type(a) for a in attentions}:
            _install_decode_forward(attention_class)

    def prefill_cache(self, model: torch.nn.Module):
        """HF's own cache for the prefill, which ``absorb`` converts afterwards."""
        return DynamicCache(config=model.config)

    @torch.no_grad()
    def absorb(self, model: torch.nn.Module, hf_cache, length: int, rows: slice) -> None:
        """Take over HF's cache of sequences ``rows`` after their prefill of ``length`` positions."""
        for attention in _attention_modules(model):
            self.layers[attention.layer_idx].absorb(attention, hf_cache.layers[attention.layer_idx], length, rows)
        self.prefilled = length

    def converted(self, dtype: torch.dtype | None = None, scale: float | None = None,
                  layers: set[int] | None = None) -> StaticDeepseekV4Cache:
        copied = copy.copy(self)
        copied.layers = {index: layer.converted(dtype, scale) if layers is None or index in layers else layer
                         for index, layer in self.layers.items()}
        return copied

    def seek(self, length: int) -> None:
        """Nothing moves (a step's positions are the engine's counter); a length before the end of the prefill is
        refused: the buffers hold no sliding keys or compressor positions from before what HF's cache kept."""
        if length < self.prefilled:
            raise OptiqError(f"DeepSeek-V4's static decode cache cannot be rewound to {length} positions, before the "
                             f"end of the prefill ({self.prefilled})")


def problem(model: torch.nn.Module) -> str:
    """Why the static cache cannot decode the model ("" when it can): a layer type it does not know, or an
    attention module with a forward of its own (a recipe's), which would bypass the decode forward."""
    config = model.config.get_text_config(decoder=True)
    unknown = sorted(set(config.layer_types) - {SLIDING, CSA, HCA})
    if unknown:
        return f"DeepSeek-V4's static decode cache does not know its {', '.join(unknown)} layers"
    if any("forward" in vars(attention) for attention in _attention_modules(model)):
        return "its attention's forward is replaced, which would bypass DeepSeek-V4's static decode cache"
    return ""
