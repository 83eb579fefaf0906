"""The optimize workflow that ``optiq apply-fusion`` and ``optiq bench`` share, start to end:

    load -> measure before (the model, its peers) -> profile -> propose -> choose -> fuse (patch + gate, rolling
    back what fails) -> measure after -> profile after

into one run record (``optiq.record``), saved after every step. The commands differ only in what they ask for (a
``Job``) and how they show progress (``Hooks``); neither knows the other.

Kernels are compiled ahead (``optiq.compile_ahead``) by worker processes started after the "before" rows, so their
start-up never overlaps a measured point, and while the model is profiled for the proposals.

The recipes' code is imported and checked as soon as the model is loaded, before anything is measured
(``patching.broken``): a recipe whose kernel or factory does not resolve is rejected with why, the others go on, and
a request whose every recipe is broken ends "rejected" in seconds, not after the "before" sweep and the profiles.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from optiq import compile_ahead
from optiq.catalog.proposals import choose_recipes, named_recipes, propose_all
from optiq.catalog.recipes import Recipe
from optiq.engine import graph_mode_problem
from optiq.errors import NothingApplies
from optiq.gate import GatePlan, Validation, validate
from optiq.gate.mutants import verify
from optiq.measure import environment
from optiq.measure.depth import depth_point, full_depth, layer_kinds
from optiq.measure.roofline import copy_bandwidth
from optiq.measure.sweep import Variant, compiled_forward, free_memory, sweep
from optiq.models import PUBLISHED, load_model
from optiq.patching import Patches, apply, broken, unpatch
from optiq.profiling.capture import profile_step
from optiq.record import HF_VARIANT, Fusion, FullDepth, RecipeVerdict, Row, RunRecord, Workload, compile_variant
from optiq.traces.attribution import Attribution, attribute, weighted_kernels

PROFILED_STEPS = 2  # decode steps profiled per concurrency for the proposals and the report


@dataclass
class Job:
    """What a run asks for."""
    command: str  # apply-fusion or bench: the record's kind
    model: str  # a preset or a checkpoint directory
    dtype: torch.dtype
    device: torch.device
    mode: str  # the engine's: eager or graph
    concurrencies: list[int]
    workload: Workload
    peers: tuple[str, ...] = ()  # measured beside the model: hf (HF's own step on its own cache), eager (HF's step
    # from Python on the engine's static cache), compile (torch.compile)
    requested: str | None = None  # recipes: "auto", names comma-separated, or None to measure only
    catalog: dict[str, Recipe] = field(default_factory=dict)
    recipes_dirs: tuple[str, ...] = ()  # where the catalog's user recipes came from (the compile workers load it)
    gate_steps: int = 64
    min_share: float = 0.25  # auto: the least share of the step (in %) a proposal must cover
    profile: bool = False  # profile the model before and after fusing, for the report (else only for auto); a
    # truncated preset is always profiled: its whole model is extrapolated from the profiles (optiq.measure.depth)
    mutants: bool = False  # gate the mutants of each chosen recipe's kernel first (optiq.gate.mutants)
    peer_budget_s: float | None = None  # the most a peer's warm-up may take at a point (optiq.measure.sweep)


class SweepProgress:
    """What a sweep tells its watcher: a point starts, a point is done."""

    def start(self, variant: str, concurrency: int) -> None:
        pass

    def done(self) -> None:
        pass


@dataclass
class Hooks:
    """How the run is shown and kept: ``save(record)`` after every step that changed it, ``status(text)`` around a
    long step, ``sweep(label, points)`` around a throughput sweep, ``note(line)`` for what the user must know of how
    the run went (a fallback), ``step(line)`` for what a step found (the gate's verdict on each recipe) as it is
    found, so a log shows it before the run ends."""
    save: Callable[[RunRecord], None] = lambda record: None
    status: Callable[[str], AbstractContextManager] = lambda text: nullcontext()
    sweep: Callable[[str, int], AbstractContextManager[SweepProgress]] = lambda label, points: nullcontext(
        SweepProgress())
    note: Callable[[str], None] = lambda line: None
    step: Callable[[str], None] = lambda line: None


def fused_variant(mode: str) -> str:
    """The variant name of optiq's fused model's rows in engine ``mode``."""
    return f"optiq+{mode}"


def new_record(job: Job) -> RunRecord:
    return RunRecord(job.command, job.model, str(job.dtype).removeprefix("torch."), job.mode,
                     environment(job.device), job.workload, list(job.concurrencies),
                     fusion=Fusion(job.requested.split(",")) if job.requested else None)


def run(job: Job, record: RunRecord, run_dir: Path, hooks: Hooks = Hooks()) -> None:
    """Carry out ``job`` into ``record`` (``new_record``), saving it after every step and keeping the profiles'
    traces in ``run_dir``. On an error or an interrupt what was measured is saved already, and the record's status is
    the caller's to set. The model is unpatched when the run ends, however it ends: function and attention-interface
    patches are global to the process, and a later run in it must measure models as they are."""
    with hooks.status(f"loading {job.model}"):
        model = load_model(job.model, job.dtype, job.device)
    if job.requested:
        with hooks.status("importing the recipes' kernels and factories"):
            job = _without_broken_recipes(job, model.config.model_type, record)
        hooks.save(record)
        if not job.requested:
            record.status = "rejected"
            return
        if job.requested != "auto":
            _check_sites(model, [job.catalog[n] for n in named_recipes(job.requested, job.catalog)])
    if job.mode == "graph":
        with hooks.status("trying a CUDA-graph capture of one decode step"):
            problem = graph_mode_problem(model)
        if problem:
            job = replace(job, mode="eager")
            record.mode, record.mode_note = "eager", f"{problem}: measured in eager mode"
            hooks.note(record.mode_note)
    bandwidth = copy_bandwidth(job.device)
    record.bandwidth_gb_s = bandwidth / 1e9
    variants = [Variant(HF_VARIANT, "eager", own_cache=True)] if "hf" in job.peers else []
    if "eager" in job.peers and job.mode != "eager":
        variants.append(Variant("eager", "eager"))
    variants.append(Variant(job.mode, job.mode))
    if "compile" in job.peers:
        variants.append(Variant(compile_variant(job.mode), job.mode, compiled_forward(model)))
    if (published := PUBLISHED.get(job.model)) is not None:
        with hooks.status(f"counting the floor of {published.name} at full depth"):
            record.full_depth = full_depth(published, model, job.concurrencies, job.workload, bandwidth)
        record.full_depth.not_profiled = [variant.name for variant in variants if variant.name != job.mode]
        job = replace(job, profile=True)  # the whole model is extrapolated from the profiles of the preset's layers
    hooks.save(record)
    _measure(job, model, variants, bandwidth, record.before, record, hooks, job.model)
    if job.profile and not job.requested:  # a fusing run profiles the model on its way to the proposals
        _profile(job, model, "before", record.attribution_before, record, run_dir, hooks)
    if job.requested:
        try:
            _fuse_and_measure(job, model, bandwidth, record, run_dir, hooks)
        finally:
            unpatch(model)
    if record.status == "running":
        record.status = "complete"


def _without_broken_recipes(job: Job, model_type: str, record: RunRecord) -> Job:
    """``job`` without the recipes it may try whose code does not resolve (``patching.broken``), each recorded as
    rejected with why; its ``requested`` empty if it named recipes and every one of them is broken."""
    named = job.requested != "auto"
    tried = named_recipes(job.requested, job.catalog) if named else [
        name for name, recipe in job.catalog.items() if recipe.applies_to(model_type)]
    failed = broken(job.catalog[name] for name in tried)
    for name, why in failed.items():
        record.fusion.gate.recipes[name] = RecipeVerdict(name, job.catalog[name].tolerance, False, why)
        record.fusion.rolled_back.append(name)
    catalog = {name: recipe for name, recipe in job.catalog.items() if name not in failed}
    requested = ",".join(name for name in tried if name not in failed) if named else job.requested
    return replace(job, catalog=catalog, requested=requested)


def _check_sites(model, recipes: list[Recipe]) -> None:
    """Before anything is measured: recipes asked for by name that all find no site in ``model`` (a Llama has no
    experts for moe_experts) end the run with why, instead of a "before" sweep and a gate with nothing to gate."""
    patches = apply(model, recipes)
    found = bool(patches.applied or patches.failed)  # before unpatching, which empties ``applied``
    unpatch(model)
    if not found:
        _nothing_applies(patches.not_applicable)


def _nothing_applies(not_applicable: dict[str, str]) -> None:
    raise NothingApplies("no recipe applies to this model: " + "; ".join(
        f"{name}: {why}" for name, why in not_applicable.items()))


def _fuse_and_measure(job: Job, model, bandwidth: float, record: RunRecord, run_dir: Path, hooks: Hooks) -> None:
    """Profile (for the proposals, and the report), choose, fuse and gate, then measure and profile the fused
    model; status "rejected" when the gate kept none of the recipes."""
    plan = GatePlan.for_workload(job.concurrencies, job.gate_steps, job.workload.prompt_len, job.workload.max_len,
                                 job.mode)
    source = compile_ahead.Source(job.model, record.dtype, job.recipes_dirs, job.workload.prompt_len,
                                  job.workload.max_len)
    with compile_ahead.workers(job.device, source, plan, hooks.note) as ahead:
        kernels = {}
        if job.profile or job.requested == "auto":
            kernels = _profile(job, model, "before", record.attribution_before, record, run_dir, hooks)
        found = propose_all(job.catalog, kernels, model)
        record.fusion.proposals = {str(c): ps for c, ps in found.items()}
        names = choose_recipes(job.requested, job.catalog, found, job.min_share)
        if not names:
            raise NothingApplies(f"no recipe applies to this model: no proposal covers {job.min_share}% of the step "
                                 "(--min-share)")
        if job.mutants:
            _gate_mutants(model, [job.catalog[n] for n in names], plan, record, hooks)
        rechoose = None
        if job.requested == "auto":
            def rechoose(rejected: list[str]) -> list[str]:
                again = propose_all(job.catalog, kernels, model, rejected)
                return choose_recipes(job.requested, job.catalog, again, job.min_share)
        patches = fuse(model, job.catalog, names, record, plan, hooks, rechoose, ahead)
    if not patches.applied:
        if not record.fusion.rolled_back:  # every recipe chosen found no site: nothing was gated
            _nothing_applies(record.fusion.not_applicable)
        record.status = "rejected"
        return
    _measure(job, model, [(fused_variant(job.mode), job.mode, None)], bandwidth, record.after, record, hooks,
             f"{job.model} optiq")
    record.fusion.timings.capture_s = sum(r.warmup_s or 0.0 for r in record.after)
    hooks.save(record)
    if job.profile:
        _profile(job, model, "after", record.attribution_after, record, run_dir, hooks)


def _tell_verdict(verdict: Validation, patches: Patches, hooks: Hooks) -> None:
    """One ``hooks.step`` line per recipe of a gate round, and one for its end-to-end check."""
    for name, why in patches.not_applicable.items():
        hooks.step(f"gate: {name} not applicable ({why})")
    for name, judged in verdict.recipes.items():
        hooks.step(f"gate: {name} " + ("kept" if name not in verdict.rolled_back else
                                       f"rolled back ({judged.reason})"))
    for check in verdict.end_to_end:
        hooks.step(f"gate: end to end at C={check.concurrency} {'passed' if check.passed else 'failed'} "
                   f"(logits rel err {check.rel_err:.2e}, bound {check.bound:.2e}; top-1 {check.top1:.3f})")


def _gate_mutants(model, recipes: list[Recipe], plan: GatePlan, record: RunRecord, hooks: Hooks) -> None:
    """Each recipe's mutation score on the unpatched model, into the record as each is done."""
    def done(name: str, result) -> None:
        if not isinstance(result, str):
            record.fusion.mutants[name] = result.summary()
            hooks.save(record)

    with hooks.status(f"gating the mutants of {', '.join(r.name for r in recipes)}"):
        verify(model, recipes, plan, done=done)


def _measure(job: Job, model, variants, bandwidth: float, rows: list[Row], record: RunRecord, hooks: Hooks,
             label: str) -> None:
    """A throughput sweep of ``variants`` into ``rows``, the record saved after every point."""
    with hooks.sweep(label, len(variants) * len(job.concurrencies)) as progress:
        def on_row(row: Row) -> None:
            rows.append(row)
            hooks.save(record)
            progress.done()

        sweep(model, job.concurrencies, job.workload, variants, bandwidth, on_row=on_row, on_start=progress.start,
              peer_budget_s=job.peer_budget_s)


def _profile(job: Job, model, state: str, attribution: dict, record: RunRecord, run_dir: Path,
             hooks: Hooks) -> dict:
    """The model profiled at every concurrency its sweep measured (one that ran out of memory there is not tried
    again): its op-class tables into ``attribution``, for a truncated preset the whole model's step extrapolated
    from the same profile (``_extrapolate``), and the per-step weighted kernel tables the proposals are made from."""
    variant, rows = (job.mode, record.before) if state == "before" else (fused_variant(job.mode), record.after)
    measured = {row.concurrency: row for row in rows if row.variant == variant and row.status == "ok"}
    kernels = {}
    for batch in (c for c in job.concurrencies if c in measured):
        with hooks.status(f"profiling {job.model} C={batch} ({state})"):
            trace = profile_step(model, batch, job.workload.prompt_len, job.workload.max_len, job.mode,
                                 run_dir, PROFILED_STEPS, f"{state}_")
        table = attribute([trace], "class")
        attribution[str(batch)] = {"summary": table.summary, "table": table.table.to_dict(orient="records")}
        if record.full_depth is not None:
            _extrapolate(record.full_depth, attribute([trace], "layer"), model, measured[batch], hooks)
        kernels[batch] = weighted_kernels([trace])
        hooks.save(record)
        free_memory()
    return kernels


def _extrapolate(depth: FullDepth, layers: Attribution, model, row: Row, hooks: Hooks) -> None:
    """The whole model's step at ``row``'s point, from the preset's profile by layer, into ``depth``, told as a
    step line."""
    point = depth_point(depth, layers, layer_kinds(model.config), row)
    depth.time_unit = layers.summary["time_unit"]
    if point is None:
        return
    depth.points.append(point)
    hooks.step(f"{depth.published} ({depth.layers} layers, extrapolated from {depth.measured_layers}): "
               f"{row.variant} C={row.concurrency} {point.ms_per_step:.3f} ms/step, {point.tok_per_s:,.1f} tok/s, "
               f"{point.pct_of_floor:.1f}% of its floor")


def fuse(model: torch.nn.Module, catalog: dict[str, Recipe], names: list[str], record: RunRecord, plan: GatePlan,
         hooks: Hooks = Hooks(), rechoose: Callable[[list[str]], list[str]] | None = None,
         ahead: compile_ahead.Workers | None = None) -> Patches:
    """Patch ``model`` with recipes ``names`` and gate them; ``record.fusion`` adds up every round's timings and
    verdicts, saved after each. After a round that rolled something back, or a recipe that found no site,
    ``rechoose(rejected)`` may name a new set to try (auto: a rival the rejected recipe had kept out). With ``ahead``, worker processes compile the
    recipes' kernels while the gate runs."""
    fusion, timings = record.fusion, record.fusion.timings
    while True:
        with ahead.compiling(names) if ahead else nullcontext([]) as compiling:  # from the start: patching too
            started = time.perf_counter()
            patches = apply(model, [catalog[n] for n in names])
            timings.patch_s += time.perf_counter() - started
            fusion.not_applicable.update(patches.not_applicable)
            again = rechoose(fusion.rolled_back + list(fusion.not_applicable)) if rechoose and patches.not_applicable \
                else names
            if set(again) - set(names):  # a recipe found no site: the rivals it kept out get their turn
                unpatch(model)
                names = again
                continue
            started = time.perf_counter()
            with hooks.status(f"validating {', '.join(patches.applied)}"):
                verdict = validate(patches, plan)
            timings.gate_s += time.perf_counter() - started
        fusion.compile_ahead = list(compiling)
        timings.gate_capture_s += verdict.capture_seconds
        timings.gate_baselines_s += verdict.baseline_seconds
        timings.gate_reference_s += verdict.reference_seconds
        fusion.gate.recipes.update(verdict.recipes)
        fusion.gate.end_to_end = list(verdict.end_to_end)
        fusion.gate.reference_mode = verdict.reference_mode
        fusion.gate.constant_parameters = verdict.constant_parameters
        fusion.rolled_back += verdict.rolled_back
        fusion.applied = list(patches.applied)
        hooks.save(record)
        _tell_verdict(verdict, patches, hooks)
        if not verdict.rolled_back or rechoose is None:
            return patches
        again = rechoose(fusion.rolled_back + list(fusion.not_applicable))
        if not set(again) - set(names):
            return patches
        unpatch(model)
        names = again
