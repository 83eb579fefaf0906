"""The decode engine: a KV cache (static wherever the model allows), one prefill, then greedy decode steps at
batch = concurrency.

Serving engines (vLLM, SGLang) replay one CUDA graph per batch size; ``mode="graph"`` does the same. A step is the
model's forward for one token per sequence, the greedy pick of the next token and the advance of the positions, so
one replay of the graph is one whole step and nothing in the loop waits on the host. The positions live in device
tensors that the step itself advances: the cache's per-layer fill counters (transformers' StaticCache) and the
``position_ids`` buffer. ``seek`` rewinds both, which lets the timing loop repeat the same decode from the same prompt.
A family whose layers StaticCache cannot hold may have a static decode cache of its own (``optiq.decode_caches``:
DeepSeek-V4's); any other model whose layers a static cache cannot hold decodes eagerly with its own cache
(``DecodeEngine``).
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import Cache, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from optiq.decode_caches import family_cache
from optiq.errors import OptiqError, first_line

WARMUP_STEPS = 3
OWN_CACHE_OUTPUTS = ("past_key_values", "cache_params", "cache", "state", "mems")  # where models return state


class CaptureError(OptiqError):
    """A decode step that graph mode cannot capture (it synchronizes with the host, or copies from it)."""


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by: ``cache`` from transformers 5.24, ``past_key_values`` before,
    ``cache_params`` for some recurrent models."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values", "cache_params") if name in params), "past_key_values")


def static_cache(model: torch.nn.Module, max_len: int) -> tuple[Cache | None, str]:
    """transformers' StaticCache for the model with every attention layer a full-length StaticLayer, or None and why
    not when the model has layers no StaticLayer holds (recurrent, linear attention, a layer type StaticCache does
    not know), does not take such a cache, or keeps its state elsewhere. What the model can take is found once, by
    a two-token forward on a cache of four positions, and kept on the model.

    A sliding-window or chunked layer becomes a full-length layer too: the model's masks apply the window or the
    chunk whatever the cache's length, and transformers' sliding layer keeps its fill on the host and rolls its
    buffer with a host-made index, which a CUDA graph cannot capture and ``seek`` cannot rewind."""
    config = model.config.get_text_config(decoder=True)
    if "_optiq_static" not in model.__dict__:
        model.__dict__["_optiq_static"] = _probe_static(model, config)
    why_not, _ = model.__dict__["_optiq_static"]
    return (_full_length_cache(config, max_len)[0], "") if not why_not else (None, why_not)


def static_layouts(model: torch.nn.Module) -> list[tuple[int, int, int] | None]:
    """(heads, key width, value width) of each layer's static cache as the probe found them (None: a layer that
    stores nothing), so an engine can allocate its whole cache up front."""
    static_cache(model, 1)
    return model.__dict__["_optiq_static"][1]


def _full_length_cache(config, max_len: int) -> tuple[Cache | None, str]:
    try:
        cache = StaticCache(config=config, max_cache_len=max_len)
    except Exception as exc:  # noqa: BLE001 - a layer type StaticCache does not know
        return None, f"transformers' StaticCache cannot hold it ({type(exc).__name__}: {first_line(exc)})"
    layers = []
    for layer in cache.layers:
        if isinstance(layer, StaticSlidingWindowLayer):
            layer = StaticLayer(max_cache_len=max_len)
        elif not (isinstance(layer, StaticLayer) or type(layer).__name__ == "DummyLayer"):  # a dummy stores nothing
            return None, f"its {type(layer).__name__}s are not attention layers a static cache holds"
        layers.append(layer)
    cache.layers = layers
    return cache, ""


@torch.inference_mode()
def _probe_static(model: torch.nn.Module, config) -> tuple[str, list]:
    cache, why_not = _full_length_cache(config, 4)
    if cache is None:
        return why_not, []
    device = next(model.parameters()).device
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    positions = {"position_ids": torch.arange(2, device=device)[None]} if "position_ids" in inspect.signature(
        model.forward).parameters else {}
    try:
        model(input_ids=tokens, use_cache=True, **positions, **{_cache_kwarg(model): cache})
    except Exception as exc:  # noqa: BLE001 - whatever the model's code raises on a cache it does not take
        return f"its forward does not take transformers' StaticCache ({type(exc).__name__}: {first_line(exc)})", []
    stored = [getattr(layer, "keys", None) is not None for layer in cache.layers]  # a dummy layer (Gemma-3n's
    if not any(stored):  # layers that share another's keys) is initialised and stores nothing
        return "it keeps its state outside transformers' cache", []
    return "", [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) if kept else None
                for layer, kept in zip(cache.layers, stored)]


def static_problem(model: torch.nn.Module) -> str:
    """Why the model's decode cannot run on a static cache ("" when it can): its family's own static cache, or
    transformers' StaticCache."""
    family, why_not = family_cache(model)
    return why_not if family is not None else static_cache(model, 1)[1]


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """The next token of each sequence, [batch, 1]: the greedy pick. Steps look it up here each time they run, so a
    recipe may replace it (a ``function`` patch of ``optiq.engine:sample_greedy``) and graphs capture the
    replacement."""
    return logits.argmax(-1, keepdim=True)


class DecodeEngine:
    """Decode ``batch`` sequences of one model with a cache of ``max_len`` positions.

    The cache is transformers' StaticCache wherever every layer is attention (``static_cache``): its fill counters
    are device tensors, so a step can be captured in a CUDA graph and ``seek`` can move every sequence to any
    length. A family with a static decode cache of its own (``optiq.decode_caches``) prefills on the model's own
    cache, which that cache then takes over, and is captured and rewound the same way, to any length from the
    prefill's on. Any other model (recurrent or linear-attention layers, caches of its own) decodes in eager mode
    with the cache it returns from the prefill, which ``seek`` can only rewind to the end of the prefill (from a
    copy kept then); a model that returns no transformers cache recomputes the whole sequence at each step, exact
    where a state of its own (RWKV's, XLNet's memory) is not. ``own_cache`` takes that last way for any model: HF's
    own step, as ``generate`` runs it (DynamicCache, or the architecture's own cache), the baseline a user starts
    from. ``forward`` replaces the model's own call in decode steps (e.g. a torch.compile'd forward); prefill always
    runs the model itself.
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, mode: str = "eager",
                 forward: Callable | None = None, dtype: torch.dtype | None = None, own_cache: bool = False):
        if mode not in ("eager", "graph"):
            raise ValueError(f"mode must be 'eager' or 'graph', not {mode!r}")
        if mode == "graph" and not torch.cuda.is_available():
            raise ValueError("graph mode needs CUDA")
        self.model, self.batch, self.max_len, self.mode = model, batch, max_len, mode
        self.forward = forward or model
        param = next(model.parameters())
        self.device, self.dtype = param.device, dtype or param.dtype
        family, family_problem = (None, "") if own_cache else family_cache(model)
        if own_cache:
            self.cache, self.why_not_static = None, "it decodes on its own cache, as asked"
        elif family is not None:
            # The family's cache allocates everything now, outside inference mode, as StaticCache's layers below.
            self.cache = None if family_problem else family(model, batch, max_len, self.dtype, self.device)
            self.why_not_static = family_problem
        else:
            self.cache, self.why_not_static = static_cache(model, max_len)
        self.family = family is not None and self.static  # the static cache is the family's own
        if self.static and not self.family:
            # Allocate the whole cache now, outside inference mode (the tensors stay ordinary ones the timing loop,
            # torch.compile and graphs may update): a concurrency that does not fit fails here, before any work.
            for layer, layout in zip(self.cache.layers, static_layouts(model)):
                if layout is not None:
                    heads, key_width, value_width = layout
                    layer.lazy_initialization(*(torch.empty(batch, heads, 0, width, dtype=self.dtype,
                                                            device=self.device) for width in (key_width, value_width)))
        self._prefilled: tuple[int, Cache] | None = None  # (length, copy of the cache then): the own cache's rewind
        self.recompute = False  # a model without a cache to continue from: each step is a forward of the sequence
        self._sequence: torch.Tensor | None = None  # [batch, length] tokens so far, for recompute
        self._params = set(inspect.signature(model.forward).parameters)
        self._cache_kw = _cache_kwarg(model)
        self._takes = {"position_ids", "cache_position", "logits_to_keep"} & self._params
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.length = 0  # host copy of the filled length, for bounds and the roofline
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None

    @property
    def static(self) -> bool:
        return self.why_not_static == ""

    def _model_call(self, fn: Callable, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    cache: Cache | None = None) -> torch.Tensor:
        """``fn``'s last logits, on the engine's cache or on ``cache`` (HF's, for a family cache's prefill)."""
        kwargs = {"use_cache": not self.recompute}
        cache = self.cache if cache is None else cache
        if cache is not None:
            kwargs[self._cache_kw] = cache
        if self.family and cache is self.cache:
            kwargs.update(self.cache.step_kwargs)
        if "position_ids" in self._takes:
            kwargs["position_ids"] = position_ids
        if "cache_position" in self._takes and not self.static and not self.recompute:  # recurrent models' conv state
            kwargs["cache_position"] = position_ids[0]
        if "logits_to_keep" in self._takes:
            kwargs["logits_to_keep"] = 1
        try:
            out = fn(input_ids=input_ids, **kwargs)
        except (OptiqError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own code: one line, not its traceback
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if fn is not self.model or capturing or "out of memory" in str(exc).lower():
                raise  # a peer's failure and out of memory are the sweep's to record, a capture's _capture's
            raise OptiqError(f"{type(self.model).__name__}'s forward failed ({type(exc).__name__}: "
                             f"{first_line(exc)})") from exc
        if not self.static and not self.recompute:
            returned = next((name for name in OWN_CACHE_OUTPUTS if getattr(out, name, None) is not None), None)
            if returned is None or not isinstance(getattr(out, returned), Cache):
                # GPT-1 and RecurrentGemma return none; RWKV's state and XLNet's memory are not a cache a step can
                # continue from exactly: recompute from now on
                self.recompute = True
                self.why_not_static += ", and it returns no cache" if returned is None else \
                    f", and its {returned} is not a transformers cache"
            else:
                self.cache = getattr(out, returned)
                if returned in self._params:  # the model takes its state back under the name it returned it by
                    self._cache_kw = returned
        return out.logits[:, -1]

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Fill the cache with ``prompt`` [batch, P] and set the first decode token; returns the last logits."""
        batch, length = prompt.shape
        if batch != self.batch or length >= self.max_len:
            raise ValueError(f"prompt {tuple(prompt.shape)} does not fit batch {self.batch}, max_len {self.max_len}")
        if self.static and not self.family:
            self.seek(0)
        elif not self.static:
            self.cache, self.recompute = None, False  # the model starts a cache of its own
            self._sequence = prompt.to(self.device)
        positions = torch.arange(length, device=self.device).expand(batch, length)
        if self.family:
            logits = torch.cat([self._family_prefill(prompt, positions, slice(start, start + self.cache.prefill_rows))
                                for start in range(0, batch, self.cache.prefill_rows)])
        else:
            logits = self._model_call(self.model, prompt.to(self.device), positions)
        self.tokens.copy_(sample_greedy(logits))
        if not self.static:
            self._prefilled, self.length = (length, copy.deepcopy(self.cache)), length
        self.seek(length)
        return logits

    def _family_prefill(self, prompt: torch.Tensor, positions: torch.Tensor, rows: slice) -> torch.Tensor:
        """Prefill ``rows`` of the batch on HF's own cache, then hand it to the family's static cache."""
        own = self.cache.prefill_cache(self.model)
        logits = self._model_call(self.model, prompt[rows].to(self.device), positions[rows], own)
        self.cache.absorb(self.model, own, prompt.shape[1], rows)
        return logits

    @torch.inference_mode()
    def seek(self, length: int) -> None:
        """Set the filled length of every sequence (the cache's counters and the next position) to ``length``. A
        model's own cache can only be rewound to the end of the prefill, a family's static cache to any length from
        there on."""
        if self.family:
            self.cache.seek(length)
        elif self.static:
            for layer in self.cache.layers:  # every fill counter: the KV one and a DSA indexer's, none in a dummy
                for name, value in vars(layer).items():
                    if name.endswith("cumulative_length") and isinstance(value, torch.Tensor):
                        value.fill_(length)
        elif self.recompute:
            if self._sequence is None or length > self._sequence.shape[1]:
                raise OptiqError(f"{type(self.model).__name__}'s decode holds no tokens up to {length} positions")
        elif self._prefilled is None or length != self._prefilled[0]:
            raise OptiqError(f"{type(self.model).__name__}'s own cache cannot be rewound to {length} positions "
                             f"({self.why_not_static})")
        elif length != self.length:
            self.cache = copy.deepcopy(self._prefilled[1])
        self.positions.fill_(length)
        self.length = length

    def _step(self) -> torch.Tensor:
        if self.recompute:
            self._sequence = torch.cat([self._sequence[:, :self.length], self.tokens], dim=1)
            positions = torch.arange(self._sequence.shape[1], device=self.device).expand(self.batch, -1)
            logits = self._model_call(self.forward, self._sequence, positions)
        else:
            logits = self._model_call(self.forward, self.tokens, self.positions)
        self.tokens.copy_(sample_greedy(logits))
        self.positions.add_(1)
        return logits

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One decode step for the whole batch; returns this step's logits [batch, vocab]."""
        if self.length >= self.max_len:
            raise RuntimeError(f"the cache is full ({self.max_len} positions)")
        if self.mode == "graph":
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self.graph_logits
        else:
            logits = self._step()
        self.length += 1
        return logits

    def _capture(self) -> None:
        """Warm up on a side stream (as torch.cuda.graphs requires), capture one step, and rewind to where we were."""
        if not self.static:
            raise CaptureError(_uncapturable(self.why_not_static))
        start, tokens = self.length, self.tokens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.graph_logits = self._step()
        except RuntimeError as exc:
            raise CaptureError(f"--mode graph cannot capture this model's decode step ({first_line(exc)})") from exc
        self.graph = graph
        self.seek(start)
        self.tokens.copy_(tokens)

    def release(self) -> None:
        """Drop the graph and the cache so their memory can be reused by the next concurrency."""
        self.graph = self.graph_logits = None
        self.cache = None


def _uncapturable(why_not_static: str) -> str:
    return (f"--mode graph cannot capture this model's decode step: {why_not_static}, so it decodes with the cache "
            "it makes itself, which a graph cannot hold")


def graph_mode_problem(model: torch.nn.Module) -> str:
    """Why graph mode cannot run the model's decode steps ("" when it can): the model decodes with a cache of its
    own, or a step at batch 1 does not capture. Callers fall back to eager mode with this line."""
    why_not = static_problem(model)
    if why_not:
        return _uncapturable(why_not)
    try:
        with opened(model, 1, WARMUP_STEPS + 4, "graph") as engine:
            engine.prefill(torch.zeros(1, 2, dtype=torch.long))
            engine.step()
    except CaptureError as exc:
        return str(exc)
    return ""


@contextmanager
def opened(model: torch.nn.Module, batch: int, max_len: int, mode: str = "eager", forward: Callable | None = None,
           own_cache: bool = False):
    """A DecodeEngine for the block; on the way out its graph and cache are released for the next one."""
    engine = DecodeEngine(model, batch, max_len, mode=mode, forward=forward, own_cache=own_cache)
    try:
        yield engine
    finally:
        engine.release()
