"""Throughput against concurrency: one measured point per (variant, concurrency), written as soon as it exists.

A point is the standard decode measurement: prefill once, warm up (this is where a graph is captured and where
torch.compile compiles, and every kernel runs once), then decode ``new_tokens`` steps ``repeats`` times from the same
prompt and take the median repeat (``timing.time_repeats``: on the CPU each repeat is its median step).

A peer's warm-up may be given a budget: torch.compile of a model whose shapes change from step to step recompiles
for minutes (DeepSeek-V4's forward on HF's own cache, which grows: still compiling 170 s in), and a row that says why
it has no number within the call is worth more than a call that runs out of time with nothing.
"""

from __future__ import annotations

import gc
import signal
import statistics
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch

from optiq.engine import WARMUP_STEPS, opened
from optiq.errors import OptiqError
from optiq.measure.roofline import floor_ms_per_step
from optiq.measure.timing import Timer, fixed_threads, smoke, time_repeats
from optiq.record import Row, Workload


def check_workload(workload: Workload, steps_flag: str = "--new-tokens") -> None:
    """A workload that cannot run is the user's to fix: say which flags clash."""
    if min(workload.prompt_len, workload.new_tokens, workload.repeats) < 1:
        raise OptiqError("prompt length, new tokens and repeats must be positive")
    if workload.prompt_len + workload.new_tokens + WARMUP_STEPS > workload.max_len:
        raise OptiqError(f"--max-len {workload.max_len} is too short for --prompt-len {workload.prompt_len} + "
                         f"{steps_flag} {workload.new_tokens} + {WARMUP_STEPS} warm-up steps")


class Variant(NamedTuple):
    """One way of running the model that a sweep measures: the engine's ``mode`` (eager or graph), a ``forward``
    replacing the model's call in decode steps (torch.compile's), and whether it decodes on the cache the model makes
    itself (``own_cache``: HF's own step) rather than a static one."""
    name: str
    mode: str
    forward: Callable | None = None
    own_cache: bool = False


def compiled_forward(model: torch.nn.Module):
    """The peer a user would pick instead: the model's forward under torch.compile (Inductor), one shape per batch."""
    return torch.compile(model.forward, fullgraph=True, dynamic=False)


class OverBudget(BaseException):
    """Raised in the main thread when a peer's warm-up runs past its budget: a BaseException, so that no ``except
    Exception`` inside torch.compile takes it for a compile error of its own and carries on."""


@contextmanager
def warm_up_within(seconds: float | None):
    """Raise ``OverBudget`` in the block once ``seconds`` have passed (a real-time timer's signal), until the
    yielded ``stop()`` is called; no budget when ``seconds`` is None or off the main thread (where signals cannot be
    delivered)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def expire(signum, frame):
        raise OverBudget

    def stop() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield stop
    finally:
        stop()
        signal.signal(signal.SIGALRM, previous)


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_point(model: torch.nn.Module, batch: int, workload: Workload, mode: str, bandwidth: float,
                  forward=None, variant: str | None = None, budget_s: float | None = None,
                  own_cache: bool = False) -> Row:
    """Measure decode throughput of ``model`` at concurrency ``batch``; returns one row of the sweep. On the CPU it
    is timed on ``timing.CPU_THREADS`` threads, each repeat its median step, and marked a smoke number. With
    ``budget_s``, ``OverBudget`` is raised if the engine's set-up, the prefill and the warm-up take longer; with
    ``own_cache`` the model decodes on the cache it makes itself (``DecodeEngine``)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with (fixed_threads(device) as threads, warm_up_within(budget_s) as warmed_up,
          opened(model, batch, workload.max_len, mode, forward, own_cache) as engine):
        generator = torch.Generator().manual_seed(batch)
        prompt = torch.randint(model.config.get_text_config(decoder=True).vocab_size, (batch, workload.prompt_len),
                               generator=generator)
        with Timer(device) as prefill:
            engine.prefill(prompt)
        first_tokens = engine.tokens.clone()
        with Timer(device) as warmup:
            for _ in range(WARMUP_STEPS):
                engine.step()
        warmed_up()

        def reset() -> None:
            engine.seek(workload.prompt_len)
            engine.tokens.copy_(first_tokens)

        repeats = time_repeats(engine.step, reset, workload.new_tokens, workload.repeats, device)
    ms_per_step = statistics.median(repeats) * 1e3
    floor_ms = floor_ms_per_step(model, batch, workload.mean_length, bandwidth)
    return Row(
        variant=variant or mode, mode=mode, concurrency=batch, status="ok",
        tok_per_s=batch / ms_per_step * 1e3,
        ms_per_step=ms_per_step,
        ms_per_step_repeats=[seconds * 1e3 for seconds in repeats],
        prefill_ms=prefill.seconds * 1e3,
        warmup_s=warmup.seconds,
        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        floor_ms_per_step=floor_ms,
        floor_tok_per_s=batch / floor_ms * 1e3,
        pct_of_floor=100 * floor_ms / ms_per_step,
        smoke=smoke(device),
        threads=threads,
    )


def sweep(model: torch.nn.Module, concurrencies: list[int], workload: Workload, variants: list[Variant],
          bandwidth: float, on_row=None, on_start=None, peer_budget_s: float | None = None) -> list[Row]:
    """Measure every (variant, concurrency); a point that runs out of memory, or where the peer (a variant with its own
    ``forward``, e.g. torch.compile) fails, is recorded and the sweep goes on. A peer whose warm-up runs past
    ``peer_budget_s`` gets a failed row saying so, and so do its later concurrencies, not tried: each would compile
    again, about as long.

    ``variants`` holds ``Variant``s (or their leading fields as a tuple); ``on_row(row)`` runs after each point (to
    save results as they come), ``on_start(variant, concurrency)`` before each (for progress).
    """
    rows: list[Row] = []
    for name, mode, forward, own_cache in (Variant(*variant) for variant in variants):
        over_budget = ""
        for batch in concurrencies:
            if on_start:
                on_start(name, batch)
            try:
                if over_budget:
                    row = Row(name, mode, batch, "failed", error=f"not tried: {over_budget}")
                else:
                    row = measure_point(model, batch, workload, mode, bandwidth, forward=forward, variant=name,
                                        budget_s=peer_budget_s if forward is not None else None, own_cache=own_cache)
            except OverBudget:
                torch._dynamo.reset()  # what it compiled so far, and its half-traced frame, go with it
                over_budget = f"its warm-up at C={batch} did not finish within {peer_budget_s:g} s (--peer-budget)"
                row = Row(name, mode, batch, "failed", error=f"over budget: {over_budget}")
            except Exception as exc:  # noqa: BLE001 - out-of-memory and a failing peer are recorded; the rest raises
                oom, peer_failed = is_out_of_memory(exc), forward is not None or own_cache  # a peer's is a result
                if not (oom or peer_failed):
                    raise
                first_line = next(iter(str(exc).splitlines()), "")
                row = Row(name, mode, batch, "oom" if oom else "failed",
                          error=f"{type(exc).__name__}: {first_line}"[:300])
            free_memory()
            rows.append(row)
            if on_row:
                on_row(row)
    return rows

