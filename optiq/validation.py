"""The validation gate: a patched model must compute the function the unpatched one computes.

Two checks, both against a higher-precision reference rather than against the model's own rounding:

1. Per recipe, at the model's shapes: the real inputs of every patched module / function / attention call / engine
   method are captured during one decode step of the unpatched model; the original and the fused path then run on
   those inputs (the fused path twice in a row, so a kernel that carries state from one call into the next, such as a
   stale accumulator, shows on its second call even at a single site), and both are compared with the original path
   run in float64. Rule: ``err(fused) <= factor * err(unfused) + floor * eps(model dtype)`` at every call, with
   ``err`` the norm of the difference over the norm of the reference, and (factor, floor) from the recipe's tolerance
   class (GATE). ``exact`` means bitwise equal to the unfused path. Integer outputs must be equal; a top-k pair (ids
   with weights of the same shape, as routers return) is compared as a set per row, since which k were chosen is
   the function and their order within a row is not (torch.topk leaves it unspecified among equal values, or at
   all with sorted=False, and MoE experts sum over the k).
2. End to end: teacher-forced greedy decode over ``steps`` steps at each concurrency with the DecodeEngine, in the
   engine mode that will be measured (so a patch that breaks under CUDA-graph capture fails here). The
   reference is the unpatched model itself for an fp32 model (then every greedy pick must be identical) or the same
   model computing in fp32 otherwise (then the unpatched model's own distance to fp32 sets the scale). Rule:
   relative logits error ``<= factor * err(unpatched) + E2E_FLOOR_EPS * eps(fp32)``, top-1 agreement
   ``>= agreement(unpatched) - slack``, with factor and slack from the loosest tolerance among the recipes. The
   reference and unpatched decodes are computed once per gate (``baselines``) and shared by every set it checks; the
   reference's logits stay on the device in fp32 and every other decode is compared with them step by step.

A recipe that fails its gate is undone (alone) and reported with the numbers that failed it; the others stay.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from transformers import Cache

from optiq import reference_experts, split_matmul
from optiq.engine import CaptureError, DecodeEngine
from optiq.patches.moe import swiglu_experts_problem
from optiq.patching import Change, Patches, Site, engine_site
from optiq.reference_attention import grouped_decode_attention

# factor, floor (in eps of the model dtype). Why these:
# - exact_order: same roundings in the same order, so the fused error is the unfused one plus at most a rounding of
#   the output per fused multiply-add or differently rounded rsqrt/exp (1-2 ulp): 2x the unfused error plus 2 eps
#   (4 units of roundoff). A norm without eps (relative error eps_norm / mean(x^2), ~1e-3 on these models) or a
#   wrong rotation is orders of magnitude past it in fp32.
# - reassociation: a sum in another order has an error of the same distribution as the original order's but not the
#   same value; a per-call ratio of two such errors stays well inside 4 (the floor covers calls whose unfused error is
#   by chance near zero). A dropped cache position or a missing split is an O(1/length) change, far outside.
# - lossy: lower precision on purpose, so the unfused error says little; the floor is one bf16 rounding of every
#   input and the output (8 eps of bf16 in eps of the model dtype is applied below), and the end-to-end bound decides.
GATE = {"exact": (0.0, 0.0), "exact_order": (2.0, 2.0), "reassociation": (4.0, 4.0), "lossy": (4.0, 2.0)}
LOSSY_FLOOR = 2 * torch.finfo(torch.bfloat16).eps
ORDER = ["exact", "exact_order", "reassociation", "lossy"]  # loosest last
# End to end: the rounding an fp32 forward of a few dozen layers accumulates in its logits (tiny presets: ~2 eps).
E2E_FLOOR_EPS = 64
E2E_SLACK = {"exact": 0.0, "exact_order": 0.02, "reassociation": 0.05, "lossy": 0.1}  # top-1, non-fp32 models only


@dataclass
class RecipeResult:
    recipe: str
    tolerance: str
    passed: bool
    reason: str
    calls: int = 0
    err_fused: float = float("nan")  # at the worst call (largest fused error over its bound)
    err_unfused: float = float("nan")
    bound: float = float("nan")
    site: str = ""
    seconds: float = 0.0  # running the captured calls through the three paths


@dataclass
class EndToEnd:
    concurrency: int
    steps: int
    passed: bool
    rel_err: float
    rel_err_unpatched: float
    bound: float
    top1: float
    top1_unpatched: float
    min_top1: float
    recipes: tuple[str, ...]
    seconds: float = 0.0  # the patched model's decode and its comparison, graph capture included (not the baselines)


@dataclass
class Validation:
    recipes: dict[str, RecipeResult] = field(default_factory=dict)
    end_to_end: list[EndToEnd] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    capture_seconds: float = 0.0  # recording the patched sites' inputs during one decode step
    baseline_seconds: float = 0.0  # all the decodes every end-to-end check compares with: reference and unpatched
    reference_seconds: float = 0.0  # the part of baseline_seconds in the fp32 reference decode of a half-precision
    # model (0 for an fp32 model, whose reference is its unpatched decode)
    reference_mode: str = ""  # the engine mode that reference decoded in: the gate's, or eager where a step of it
    # could not be captured

    @property
    def passed(self) -> bool:
        return not self.rolled_back and all(e.passed for e in self.end_to_end)


def _copy_cache(cache: Cache, dtype: torch.dtype | None) -> Cache:
    """A copy of a KV cache that owns its small state (the fill counters, which each call advances) and shares the
    keys and values, converted to ``dtype`` if given. Sharing is safe because a decode call writes its own token's
    position before it reads it, and a copy per call of every layer's keys and values would not fit (each of 28
    decoder layers gets the whole cache: 28 x 3.8 GB for qwen3-0.6b at C=64)."""
    copied = copy.copy(cache)
    copied.layers = []
    for layer in cache.layers:
        mine = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                shared = name in ("keys", "values")
                setattr(mine, name, value.clone() if not shared else value if dtype is None else value.to(dtype))
        copied.layers.append(mine)
    return copied


def _fresh(value: Any, dtype: torch.dtype | None = None) -> Any:
    """A private copy of captured call arguments: tensors cloned (floating ones cast to ``dtype``), caches copied
    (_copy_cache); modules, configs and functions shared."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value.clone()
    if isinstance(value, Cache):
        return _copy_cache(value, dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v, dtype) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _callable(site: Site, kind: str, which: Any) -> Callable:
    """A site's path as one callable of the captured arguments (an attention pair builds its own mask first)."""
    if kind != "attention_interface":
        return which
    attention, mask = which
    return lambda mask_kwargs, module, q, k, v, **kwargs: attention(module, q, k, v, mask(**mask_kwargs), **kwargs)


def _recorder(kind: str, original: Any, calls: list) -> Any:
    """The original path, recording a private copy of its inputs at each call."""
    if kind != "attention_interface":
        def record(*args, **kwargs):
            calls.append(_fresh((args, kwargs)))
            return original(*args, **kwargs)
        return record
    attention, mask = original
    latest = {}

    def record_mask(**kwargs):
        latest["mask"] = _fresh(kwargs)
        return mask(**kwargs)

    def record_attention(module, q, k, v, attention_mask, **kwargs):
        calls.append(_fresh(((latest["mask"], module, q, k, v), kwargs)))
        return attention(module, q, k, v, attention_mask, **kwargs)

    return record_attention, record_mask


@contextmanager
def _reference(original: Callable):
    """The original path in float64: a module's forward runs on a float64 copy of the module (SwiGLU MoE experts
    through ``reference_experts``, other experts through transformers' eager loop: grouped GEMMs have no float64
    kernel). On exit the experts' forwards are dropped: each holds its module, a cycle that would keep every site's
    float64 copy (4.8 GB for a qwen3-30b-a3b layer) alive until a garbage collection."""
    owner = getattr(original, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        yield original
        return
    double = copy.deepcopy(owner).to(torch.float64)
    for module in double.modules():
        if swiglu_experts_problem(module) is None:
            module.forward = reference_experts.experts_forward(module)
        elif hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    try:
        yield double.forward if "forward" in vars(double) and original.__name__ == "forward" else \
            original.__func__.__get__(double)
    finally:
        for module in double.modules():
            vars(module).pop("forward", None)


def sorted_by_id(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs with each row of a top-k pair (an integer tensor and the float tensors of its shape) sorted by id."""
    ids = next((t for t in outputs if not t.is_floating_point() and t.dim() and t.shape[-1] > 1
                and any(o.is_floating_point() and o.shape == t.shape for o in outputs)), None)
    if ids is None:
        return outputs
    order = ids.argsort(dim=-1)
    return [t.gather(-1, order) if t.shape == ids.shape else t for t in outputs]


def _error(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    if len(outputs) != len(reference) or any(o.shape != r.shape for o, r in zip(outputs, reference)):
        return float("inf")
    diff = ref = 0.0
    for out, want in zip(sorted_by_id(outputs), sorted_by_id(reference)):
        if not want.is_floating_point():
            if not torch.equal(out.to(want.dtype), want):
                return float("inf")
            continue
        diff += (out.double() - want.double()).norm().item() ** 2
        ref += want.double().norm().item() ** 2
    return (diff / ref) ** 0.5 if ref > 0 else diff ** 0.5


def _bound(tolerance: str, dtype: torch.dtype, err_unfused: float) -> float:
    factor, floor = GATE[tolerance]
    floor_abs = max(floor * torch.finfo(dtype).eps, LOSSY_FLOOR if tolerance == "lossy" else 0.0)
    return factor * err_unfused + floor_abs


def _prompt(model: torch.nn.Module, batch: int, length: int, seed: int) -> torch.Tensor:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def capture_cache_len(prompt_len: int) -> int:
    """The cache of the engine whose one decode step records the patched sites' inputs (``_capture``)."""
    return prompt_len + 2


def decode_cache_len(prompt_len: int, steps: int) -> int:
    """The cache of every teacher-forced decode of ``steps`` steps (``_decode``)."""
    return prompt_len + steps + 1


def _capture(patches: Patches, batch: int, prompt_len: int, seed: int) -> dict[str, list[tuple[Site, list]]]:
    """Inputs of every site of every applied recipe during one decode step of the unpatched model."""
    model = patches.model
    with patches.suspended():
        engine = DecodeEngine(model, batch, capture_cache_len(prompt_len))
        engine.prefill(_prompt(model, batch, prompt_len, seed))
        captured, changes = {}, []
        for name, applied in patches.applied.items():
            kind = applied.recipe.patch_kind
            sites = [engine_site(applied, engine)] if kind == "engine" else applied.sites
            captured[name] = [(site, []) for site in sites]
            changes += [site.bind(_recorder(kind, site.original, calls)) for site, calls in captured[name]]
        for change in changes:
            change.redo()
        try:
            engine.step()
        finally:
            for change in reversed(changes):
                change.undo()
    return captured


def _gate(patches: Patches, name: str, sites: list[tuple[Site, list]]) -> RecipeResult:
    recipe = patches.applied[name].recipe
    kind, tolerance, dtype = recipe.patch_kind, recipe.tolerance, next(patches.model.parameters()).dtype
    result = RecipeResult(name, tolerance, True, "passed")
    worst = -float("inf")
    with patches.suspended():
        for site, calls in sites:
            original, fused = _callable(site, kind, site.original), _callable(site, kind, site.replacement)
            with _reference(site.original) as exact:
                reference = _callable(site, kind, exact)
                for args, kwargs in calls:
                    result.calls += 1
                    want = _tensors(reference(*_fresh(args, torch.float64), **_fresh(kwargs, torch.float64)))
                    unfused = _tensors(original(*_fresh(args), **_fresh(kwargs)))
                    try:
                        runs = [_tensors(fused(*_fresh(args), **_fresh(kwargs))) for _ in range(2)]
                    except Exception as exc:  # a user's kernel may fail in any way; the recipe fails, the run goes on
                        return RecipeResult(name, tolerance, False, f"{site.label}: the fused path raised "
                                            f"{type(exc).__name__}: {exc}", result.calls, site=site.label)
                    err_unfused = _error(unfused, want)
                    err_fused = max(_error(run, want) for run in runs)
                    bound = _bound(tolerance, dtype, err_unfused)
                    if tolerance == "exact":
                        ok = all(_error(run, unfused) == 0.0 and all(torch.equal(a, b) for a, b in zip(run, unfused))
                                 for run in runs)
                    else:
                        ok = err_fused <= bound
                    excess = err_fused - bound
                    if not ok or excess > worst:
                        worst = excess if ok else float("inf")
                        result.err_fused, result.err_unfused, result.bound, result.site = (err_fused, err_unfused,
                                                                                           bound, site.label)
                    if not ok:
                        result.passed = False
                        rule = ("not bit-identical to the unfused path" if tolerance == "exact" else
                                f"error {err_fused:.3g} > {GATE[tolerance][0]:g} x unfused {err_unfused:.3g} + floor "
                                f"= {bound:.3g}")
                        second = " on its second run" if _error(runs[0], want) <= bound < err_fused else ""
                        result.reason = f"{site.label} (call {result.calls}){second}: {rule}"
                        return result
    return result


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype):
    """The model computes in ``dtype`` while its weights stay stored in their own: each module's parameters are cast
    when it starts and put back when it ends, so one module's cast weights are alive at a time (an fp32 copy of a
    30B-parameter bf16 model does not fit beside it on one GPU). Computing in fp32 on a GPU, linear layers and MoE
    experts with bf16 weights keep them and take their products from bf16 parts of the activations on the tensor
    cores (``split_matmul``: a few millionths from the exact product, a thousandth of a bf16 product's error; linear
    layers only where it is faster than a cast; the experts through ``reference_experts``, which a graph captures)."""
    stored: dict[torch.nn.Parameter, torch.Tensor] = {}

    def cast(module, *_):
        for param in module.parameters(recurse=False):
            stored[param], param.data = param.data, param.data.to(dtype)

    def restore(module, *_):
        for param in module.parameters(recurse=False):
            param.data = stored.pop(param)

    def from_parts(module) -> bool:
        weight = next(module.parameters(recurse=False), None)
        return (dtype == torch.float32 and weight is not None and weight.dtype == torch.bfloat16 and weight.is_cuda
                and "forward" not in vars(module))

    split = {m: partial(split_matmul.fp32_linear, weight=m.weight, bias=m.bias) for m in model.modules()
             if type(m) is torch.nn.Linear and from_parts(m)}
    split.update({m: reference_experts.experts_forward(m) for m in model.modules()
                  if from_parts(m) and swiglu_experts_problem(m) is None})
    owners = [m for m in model.modules() if m not in split and next(m.parameters(recurse=False), None) is not None]
    handles = [h for m in owners for h in (m.register_forward_pre_hook(cast), m.register_forward_hook(restore))]
    for module, forward in split.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in split:
            del module.forward
        for handle in handles:
            handle.remove()
        for param, data in stored.items():  # a forward that raised half-way
            param.data = data


@contextmanager
def _as_reference(model: torch.nn.Module, dtype: torch.dtype):
    """The model as the end-to-end reference: computing in ``dtype``, its decode steps' attention grouped by kv head
    (optiq.reference_attention) rather than HF's sdpa path with its copies of the keys and values."""
    with computing_in(model, dtype), grouped_decode_attention(model):
        yield


def _decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int, forced: torch.Tensor | None,
            changes: list[Change], engine_recipes: list, mode: str = "eager", dtype: torch.dtype | None = None,
            against: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode ``steps`` steps in engine ``mode`` (as the reference, computing in ``dtype``, if given); with
    ``forced`` (the reference's picks) the next input is always the reference's. Returns the logits [steps, batch,
    vocab] in float32 or, with ``against`` (logits of that shape), only the float64 sum of squares of the logits'
    difference from them, taken step by step so that a decode never holds more than one step of its own (at C=64 on a
    152k vocabulary the logits of 64 steps are 2.5 GB in fp32); and this model's own picks [steps + 1, batch].
    Everything stays on the model's device: the loop neither waits for the device nor copies to the host."""
    engine = DecodeEngine(model, prompt.shape[0], decode_cache_len(prompt.shape[1], steps), mode=mode,
                          dtype=dtype)
    changes = changes + [(site := engine_site(a, engine)).bind(site.replacement) for a in engine_recipes]
    for change in changes:
        change.redo()
    try:
        with _as_reference(model, dtype) if dtype is not None else nullcontext():
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


def _distance(model: torch.nn.Module, b: Baseline, changes: list[Change], engine_recipes: list,
              mode: str) -> tuple[float, float]:
    """The relative logits error over all steps (||got - want|| / ||want||) and the top-1 agreement with the
    reference of the model with ``changes`` and ``engine_recipes`` applied, teacher-forced by the reference's picks;
    the same measure for the unpatched model and every patched set."""
    squared_error, picks = _decode(model, b.prompt, b.want.shape[0], b.picks, changes, engine_recipes, mode,
                                   against=b.want)
    return (squared_error.sqrt() / b.want_norm).item(), (picks[1:] == b.picks[1:]).double().mean().item()


def baselines(patches: Patches, concurrencies, steps: int, prompt_len: int, seed: int,
              mode: str) -> tuple[dict[int, Baseline], float, str]:
    """The baselines of every concurrency, computed once per gate (every recipe set is checked against the same),
    the seconds of the fp32 reference decode among them and the engine mode it decoded in. The prompt at concurrency
    C is the first C sequences of the largest one's, so for a half-precision model one fp32 reference decode, at the
    largest concurrency, serves all (a sequence's logits do not depend on its batch's other sequences). It runs in the
    gate's engine mode: in graph mode its steps replay one captured step, fp32 weight casts included, instead of
    launching ~10 kernels per linear layer from Python; eager if its fp32 step cannot be captured."""
    model = patches.model
    dtype = next(model.parameters()).dtype
    prompts = _prompt(model, max(concurrencies), prompt_len, seed).to(next(model.parameters()).device)
    reference_seconds, reference_mode = 0.0, mode
    with torch.inference_mode(), patches.suspended():
        if dtype != torch.float32:
            started = time.perf_counter()
            try:
                want_all, picks_all = _decode(model, prompts, steps, None, [], [], mode, dtype=torch.float32)
            except CaptureError:  # a step that synchronises with the host, such as a model's own fp32 MoE loop
                reference_mode = "eager"
                want_all, picks_all = _decode(model, prompts, steps, None, [], [], "eager", dtype=torch.float32)
            if prompts.device.type == "cuda":  # the decode only queued its kernels
                torch.cuda.synchronize(prompts.device)
            reference_seconds = time.perf_counter() - started
        found = {}
        for concurrency in concurrencies:
            prompt = prompts[:concurrency]
            if dtype == torch.float32:
                want, picks = _decode(model, prompt, steps, None, [], [], mode)
            else:
                want, picks = want_all[:, :concurrency], picks_all[:, :concurrency]
            # In float64 one step at a time: a float64 copy of all of want would be twice its size.
            want_norm = sum(step.double().square().sum() for step in want).sqrt().item()
            found[concurrency] = b = Baseline(prompt, want, picks, want_norm)
            if dtype != torch.float32:
                b.rel_err_unpatched, b.top1_unpatched = _distance(model, b, [], [], mode)
    return found, reference_seconds, reference_mode


def end_to_end(patches: Patches, names: list[str], found: dict[int, Baseline], mode: str = "eager") -> list[EndToEnd]:
    """Teacher-forced decode of the model with recipes ``names`` applied against the reference (module docstring), at
    each concurrency of ``found``, its baselines (``baselines``). The model runs in engine ``mode`` (in graph mode,
    its captured graphs are what is checked), as the fp32 reference did."""
    model = patches.model
    dtype = next(model.parameters()).dtype
    chosen = [patches.applied[n] for n in names]
    loosest = max((a.recipe.tolerance for a in chosen), key=ORDER.index, default="exact")
    factor = GATE[loosest][0] if loosest != "exact" else 0.0
    floor = E2E_FLOOR_EPS * torch.finfo(torch.float32).eps if loosest != "exact" else 0.0
    model_changes = [c for a in chosen if a.recipe.patch_kind != "engine" for c in a.changes]
    engine_recipes = [a for a in chosen if a.recipe.patch_kind == "engine"]
    results = []
    with torch.inference_mode(), patches.suspended():
        for concurrency, b in found.items():
            started = time.perf_counter()
            rel, top1 = _distance(model, b, model_changes, engine_recipes, mode)
            bound = factor * b.rel_err_unpatched + floor
            min_top1 = b.top1_unpatched - (0.0 if dtype == torch.float32 else E2E_SLACK[loosest])
            results.append(EndToEnd(concurrency, b.want.shape[0], rel <= bound and top1 >= min_top1, rel,
                                    b.rel_err_unpatched, bound, top1, b.top1_unpatched, min_top1, tuple(names),
                                    time.perf_counter() - started))
    return results


def validate(patches: Patches, concurrencies=(1, 4), steps: int = 64, prompt_len: int = 16,
             seed: int = 0, mode: str = "eager") -> Validation:
    """Gate every applied recipe, undo those that fail, then check the survivors end to end; a recipe that fails end
    to end on its own is undone too, and if the set still fails only together, all of it is."""
    report = Validation()
    if not patches.applied:
        return report
    started = time.perf_counter()
    with torch.inference_mode():
        captured = _capture(patches, max(concurrencies), prompt_len, seed)
    report.capture_seconds = time.perf_counter() - started
    # The baselines before the per-recipe checks, though a set the checks reject all of would not need them: no fused
    # kernel runs in them, so kernels compiled ahead in other processes meanwhile (compile_ahead) are ready for both.
    started = time.perf_counter()
    found, report.reference_seconds, report.reference_mode = baselines(patches, concurrencies, steps, prompt_len,
                                                                       seed, mode)
    report.baseline_seconds = time.perf_counter() - started
    with torch.inference_mode():
        for name, sites in captured.items():
            started = time.perf_counter()
            report.recipes[name] = _gate(patches, name, sites)
            report.recipes[name].seconds = time.perf_counter() - started
    for name, result in report.recipes.items():
        if not result.passed:
            patches.undo(name)
            report.rolled_back.append(name)
    kept = list(patches.applied)
    if not kept:
        return report

    def check(names: list[str]) -> list[EndToEnd]:
        return end_to_end(patches, names, found, mode)

    report.end_to_end = check(kept)
    if all(e.passed for e in report.end_to_end):
        return report
    for name in kept:
        failed = next((e for e in check([name]) if not e.passed), None)
        if failed is not None:
            report.recipes[name].passed = False
            report.recipes[name].reason = (f"end to end at concurrency {failed.concurrency}: logits error "
                                           f"{failed.rel_err:.3g} (bound {failed.bound:.3g}), top-1 {failed.top1:.3f} "
                                           f"(min {failed.min_top1:.3f})")
    together = [n for n in kept if report.recipes[n].passed]
    if together:
        report.end_to_end = check(together)
        if not all(e.passed for e in report.end_to_end):
            for name in together:
                report.recipes[name].passed = False
                report.recipes[name].reason = "fails end to end only together with the other recipes"
    for name in kept:
        if not report.recipes[name].passed:
            patches.undo(name)
            report.rolled_back.append(name)
    return report
