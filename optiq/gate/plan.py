"""What the gate will run: its concurrencies, steps, prompt and engine mode, and so the engines it will build.

Compile-ahead (optiq.compile_ahead) reads ``engines`` to step a one-layer copy of the fused model through the same
engines before the gate meets them."""

from __future__ import annotations

from dataclasses import dataclass


def decode_cache_len(prompt_len: int, steps: int) -> int:
    """The cache of a teacher-forced decode of ``steps`` steps after a prompt of ``prompt_len``."""
    return prompt_len + steps + 1


@dataclass(frozen=True)
class GatePlan:
    concurrencies: tuple[int, ...] = (1, 4)
    steps: int = 64  # teacher-forced decode steps of the end-to-end check
    prompt_len: int = 16
    mode: str = "eager"  # the engine mode that will be measured, so the gate checks what will run
    seed: int = 0

    @classmethod
    def for_workload(cls, concurrencies, steps: int, prompt_len: int, max_len: int, mode: str) -> GatePlan:
        """The plan for a measured workload: its concurrencies and mode, and its prompt cut to leave the
        teacher-forced steps room in a cache of ``max_len``."""
        return cls(tuple(concurrencies), steps, min(prompt_len, max_len - steps - 1), mode)

    @property
    def capture_cache_len(self) -> int:
        """The cache of the engine whose one decode step records the patched sites' inputs (at the largest batch)."""
        return self.prompt_len + 2

    @property
    def decode_cache_len(self) -> int:
        """The cache of every teacher-forced decode."""
        return decode_cache_len(self.prompt_len, self.steps)

    def engines(self) -> list[tuple[int, int, int]]:
        """(batch, cache length, prompt length) of every engine the gate builds for the patched model, in the order
        it first runs them: the capture step's, then one teacher-forced decode per concurrency."""
        return [(max(self.concurrencies), self.capture_cache_len, self.prompt_len),
                *((c, self.decode_cache_len, self.prompt_len) for c in self.concurrencies)]
