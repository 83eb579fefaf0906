"""The decode engine: a static KV cache, one prefill, then greedy decode steps at batch = concurrency.

Serving engines (vLLM, SGLang) replay one CUDA graph per batch size; ``mode="graph"`` does the same. A step is the
model's forward for one token per sequence, the greedy pick of the next token and the advance of the positions, so
one replay of the graph is one whole step and nothing in the loop waits on the host. The positions live in device
tensors that the step itself advances: the cache's per-layer fill counters (transformers' StaticCache) and the
``position_ids`` buffer. ``seek`` rewinds both, which lets the timing loop repeat the same decode from the same prompt.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import StaticCache

from optiq.errors import OptiqError

WARMUP_STEPS = 3


class CaptureError(OptiqError):
    """A decode step that graph mode cannot capture (it synchronizes with the host, or copies from it)."""


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed ``past_key_values=`` to ``cache=``; earlier 5.x knows only the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_layout(config) -> tuple[int, int, int]:
    """(heads, key width, value width) of one layer's cache. MLA models (DeepSeek-V2/V3) cache their compressed latent
    as one head: the kv_lora_rank-wide latent where keys go and the shared rope key where values go."""
    if getattr(config, "kv_lora_rank", None):
        return 1, config.kv_lora_rank, config.qk_rope_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim, head_dim


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """The next token of each sequence, [batch, 1]: the greedy pick. Steps look it up here each time they run, so a
    recipe may replace it (a ``function`` patch of ``optiq.engine:sample_greedy``) and graphs capture the
    replacement."""
    return logits.argmax(-1, keepdim=True)


class DecodeEngine:
    """Decode ``batch`` sequences of one model with a static cache of ``max_len`` positions.

    ``forward`` replaces the model's own call in decode steps (e.g. a torch.compile'd forward); prefill always runs
    the model itself. ``dtype`` is the cache's, the model's own unless it computes in another (validation's reference).
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, mode: str = "eager",
                 forward: Callable | None = None, dtype: torch.dtype | None = None):
        if mode not in ("eager", "graph"):
            raise ValueError(f"mode must be 'eager' or 'graph', not {mode!r}")
        if mode == "graph" and not torch.cuda.is_available():
            raise ValueError("graph mode needs CUDA")
        self.model, self.batch, self.max_len, self.mode = model, batch, max_len, mode
        self.forward = forward or model
        param = next(model.parameters())
        self.device, self.dtype = param.device, dtype or param.dtype
        config = model.config.get_text_config(decoder=True)
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        # Allocate the whole cache now: a concurrency that does not fit fails here, before any work. (Each layer is
        # shown empty keys and values of its widths, as transformers' early_initialization does with equal widths.)
        heads, key_width, value_width = cache_layout(config)
        for layer in self.cache.layers:
            layer.lazy_initialization(*(torch.empty(batch, heads, 0, width, dtype=self.dtype, device=self.device)
                                        for width in (key_width, value_width)))
        self._cache_kw = _cache_kwarg(model)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.length = 0  # host copy of the filled length, for bounds and the roofline
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None

    def _model_call(self, fn: Callable, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = fn(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                           **{self._cache_kw: self.cache})
        return out.logits[:, -1]

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Fill the cache with ``prompt`` [batch, P] and set the first decode token; returns the last logits."""
        batch, length = prompt.shape
        if batch != self.batch or length >= self.max_len:
            raise ValueError(f"prompt {tuple(prompt.shape)} does not fit batch {self.batch}, max_len {self.max_len}")
        self.seek(0)
        positions = torch.arange(length, device=self.device).expand(batch, length)
        logits = self._model_call(self.model, prompt.to(self.device), positions)
        self.tokens.copy_(sample_greedy(logits))
        self.seek(length)
        return logits

    def seek(self, length: int) -> None:
        """Set the filled length of every sequence (the cache's counters and the next position) to ``length``."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self.positions.fill_(length)
        self.length = length

    def _step(self) -> torch.Tensor:
        logits = self._model_call(self.forward, self.tokens, self.positions)
        self.tokens.copy_(sample_greedy(logits))
        self.positions.add_(1)
        return logits

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One decode step for the whole batch; returns this step's logits [batch, vocab]."""
        if self.length >= self.max_len:
            raise RuntimeError(f"the static cache is full ({self.max_len} positions)")
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
            why = next(iter(str(exc).splitlines()), "")
            raise CaptureError(f"--mode graph cannot capture this model's decode step ({why}); use --mode eager") \
                from exc
        self.graph = graph
        self.seek(start)
        self.tokens.copy_(tokens)

    def release(self) -> None:
        """Drop the graph and the cache so their memory can be reused by the next concurrency."""
        self.graph = self.graph_logits = None
        self.cache = None


@contextmanager
def opened(model: torch.nn.Module, batch: int, max_len: int, mode: str = "eager", forward: Callable | None = None):
    """A DecodeEngine for the block; on the way out its graph and cache are released for the next one."""
    engine = DecodeEngine(model, batch, max_len, mode=mode, forward=forward)
    try:
        yield engine
    finally:
        engine.release()
