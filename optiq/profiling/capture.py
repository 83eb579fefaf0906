"""Capture Kineto traces of decode steps: an annotated eager trace (op linkage, roles, layers) and, in graph mode, a
trace of the graph replays that are what serving engines actually run."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from optiq.profiling.annotate import annotated, range_
from optiq.engine import WARMUP_STEPS, opened
from optiq.measure.timing import fixed_threads

PROFILED_STEPS = 4
# Kineto, torch.profiler's tracer, writes lines of its own to stderr at every start and stop (`USDT:<date> ...
# profiler_start`), noise among optiq's output. Its least severity shown is KINETO_LOG_LEVEL, read when it first
# starts; 6 lies past its most severe kind (USDT, 5), so it prints nothing. A level the user set (4: its errors) stays.
KINETO_QUIET = "6"


def capture(model: torch.nn.Module, batch: int, prompt_len: int, max_len: int, mode: str, path: Path,
            steps: int = PROFILED_STEPS) -> Path:
    """Decode ``steps`` steps of a ``batch``-sequence prompt under torch.profiler and write the trace to ``path``.

    Eager traces carry the role and layer annotations; graph traces only the step ranges (a replay runs no Python).
    """
    device = next(model.parameters()).device
    with opened(model, batch, max_len, mode) as engine:
        generator = torch.Generator().manual_seed(batch)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        engine.prefill(torch.randint(vocab, (batch, prompt_len), generator=generator))
        for _ in range(WARMUP_STEPS):
            engine.step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        path.parent.mkdir(parents=True, exist_ok=True)
        # One profiler warm-up step first: the tracer's own set-up (CUPTI instrumenting a graph on its first launch)
        # lands there, not in the first reported step.
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        _synchronize(device)
        with annotated(model, engine) if mode == "eager" else contextlib.nullcontext(), \
                profile(activities=activities, schedule=schedule,
                        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
            engine.step()
            prof.step()
            for n in range(steps):
                with range_(f"optiq/step/{n}"):
                    engine.step()
                if n == steps - 1:
                    _synchronize(device)  # the tracer stops at this prof.step(): let the last kernels finish
                prof.step()
    return path


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(model: torch.nn.Module, batch: int, prompt_len: int, max_len: int, mode: str, directory: Path,
                 steps: int = PROFILED_STEPS, tag: str = ""):
    """Capture and read the traces of one concurrency: the annotated eager step, and in graph mode the replay with
    its kernels aligned to the eager step's. Returns the trace of what is timed (the replay in graph mode). On the
    CPU the step runs on the threads it is timed on (``fixed_threads``), so its profile adds up to the timed step."""
    from optiq.traces.attribution import align_graph_with_eager
    from optiq.traces.reader import read_trace

    device = next(model.parameters()).device
    with fixed_threads(device):
        paths = {m: capture(model, batch, prompt_len, max_len, m, directory / f"trace_{tag}{m}_C{batch}.json.gz",
                            steps) for m in dict.fromkeys(("eager", mode))}
    timed = eager = read_trace(paths["eager"])
    if mode == "graph":
        timed = read_trace(paths["graph"])
        align_graph_with_eager(timed, eager)
    return timed
