"""What the engine and the validation gate ask of a family's static decode cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class StaticDecodeCache(ABC):
    """A family's decode state in device buffers of fixed shape. The engine prefills ``prefill_rows`` sequences at a
    time, each group on a ``prefill_cache(model)`` of its own (the model's own cache), hands it to ``absorb(model,
    prefill_cache, length, rows)`` for those rows of the buffers, moves with ``seek(length)`` (raising OptiqError
    for a length it cannot rewind to) and adds ``step_kwargs`` to every decode step's call.

    The gate replays captured calls on ``converted(dtype, scale, layers)``: as transformers' caches are copied
    there, a copy whose floating buffers are converted to ``dtype`` or scaled by ``scale`` (those of ``layers`` only,
    when given), shared otherwise; sharing is safe because a step writes its own position before it reads it."""

    step_kwargs: dict = {}
    # HF's prefill of a family may attend eagerly, materialising [rows, heads, P, P] scores: DeepSeek-V4-Flash's 64
    # heads at P = 512 make 4 GiB in fp32 for 64 sequences (the gate's reference prefills in fp32), 1 GiB for 16.
    prefill_rows: int = 16

    @abstractmethod
    def prefill_cache(self, model: torch.nn.Module):
        ...

    @abstractmethod
    def absorb(self, model: torch.nn.Module, prefill_cache, length: int, rows: slice) -> None:
        ...

    @abstractmethod
    def seek(self, length: int) -> None:
        ...

    @abstractmethod
    def converted(self, dtype: torch.dtype | None = None, scale: float | None = None,
                  layers: set[int] | None = None) -> StaticDecodeCache:
        ...


def converted_tensor(value: torch.Tensor, dtype: torch.dtype | None, scale: float | None) -> torch.Tensor:
    """A buffer as ``StaticDecodeCache.converted`` gives it: scaled, converted, or the same tensor."""
    return value * scale if scale is not None else value.to(dtype) if dtype is not None else value
