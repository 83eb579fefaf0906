"""Device-aware timing: CUDA events on a GPU (device work is asynchronous), the host clock on a CPU.

CPU timings are smoke numbers (they show a step runs, not how fast a GPU runs it), but they should at least repeat:
on a shared 2-core machine identical runs measured the same step at 8 and at 48 ms. Two things made them wander, and
both are fixed here: torch's OpenMP team (one thread per core) stalls at every op's barrier whenever another process
holds one of its cores, so the CPU is timed with one thread (``fixed_threads``); and a mean lets one step stalled by
the scheduler move the whole repeat, so on the CPU every step is timed and a repeat counts as its median step
(``time_repeats``).
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

CPU_THREADS = 1  # the tiny models a CPU run is for step as fast on one thread as on two, and one never waits on another
_TRUE = {"1", "true", "on", "yes", "y"}  # what Triton reads as true in its TRITON_* variables, in any case


def triton_interpreted() -> bool:
    """Whether Triton's kernels run under its interpreter (TRITON_INTERPRET, set by optiq on the CPU): as Python on
    the host, so their timings are smoke numbers on any device."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def smoke(device: torch.device) -> bool:
    """Whether a timing on ``device`` is a smoke number: it shows the step runs, not how fast a GPU runs it."""
    return device.type == "cpu" or triton_interpreted()


class Timer:
    """``with Timer(device) as t: ...`` then ``t.seconds``; on CUDA the region is timed with events on the stream."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = float("nan")

    def __enter__(self):
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0
        return False


@contextmanager
def fixed_threads(device: torch.device) -> Iterator[int | None]:
    """Inside, torch runs its CPU ops on ``CPU_THREADS`` threads when ``device`` is the CPU (yields that count), and
    as it was on CUDA (yields None); the count it had is restored on the way out, so what runs outside is left as it
    was. A profile meant to agree with the timed step must run inside it too: on the default team, under load, the
    profiled ops of a 0.9 ms step summed to 15 ms."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield CPU_THREADS
    finally:
        torch.set_num_threads(before)


def time_repeats(step: Callable[[], object], reset: Callable[[], None], steps: int, repeats: int,
                 device: torch.device) -> list[float]:
    """Seconds per step of each of ``repeats`` runs of ``steps`` calls of ``step``, each run after ``reset()``: on
    CUDA a run's mean step, on the CPU its median step."""
    per_step = []
    for _ in range(repeats):
        reset()
        per_step.append(_mean_step(step, steps, device) if device.type == "cuda" else _median_step(step, steps))
    return per_step


def _mean_step(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """A run timed whole with events: a per-step synchronisation would change what is timed (a graph replay queues
    while the last one runs)."""
    with Timer(device) as run:
        for _ in range(steps):
            step()
    return run.seconds / steps


def _median_step(step: Callable[[], object], steps: int) -> float:
    """Each step timed on the host clock, which costs nothing beside a step on the CPU."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
