"""The per-recipe check: at the model's shapes, each patched site's original and fused paths run on the inputs
``capture`` recorded, both measured against the float64 run of the original (``rules`` says how close is close).

The fused path runs twice in a row, so a kernel that carries state from one call into the next (a stale
accumulator) shows on its second call even at a single site. With ``scaled``, every call whose outputs are all
floating runs a second time with its activations (its first input and its KV cache) scaled by ``SMALL_SCALE``:
activations that small reach the regime where a norm's eps is a good part of its result (a forgotten eps changes a
result by ~eps / mean(x^2), a millionth at the model's own activations, below one bf16 rounding). A power of two
scales exactly, so the scaled input is as representable as the captured one. A replacement whose variant lives at
large activations (DeepSeek-V4's SwiGLU clamp, Gemma 2's logit cap: random weights reach neither) names the powers of
two that reach it in its ``input_scales`` (``PatchKind.input_scales``), and the call runs at each of them too.

Sites with integer outputs (routers, samplers) are not scaled: that would not change which ids are picked, only
create near-ties. They are given more rows instead, wherever the site's own path takes them: decode's few tokens
pick the same few ids step after step. A router (a top-k pair of ids and weights out) that never picked the last
eighth of its experts passed on them, so each router call also runs with WIDER_ROWS rows more, drawn at random
around its own (``_widened``): in fp32 only, where scores do not tie (two correct kernels may break a bf16 tie
apart), and where the call has fewer rows (a GPU gate's 16 and 64 sequences are many). A sampler (ids alone out)
blind to the first eighth of the vocabulary passed too: its calls also run with rows whose largest logit is put at
points spread over the vocabulary, and with a tie (``_swept``), in any dtype, since those rows decide their ids by
construction.

The fused path is the user's code: whatever it raises (SystemExit too), returns (another dtype, shape or device than
the original's: ``rules.unlike``) or however long it runs (``user_code.deadline``, from the original's time on the
same call) fails its recipe with the reason, and the other recipes are checked on. A NaN in any run is a failure
shown as nan, never hidden by the larger of two errors."""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Iterator

import torch

from optiq.gate.capture import CACHES, fresh, layers_read, scaled_copy, tensors
from optiq.gate.references.float64 import float64_path
from optiq.gate.rules import GATE, error, site_bound, topk_ids, unlike
from optiq.patching import Patches
from optiq.patching.changes import Site
from optiq.patching.user_code import FAILURES, call_deadline, deadline, describe
from optiq.record import RecipeVerdict

SMALL_SCALE = 2.0 ** -10
WIDER_ROWS = 64
SWEEP_POINTS = 9  # the first entry, the last, and the eighths between


@dataclass
class CallErrors:
    """One call's errors against the float64 reference."""
    label: str  # where: the site, and which variant of its captured call
    err_unfused: float
    err_runs: list[float]  # of the fused path's runs, in order
    bound: float
    exact_match: bool  # every fused run bitwise equal to the unfused path (for ``exact``)
    failed: str = ""  # how the fused path failed to compute at all: "the fused path raised ...", "... returned ..."

    @classmethod
    def failure(cls, label: str, failed: str) -> CallErrors:
        """A call where a path failed to compute at all: no error to measure, an infinite one for the fused path."""
        return cls(label, math.nan, [math.inf], 0.0, False, failed)

    @property
    def err_fused(self) -> float:
        """The worst run's error; nan if any run's is (``max`` would keep the other, whatever its order)."""
        return math.nan if any(math.isnan(e) for e in self.err_runs) else max(self.err_runs)


def _activation(args: tuple, kwargs: dict) -> tuple[int | None, torch.Tensor | None]:
    """(position, tensor) of a call's activation: its first floating tensor argument, else its ``hidden_states``
    (position None); (None, None) for a call with neither."""
    first = next((i for i, v in enumerate(args) if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if first is not None:
        return first, args[first]
    given = kwargs.get("hidden_states")
    return None, given if isinstance(given, torch.Tensor) and given.is_floating_point() else None


def _with_activation(args: tuple, kwargs: dict, position: int | None, value: torch.Tensor) -> tuple[tuple, dict]:
    """The call with its activation (``_activation``'s position) replaced by ``value``."""
    if position is not None:
        return args[:position] + (value,) + args[position + 1:], kwargs
    return args, {**kwargs, "hidden_states": value}


def _scaled(args: tuple, kwargs: dict, factor: float) -> tuple[tuple, dict] | None:
    """The call with its activations times ``factor``: its activation (``_activation``) and its KV cache, whose
    values feed the attention output a decoder layer adds to its residual (position embeddings and masks stay as
    they are); None if it has no activation."""
    position, given = _activation(args, kwargs)
    if given is None:
        return None
    args, kwargs = _with_activation(args, kwargs, position, scaled_copy(given, factor))
    return (tuple(scaled_copy(v, factor) if isinstance(v, CACHES) else v for v in args),
            {k: scaled_copy(v, factor) if isinstance(v, CACHES) else v for k, v in kwargs.items()})


def _widened(args: tuple, kwargs: dict, seed: int) -> tuple[tuple, dict] | None:
    """The call with WIDER_ROWS more rows (along its first dim) in its activation of two or three dims: the captured
    rows' mean plus noise of their spread, from a fixed seed, so a router meets many more distinct tokens than one
    decode step holds. None for a call without such an activation, in another dtype than fp32, or with WIDER_ROWS
    tokens or more already."""
    position, given = _activation(args, kwargs)
    if not (given is not None and given.dtype == torch.float32 and given.dim() in (2, 3)
            and 0 < given.shape[0] * (given.shape[1] if given.dim() == 3 else 1) < WIDER_ROWS):
        return None
    generator = torch.Generator(device=given.device).manual_seed(seed)
    noise = torch.randn((WIDER_ROWS, *given.shape[1:]), generator=generator, device=given.device)
    extra = given.mean(dim=0, keepdim=True) + given.std(unbiased=False) * noise
    return _with_activation(args, kwargs, position, torch.cat((given, extra)))


def _swept(args: tuple, kwargs: dict) -> Iterator[tuple[str, tuple, dict]]:
    """(what, args, kwargs) of one-row calls made from the call's activation of two dims: its first row with one
    entry raised above the rest, at SWEEP_POINTS points spread over the last dim from the first entry to the last,
    then with two such entries (a tie, which the lowest index wins, as torch.argmax has it). For a site that returns
    ids alone (a sampler): whether every stretch of the vocabulary can be picked, and how a tie is broken, where
    random logits put a step's few maxima in a few places (a kernel blind to the first eighth of the vocabulary
    passed on them). One row a call: under Triton's interpreter a row costs a sampler ~0.2 s at a 32k vocabulary,
    and each call has its own deadline. Nothing for a call without such an activation."""
    position, given = _activation(args, kwargs)
    if given is None or given.dim() != 2 or given.shape[0] == 0 or given.shape[1] < 2:
        return
    points = torch.linspace(0, given.shape[1] - 1, SWEEP_POINTS).round().long().tolist()
    raised = (given[0].float().abs().max() * 2 + 1).to(given.dtype)  # above every entry, still so in bf16
    for what, where in [*((f"its largest entry at {p}", [p]) for p in points), ("a tie", points[1:3])]:
        row = given[:1].clone()
        row[0, where] = raised
        yield (what, *_with_activation(args, kwargs, position, row))


def call_errors(patches: Patches, name: str, sites: list[tuple[Site, list]], where: str = "",
                scaled: bool = False) -> Iterator[CallErrors]:
    """Every captured call of recipe ``name``'s sites (and its scaled variant, with ``scaled``) through the three
    paths, with the patches suspended."""
    applied = patches.applied[name]
    kind, tolerance = applied.kind, applied.recipe.tolerance
    device_type = next(patches.model.parameters()).device.type
    with patches.suspended():
        for site, calls in sites:
            original, fused = kind.call(site.original), kind.call(site.replacement)
            with float64_path(site.original) as exact:
                reference = kind.call(exact)

                def run(label: str, args: tuple, kwargs: dict,
                        variant: bool = False) -> tuple[CallErrors | None, list[torch.Tensor]]:
                    """The call's errors and its float64 outputs; None for a ``variant`` (more rows than captured)
                    that the site's own path does not take (rows tied to a cache): it is not checked."""
                    layers = layers_read(site.original, args, kwargs)
                    try:  # the model's own path, replayed on what the call was given
                        want = tensors(reference(*fresh(args, torch.float64, layers),
                                                 **fresh(kwargs, torch.float64, layers)))
                        started = time.perf_counter()
                        unfused = tensors(original(*fresh(args), **fresh(kwargs)))
                    except torch.OutOfMemoryError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a site the patch kind cannot replay: nothing to check
                        if variant:
                            return None, []
                        return CallErrors.failure(label, f"the site's own path fails when replayed on its captured "
                                                         f"inputs ({describe(exc)}), so the gate cannot check it"), []
                    allowed = call_deadline(device_type, time.perf_counter() - started)
                    try:
                        with deadline(allowed):
                            runs = [tensors(fused(*fresh(args), **fresh(kwargs))) for _ in range(2)]
                        problem = next(filter(None, (unlike(r, unfused) for r in runs)), "")
                        if problem:
                            return CallErrors.failure(label, f"the fused path {problem}"), want
                        err_unfused = error(unfused, want)
                        exact_match = all(error(r, unfused) == 0.0 and all(torch.equal(x, y)
                                                                           for x, y in zip(r, unfused)) for r in runs)
                        err_runs = [error(r, want) for r in runs]
                    except FAILURES as exc:  # a user's kernel may fail in any way; the recipe fails, the run goes on
                        return CallErrors.failure(label, f"the fused path {describe(exc)}"), want
                    bound = site_bound(tolerance, err_unfused)
                    return CallErrors(label, err_unfused, err_runs, bound, exact_match), want

                for number, (args, kwargs) in enumerate(calls, 1):
                    errors, want = run(f"{site.label} (call {number}{where})", args, kwargs)
                    yield errors
                    if topk_ids(want) is not None:
                        wider = _widened(args, kwargs, seed=number)
                        extra = [] if wider is None else [(f"{WIDER_ROWS} more rows", *wider)]
                    elif number == 1 and not any(t.is_floating_point() for t in want):
                        extra = _swept(args, kwargs)  # ids set by construction: a site's first call is enough
                    else:
                        extra = []
                    for what, *variant in extra:
                        checked = run(f"{site.label} (call {number}{where}, {what})", *variant, variant=True)[0]
                        if checked is not None:
                            yield checked
                    if not (scaled and all(t.is_floating_point() for t in want)):
                        continue
                    for factor in (SMALL_SCALE, *kind.input_scales(site.replacement, args, kwargs)):
                        variant = _scaled(args, kwargs, factor)
                        if variant is not None:
                            yield run(f"{site.label} (call {number}{where}, input x 2^{int(math.log2(factor))})",
                                      *variant)[0]


def check_recipe(patches: Patches, name: str, sites: list[tuple[Site, list]], where: str = "",
                 scaled: bool = False) -> RecipeVerdict:
    """The verdict on recipe ``name`` over its sites' captured calls (``where`` labels the capture): the worst call,
    the largest fused/unfused ratio over all calls as its margin, and the first call that failed, if one did."""
    tolerance = patches.applied[name].recipe.tolerance
    result = RecipeVerdict(name, tolerance, True, "passed")
    worst = -math.inf
    kernel_calls = patches.applied[name].kernel_calls
    with closing(call_errors(patches, name, sites, where, scaled)) as calls:  # an early return resumes the patches
        for call in calls:
            result.calls += 1
            if call.failed:
                result.passed, result.site = False, call.label
                result.reason = f"{call.label}: {call.failed}"
                return result
            ok = call.exact_match if tolerance == "exact" else call.err_fused <= call.bound
            if call.err_unfused > 0:
                result.margin = max(call.err_fused / call.err_unfused, 0.0 if math.isnan(result.margin) else
                                    result.margin)
            excess = call.err_fused - call.bound
            if not ok or excess > worst:
                worst = excess
                result.err_fused, result.err_unfused, result.bound = call.err_fused, call.err_unfused, call.bound
                result.site = call.label
            if not ok:
                result.passed = False
                rule = ("not bit-identical to the unfused path" if tolerance == "exact" else
                        f"error {call.err_fused:.3g} > {GATE[tolerance][0]:g} x unfused {call.err_unfused:.3g} + "
                        f"floor = {call.bound:.3g}")
                second = " on its second run" if call.err_runs[0] <= call.bound and not call.err_fused <= call.bound \
                    else ""
                result.reason = f"{call.label}{second}: {rule}"
                return result
    if result.calls and patches.applied[name].kernel_calls == kernel_calls:
        result.passed = False
        result.reason = (f"its kernel ran at none of its {result.calls} calls (each went back to the original path): "
                         f"nothing to keep")
    return result


def combine(first: RecipeVerdict, second: RecipeVerdict) -> RecipeVerdict:
    """One verdict from two checks of the same recipe (two captures): the failed one, else the one whose worst call
    came closer to its bound; calls summed, margin the larger, seconds summed."""
    worse = second if not second.passed or (first.passed and second.err_fused - second.bound >
                                            first.err_fused - first.bound) else first
    margins = [m for m in (first.margin, second.margin) if not math.isnan(m)]
    return dataclasses.replace(worse, calls=first.calls + second.calls, seconds=first.seconds + second.seconds,
                               margin=max(margins) if margins else math.nan)
