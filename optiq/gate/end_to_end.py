"""The end-to-end check: teacher-forced greedy decode over the plan's steps at each concurrency with the
DecodeEngine, in the engine mode that will be measured (so a patch that breaks under CUDA-graph capture fails here).

The reference is the unpatched model itself for an fp32 model (then every greedy pick must be identical) or the same
model computing in fp32 otherwise (then the unpatched model's own distance to fp32 sets the scale). The reference
and unpatched decodes are computed once per gate (``baselines``) and shared by every set it checks; the reference's
logits stay on the device in fp32 and every other decode is compared with them step by step.

A patched decode runs the user's kernels: one that raises, calls sys.exit or runs past its deadline (minutes, or
``SLOWDOWN`` times the unpatched decode's own time: ``user_code.decode_deadline``) fails the set with that as its
``problem``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from optiq.engine import CaptureError, DecodeEngine
from optiq.gate.capture import prompt as gate_prompt
from optiq.gate.plan import GatePlan, decode_cache_len
from optiq.gate.references.fp32 import as_reference
from optiq.gate.rules import end_to_end_bounds, loosest
from optiq.patching import Patches
from optiq.patching.changes import Change
from optiq.patching.user_code import FAILURES, deadline, decode_deadline, describe
from optiq.record import EndToEndVerdict


def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int, forced: torch.Tensor | None,
           changes: list[Change], mode: str = "eager", dtype: torch.dtype | None = None,
           against: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode ``steps`` steps in engine ``mode`` with ``changes`` made (as the reference, computing in
    ``dtype``, if given); with ``forced`` (the reference's picks) the next input is always the reference's. Returns
    the logits [steps, batch, vocab] in float32 or, with ``against`` (logits of that shape), only the float64 sum of
    squares of the logits' difference from them, taken step by step so that a decode never holds more than one step
    of its own (all steps' logits of a large batch and vocabulary would not fit beside the reference's); and this
    model's own picks [steps + 1, batch]. Everything stays on the model's device: the loop neither waits for the
    device nor copies to the host."""
    engine = DecodeEngine(model, prompt.shape[0], decode_cache_len(prompt.shape[1], steps), mode=mode, dtype=dtype)
    for change in changes:
        change.redo()
    try:
        with as_reference(model, dtype) if dtype is not None else nullcontext():
            prompt_logits = engine.prefill(prompt)
            picks = [engine.tokens[:, 0].clone()]
            if against is None:  # a model's logits are bf16, fp16 or fp32, so float32 holds them exactly
                logits = prompt_logits.new_empty((steps, *prompt_logits.shape), dtype=torch.float32)
            else:
                squared_error = prompt_logits.new_zeros((), dtype=torch.float64)
            for step in range(steps):
                if forced is not None:
                    engine.tokens[:, 0].copy_(forced[step])
                out = engine.step()  # in graph mode the graph's output buffer, overwritten by the next step
                if against is None:
                    logits[step] = out
                else:
                    squared_error += (out.double() - against[step]).square().sum()
                picks.append(engine.tokens[:, 0].clone())
    finally:
        for change in reversed(changes):
            change.undo()
        engine.release()
    return (logits if against is None else squared_error), torch.stack(picks)


@dataclass
class Baseline:
    """What the end-to-end check compares a patched model with at one concurrency, whatever the recipes: the prompt,
    the reference's logits and greedy picks, and how far the unpatched model, teacher-forced by them, is from them.
    The defaults of the last two are an fp32 model's, whose reference is its unpatched decode."""
    prompt: torch.Tensor
    want: torch.Tensor  # [steps, batch, vocab], float32 on the model's device
    picks: torch.Tensor  # [steps + 1, batch], on the model's device
    want_norm: float  # ||want|| (Frobenius over all steps)
    rel_err_unpatched: float = 0.0
    top1_unpatched: float = 1.0
    seconds: float = 0.0  # the unpatched model's decode (teacher-forced, or the reference itself for an fp32 model)


def distance(model: torch.nn.Module, b: Baseline, changes: list[Change], mode: str) -> tuple[float, float]:
    """The relative logits error over all steps (||got - want|| / ||want||) and the top-1 agreement with the
    reference of the model with ``changes`` made, teacher-forced by the reference's picks; the same measure for the
    unpatched model and every patched set."""
    squared_error, picks = decode(model, b.prompt, b.want.shape[0], b.picks, changes, mode, against=b.want)
    return (squared_error.sqrt() / b.want_norm).item(), (picks[1:] == b.picks[1:]).double().mean().item()


def baselines(patches: Patches, plan: GatePlan) -> tuple[dict[int, Baseline], float, str]:
    """The baselines of every concurrency, computed once per gate (every recipe set is checked against the same),
    the seconds of the fp32 reference decode among them and the engine mode it decoded in. The prompt at concurrency
    C is the first C sequences of the largest one's, so for a half-precision model one fp32 reference decode, at the
    largest concurrency, serves all (a sequence's logits do not depend on its batch's other sequences). It runs in the
    plan's engine mode: in graph mode its steps replay one captured step, fp32 weight casts included, instead of
    launching several kernels per linear layer from Python; eager if its fp32 step cannot be captured."""
    model = patches.model
    dtype = next(model.parameters()).dtype
    steps, mode = plan.steps, plan.mode
    prompts = gate_prompt(model, max(plan.concurrencies), plan.prompt_len, plan.seed).to(
        next(model.parameters()).device)
    reference_seconds, reference_mode = 0.0, mode
    with torch.inference_mode(), patches.suspended():
        if dtype != torch.float32:
            started = time.perf_counter()
            try:
                want_all, picks_all = decode(model, prompts, steps, None, [], mode, dtype=torch.float32)
            except CaptureError:  # a step that synchronises with the host, such as a model's own fp32 MoE loop
                reference_mode = "eager"
                want_all, picks_all = decode(model, prompts, steps, None, [], "eager", dtype=torch.float32)
            if prompts.device.type == "cuda":  # the decode only queued its kernels
                torch.cuda.synchronize(prompts.device)
            reference_seconds = time.perf_counter() - started
        found = {}
        for concurrency in plan.concurrencies:
            prompt = prompts[:concurrency]
            started = time.perf_counter()
            if dtype == torch.float32:
                want, picks = decode(model, prompt, steps, None, [], mode)
            else:
                want, picks = want_all[:, :concurrency], picks_all[:, :concurrency]
            # In float64 one step at a time: a float64 copy of all of want would be twice its size.
            want_norm = sum(step.double().square().sum() for step in want).sqrt().item()
            found[concurrency] = b = Baseline(prompt, want, picks, want_norm)
            if dtype != torch.float32:
                started = time.perf_counter()
                b.rel_err_unpatched, b.top1_unpatched = distance(model, b, [], mode)
            b.seconds = time.perf_counter() - started
    return found, reference_seconds, reference_mode


def check_end_to_end(patches: Patches, names: list[str], found: dict[int, Baseline],
                     mode: str = "eager") -> list[EndToEndVerdict]:
    """Teacher-forced decode of the model with recipes ``names`` applied against the reference, at each concurrency
    of ``found``, its baselines (``baselines``). The model runs in engine ``mode`` (in graph mode, its captured
    graphs are what is checked), as the fp32 reference did."""
    model = patches.model
    dtype = next(model.parameters()).dtype
    chosen = [patches.applied[n] for n in names]
    tolerance = loosest(a.recipe.tolerance for a in chosen)
    changes = [c for a in chosen for c in a.changes]
    results = []
    with torch.inference_mode(), patches.suspended():
        for concurrency, b in found.items():
            started = time.perf_counter()
            problem = ""
            try:
                with deadline(decode_deadline(b.seconds)):
                    rel, top1 = distance(model, b, changes, mode)
            except CaptureError:  # a kernel that synchronises with the host: what would be measured cannot run
                problem = "its decode step cannot be captured in a CUDA graph"
            except FAILURES as exc:
                problem = f"the patched decode {describe(exc)}"
            if problem:
                rel, top1 = float("inf"), 0.0
            bound, min_top1 = end_to_end_bounds(tolerance, dtype, b.rel_err_unpatched, b.top1_unpatched,
                                                b.picks[1:].numel())
            results.append(EndToEndVerdict(concurrency, b.want.shape[0], rel <= bound and top1 >= min_top1, rel,
                                           b.rel_err_unpatched, bound, top1, b.top1_unpatched, min_top1, list(names),
                                           time.perf_counter() - started, problem))
    return results
