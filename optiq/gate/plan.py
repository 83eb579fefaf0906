"""What the gate will run: its concurrencies, steps, prompt, longest context and engine mode, and so the engines it
will build.

Compile-ahead (optiq.compile_ahead) reads ``engines`` to step a one-layer copy of the fused model through the same
engines before the gate meets them."""

from __future__ import annotations

from dataclasses import dataclass

from optiq.errors import OptiqError


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
    max_len: int | None = None  # the longest context the workload reaches (its cache), where the per-recipe check
    # records each site's inputs; None: the end-to-end decode's own


    @classmethod
    def for_workload(cls, concurrencies, steps: int, prompt_len: int, max_len: int, mode: str) -> GatePlan:
        """The plan for a measured workload: its concurrencies and mode, and its prompt cut to leave the
        teacher-forced steps room in a cache of ``max_len``."""
        if max_len - steps - 1 < 1:
            raise OptiqError(f"--max-len {max_len} leaves the gate's {steps} decode steps no room for a prompt: "
                             f"give --max-len at least {steps + 2} or fewer --gate-steps")
        return cls(tuple(concurrencies), steps, min(prompt_len, max_len - steps - 1), mode, max_len=max_len)

    @property
    def capture_cache_len(self) -> int:
        """The cache of the engines whose one decode step each records the patched sites' inputs (one per
        concurrency), the step's token its last position: the longest context the workload reaches."""
        return max(self.max_len or 0, self.decode_cache_len)

    def capture_points(self) -> list[tuple[int, int]]:
        """(batch, context) of each decode step whose sites' inputs the per-recipe check records, smallest batch
        first: the largest batch at the longest context, every other one (and, alone, the one batch too) a position
        short of it, at a context that is not a multiple of any block size (the longest is, for a power-of-two
        cache), so a kernel that mishandles a partial last block shows."""
        batches, longest = sorted(self.concurrencies), self.capture_cache_len
        ragged = [(b, longest - 1) for b in batches[:-1] or batches]
        return [*ragged, (batches[-1], longest)]

    @property
    def decode_cache_len(self) -> int:
        """The cache of every teacher-forced decode."""
        return decode_cache_len(self.prompt_len, self.steps)

    def engines(self) -> list[tuple[int, int, int]]:
        """(batch, cache length, prompt length) of every engine the gate builds for the patched model, in the order
        it first runs them: the capture steps', then one teacher-forced decode per concurrency (one entry each)."""
        return list(dict.fromkeys([*((c, self.capture_cache_len, self.prompt_len) for c in self.concurrencies),
                                   *((c, self.decode_cache_len, self.prompt_len) for c in self.concurrencies)]))
