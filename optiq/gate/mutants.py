"""Mutation testing of the gate: every kernel of the catalog, wrapped so that it computes what real fused kernels
have shipped computing by mistake, must be rejected by the gate on the model it is tried on.

A mutant wraps the kernel at its boundary, so one generator serves every kernel, the user's included: it reads the
kernel's parameter names (the catalog's kernels name theirs alike: ``weight``/``*_norm_weight``, ``bias``, ``eps``,
``lengths``/``positions``) and changes their values or the kernel's outputs. The classes, each a bug seen in real
kernels:

- length off by one: the sequence lengths or cache positions one less;
- a dropped first or last block: the first block (an eighth) of the first input's last dim read as zeros, or the last;
- a forgotten weight, bias or eps: norm weights read as ones (zeros for a Gemma-style offset weight), no bias,
  eps 0;
- a forgotten attention variant: no sliding window (``starts`` dropped), no logit softcap, no attention sinks;
- a scale off by a few percent: float outputs times 1 + 2^-6;
- accumulation in the input dtype: a GEMM's K split in four, partial sums rounded to the input dtype (for kernels
  of nn.Linear's signature: ``x``, a 2-D ``weight``, ``bias``);
- rows of the batch mixed: the first two rows of the first output swapped, at every other call (of one output
  only, and not at every call: a kernel called twice in a row-wise stretch, as norm_add_rmsnorm is in a layer,
  would swap the rows back, its other outputs at the same call or its one output at the next); or stale: the last
  row the first's;
- state carried across calls: each call's outputs added to an accumulator that is never zeroed.

A mutant that changed nothing at any call of the gate (a bias that was None, a batch of one) is not counted: the
model gives it nothing to change. The mutation score is killed / (killed + survived). A mutant may run inside a
CUDA graph being captured (the end-to-end check in graph mode), so none of them synchronises with the host.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from optiq.gate import GatePlan, validate
from optiq.gate.end_to_end import baselines
from optiq.patching import Patches, apply
from optiq.record import MutationScore

LENGTH_PARAMETERS = ("lengths", "positions", "seq_lens", "cache_seqlens")
# attention variants a kernel may take, each with the value that turns it off, and the mutant that forgets it
VARIANT_PARAMETERS = {"starts": (None, "sliding window forgotten"), "softcap": (0.0, "softcap forgotten"),
                      "sinks": (None, "sinks forgotten")}
SCALE_ERROR = 2.0 ** -6


@dataclass
class Mutant:
    name: str
    bug: str  # the class of bug it stands for
    wrap: Callable[[Callable, list], Callable]  # (kernel, touched) -> the mutated kernel, which appends to touched
    # whether its change altered a value at each call: a bool, or a device tensor read only once the gate is done
    # (reading it at once would synchronise with the host, which a CUDA graph being captured forbids)


@dataclass
class MutantResult:
    name: str
    bug: str
    status: str  # killed, survived, or unchanged (the mutation altered nothing on this model)
    reason: str = ""  # the gate's, for a killed one


@dataclass
class RecipeMutation:
    recipe: str
    kernel: str  # the recipe's fusion
    real: str  # the gate's verdict on the real kernel: "passed", or why it was rejected (a false rejection)
    mutants: list[MutantResult] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> MutationScore:
        """The counts the run record keeps (its ``score`` is the mutation score)."""
        return MutationScore(sum(m.status == "killed" for m in self.mutants),
                             sum(m.status != "unchanged" for m in self.mutants),
                             [m.name for m in self.mutants if m.status == "survived"], self.real)


def _argument_mutant(name: str, bug: str, change: Callable[[inspect.BoundArguments], bool]) -> Mutant:
    """A mutant that edits the kernel's bound arguments in place; ``change`` says whether it altered one."""
    def wrap(kernel, touched):
        signature = inspect.signature(kernel)

        def mutated(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            touched.append(change(bound))
            return kernel(*bound.args, **bound.kwargs)
        return mutated
    return Mutant(name, bug, wrap)


def _output_mutant(name: str, bug: str, change: Callable[[list[torch.Tensor], dict], bool]) -> Mutant:
    """A mutant that edits the kernel's output tensors in place (so a kernel writing into a given ``out`` and its
    caller reading that buffer see it too); ``change(outputs, state)`` says whether it altered one."""
    def wrap(kernel, touched):
        state: dict = {}

        def mutated(*args, **kwargs):
            result = kernel(*args, **kwargs)
            outputs = [result] if isinstance(result, torch.Tensor) else [t for t in result
                                                                         if isinstance(t, torch.Tensor)]
            touched.append(change(outputs, state))
            return result
        return mutated
    return Mutant(name, bug, wrap)


def _first_float(bound: inspect.BoundArguments) -> str | None:
    return next((k for k, v in bound.arguments.items() if isinstance(v, torch.Tensor) and v.is_floating_point()),
                None)


def _block_dropped(last: bool) -> Callable[[inspect.BoundArguments], bool]:
    def change(bound):
        key = _first_float(bound)
        if key is None:
            return False
        x = bound.arguments[key].clone()
        block = max(1, x.shape[-1] // 8)
        part = x[..., -block:] if last else x[..., :block]
        altered = part.ne(0).any()
        part.zero_()
        bound.arguments[key] = x
        return altered
    return change


def _is_norm_weight(name: str, value) -> bool:
    return (name == "weight" or name.endswith("norm_weight")) and isinstance(value, torch.Tensor) and value.dim() == 1


def _weight_forgotten(bound):
    altered = []
    for key, value in list(bound.arguments.items()):
        if _is_norm_weight(key, value):
            neutral = torch.zeros_like(value) if bound.arguments.get("offset") else torch.ones_like(value)
            altered.append(value.ne(neutral).any())
            bound.arguments[key] = neutral
    return _any(altered)


def _bias_forgotten(bound):
    if isinstance(bound.arguments.get("bias"), torch.Tensor):
        bound.arguments["bias"] = None
        return True
    return False


def _eps_forgotten(bound):
    """eps 0, where a norm weight says a norm runs (rope's eps serves its optional q/k norms only)."""
    norm = any(_is_norm_weight(key, value) for key, value in bound.arguments.items())
    if norm and isinstance(bound.arguments.get("eps"), float) and bound.arguments["eps"] != 0.0:
        bound.arguments["eps"] = 0.0
        return True
    return False


def _variant_forgotten(name: str) -> Callable[[inspect.BoundArguments], bool]:
    """The variant parameter ``name`` set to its neutral value; altered where it held another (a window that starts
    past position 0 somewhere, a nonzero cap, sinks given)."""
    neutral = VARIANT_PARAMETERS[name][0]

    def change(bound):
        value = bound.arguments.get(name)
        if value is None or (not isinstance(value, torch.Tensor) and value == neutral):
            return False
        bound.arguments[name] = neutral
        return value.ne(0).any() if name == "starts" else True
    return change


def _length_short(bound):
    for key in LENGTH_PARAMETERS:
        if isinstance(bound.arguments.get(key), torch.Tensor):
            bound.arguments[key] = bound.arguments[key] - 1
            return True
    return False


def _any(altered: list) -> torch.Tensor | bool:
    return torch.stack(altered).any() if altered else False


def _scaled(outputs, state):
    floats = [t for t in outputs if t.is_floating_point()]
    for t in floats:
        t.mul_(1.0 + SCALE_ERROR)
    return _any([t.ne(0).any() for t in floats])


def _rows_swapped(outputs, state):
    state["calls"] = state.get("calls", 0) + 1
    first = next((t for t in outputs if t.dim() and t.shape[0] >= 2), None)
    if first is None or state["calls"] % 2 == 0:
        return False
    altered = first[0].ne(first[1]).any()
    first[:2] = first[:2].flip(0)
    return altered


def _last_row_stale(outputs, state):
    altered = []
    for t in outputs:
        if t.dim() and t.shape[0] >= 2:
            altered.append(t[-1].ne(t[0]).any())
            t[-1] = t[0]
    return _any(altered)


def _accumulated(outputs, state):
    """Each output plus the sum of the earlier calls' outputs of its shape and dtype."""
    altered = []
    for i, t in enumerate(outputs):
        if not t.is_floating_point():
            continue
        key = (i, tuple(t.shape), t.dtype, t.device)
        previous = state.get(key)
        state[key] = t.clone() if previous is None else previous + t
        if previous is not None:
            altered.append(previous.ne(0).any())
            t.add_(previous)
    return _any(altered)


def _split_k_in_input_dtype(kernel, touched):
    """nn.Linear's kernel with K split in four and the partial sums rounded to (and added in) the input dtype."""
    def mutated(x, weight, bias=None, *rest, **kwargs):
        if x.dtype == torch.float32 or x.shape[-1] < 4:
            return kernel(x, weight, bias, *rest, **kwargs)  # fp32 partials are what a correct kernel keeps
        touched.append(True)
        k = x.shape[-1]
        out = None
        for start, end in ((i * k // 4, (i + 1) * k // 4) for i in range(4)):
            part = kernel(x[..., start:end].contiguous(), weight[:, start:end].contiguous(), None)
            out = part if out is None else (out + part).to(x.dtype)
        if bias is not None:
            out = (out + bias).to(x.dtype)
        if rest or kwargs:  # a fused residual add
            residual = rest[0] if rest else kwargs.get("residual")
            out = out if residual is None else (out + residual).to(x.dtype)
        return out
    return mutated


def _is_linear(kernel: Callable) -> bool:
    names = list(inspect.signature(kernel).parameters)
    return names[:3] == ["x", "weight", "bias"]


def mutants(kernel: Callable) -> list[Mutant]:
    """The mutants of ``kernel`` its parameters allow (module docstring)."""
    try:
        names = set(inspect.signature(kernel).parameters)
    except (TypeError, ValueError):  # a user's kernel without a signature to read: the argument mutants only
        names = set()
    found = [_argument_mutant("first block dropped", "a dropped first block", _block_dropped(last=False)),
             _argument_mutant("last block dropped", "a dropped last block", _block_dropped(last=True))]
    if names & set(LENGTH_PARAMETERS):
        found.append(_argument_mutant("length - 1", "length off by one", _length_short))
    if "weight" in names or any(n.endswith("norm_weight") for n in names):
        found.append(_argument_mutant("weight forgotten", "a forgotten weight", _weight_forgotten))
    if "bias" in names:
        found.append(_argument_mutant("bias forgotten", "a forgotten bias", _bias_forgotten))
    if "eps" in names:
        found.append(_argument_mutant("eps forgotten", "a forgotten eps", _eps_forgotten))
    found += [_argument_mutant(VARIANT_PARAMETERS[n][1], "a forgotten attention variant", _variant_forgotten(n))
              for n in VARIANT_PARAMETERS if n in names]
    if _is_linear(kernel):
        found.append(Mutant("split-K partials in the input dtype", "accumulation in the input dtype",
                            _split_k_in_input_dtype))
    found += [_output_mutant("scale off by 1.6%", "a scale off by a few percent", _scaled),
              _output_mutant("rows 0 and 1 swapped", "rows of the batch mixed", _rows_swapped),
              _output_mutant("last row stale", "rows of the batch stale", _last_row_stale),
              _output_mutant("state kept across calls", "state carried across calls", _accumulated)]
    return found


def verify(model: torch.nn.Module, recipes: list, plan: GatePlan, with_mutants: bool = True,
           progress: Callable[[str], None] = lambda line: None,
           done: Callable[[str, RecipeMutation | str], None] = lambda name, result: None
           ) -> dict[str, RecipeMutation | str]:
    """Each recipe patched alone into ``model`` and gated with its real kernel, then (``with_mutants``) with each of
    its kernel's mutants: {recipe: RecipeMutation, or why it does not apply}, each also handed to ``done`` as it is
    finished. One set of end-to-end baselines (the reference decode) serves every gate."""
    found_baselines = baselines(Patches(model), plan)
    results: dict[str, RecipeMutation | str] = {}
    for recipe in recipes:
        started = time.perf_counter()
        patches = apply(model, [recipe])
        if recipe.name in patches.failed:  # its code does not import or build: its real kernel is rejected
            results[recipe.name] = RecipeMutation(recipe.name, recipe.fusion, patches.failed[recipe.name][1])
            progress(f"{recipe.name}: real kernel {results[recipe.name].real}")
            done(recipe.name, results[recipe.name])
            continue
        if recipe.name not in patches.applied:
            results[recipe.name] = patches.not_applicable.get(recipe.name, "not applicable")
            progress(f"{recipe.name}: not applicable ({results[recipe.name]})")
            done(recipe.name, results[recipe.name])
            continue
        kernel = patches.applied[recipe.name].fusion
        verdict = _gate(patches, recipe.name, plan, found_baselines)
        result = RecipeMutation(recipe.name, recipe.fusion, verdict or "passed")
        progress(f"{recipe.name}: real kernel {result.real}")
        for mutant in mutants(kernel) if with_mutants else []:
            touched: list = []
            patches = apply(model, [recipe], kernels={recipe.name: mutant.wrap(kernel, touched)})
            reason = _gate(patches, recipe.name, plan, found_baselines)
            changed = any(bool(t) for t in touched)  # the device's flags, read once the gate is done
            status = "killed" if reason else "survived" if changed else "unchanged"
            result.mutants.append(MutantResult(mutant.name, mutant.bug, status, reason or ""))
            progress(f"{recipe.name}: {mutant.name}: {status}")
        result.seconds = time.perf_counter() - started
        results[recipe.name] = result
        if with_mutants:
            score = result.summary()
            progress(f"{recipe.name}: {score.killed} of {score.counted} mutants killed")
        done(recipe.name, result)
    return results


def _gate(patches, name: str, plan: GatePlan, found_baselines) -> str:
    """The gate's reason for rejecting recipe ``name`` ("" if it kept it); the model is unpatched after."""
    try:
        report = validate(patches, plan, found_baselines)
    finally:
        patches.undo()
    if name in report.rolled_back:
        return report.recipes[name].reason
    failed = next((e for e in report.end_to_end if not e.passed), None)
    return f"end to end at concurrency {failed.concurrency}" if failed else ""
