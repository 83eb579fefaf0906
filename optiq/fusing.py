"""Recipes into a loaded model, each through the validation gate: what ``optiq apply-fusion`` and ``optiq bench
--recipes`` share. A recipe the gate rolls back is undone and recorded; with ``auto``, a rival it had kept out (two
recipes that patch the same place) is chosen and gated in its stead."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Callable

import torch

from optiq import compile_ahead
from optiq.errors import OptiqError
from optiq.patching import Patches, apply, unpatch
from optiq.proposals import propose
from optiq.validation import validate

PROFILED_STEPS = 2  # decode steps profiled per concurrency for the proposals


def choose_recipes(requested: str, catalog: dict, proposals: dict[int, list], min_share: float) -> list[str]:
    """``auto``: every proposal covering at least ``min_share`` % of the step at some concurrency, largest first, but
    none that patches what a larger one patches (concurrencies may rank rivals differently); otherwise the named
    recipes, which must exist."""
    if requested != "auto":
        names = [n.strip() for n in requested.split(",") if n.strip()]
        unknown = [n for n in names if n not in catalog]
        if unknown:
            raise OptiqError(f"unknown recipe(s) {', '.join(unknown)}; the catalog has: {', '.join(catalog)}")
        return names
    best: dict[str, float] = {}
    for found in proposals.values():
        for p in found:
            best[p.recipe] = max(best.get(p.recipe, 0.0), p.covered_pct)
    chosen, taken = [], set()
    for name, share in sorted(best.items(), key=lambda item: -item[1]):
        if share >= min_share and not taken.intersection(catalog[name].claims):
            chosen.append(name)
            taken.update(catalog[name].claims)
    return chosen


def proposals(catalog: dict, kernels: dict[int, object], model_type: str, rejected=()) -> dict[int, list]:
    """The catalog's proposals per concurrency for profiled kernel tables, leaving out ``rejected`` recipes."""
    candidates = {n: r for n, r in catalog.items() if n not in rejected}
    return {c: propose(candidates, k, model_type) for c, k in kernels.items()}


def choose_again(requested: str, catalog: dict, kernels: dict[int, object], model_type: str,
                 min_share: float) -> Callable[[list[str]], list[str]] | None:
    """For ``fuse``: with ``auto``, the proposals chosen again without the recipes the gate rolled back (one may have
    kept a rival out); named recipes are never replaced."""
    if requested != "auto":
        return None
    return lambda rejected: choose_recipes(requested, catalog, proposals(catalog, kernels, model_type, rejected),
                                           min_share)


def new_record() -> dict:
    """What a fusion leaves for the report: applied, rolled back, not applicable, the gate's verdicts, timings."""
    return {"applied": [], "not_applicable": {}, "rolled_back": [], "gate": {"recipes": {}, "end_to_end": []},
            "timings": {}}


def gate_settings(concurrencies: list[int], steps: int, prompt_len: int, max_len: int, mode: str) -> dict:
    """validate's arguments for a workload: its concurrencies and engine mode, and a prompt that leaves the
    teacher-forced steps room in the cache."""
    return dict(concurrencies=tuple(concurrencies), steps=steps, prompt_len=min(prompt_len, max_len - steps - 1),
                mode=mode)


def fuse(model: torch.nn.Module, catalog: dict, names: list[str], record: dict, gate: dict,
         rechoose: Callable[[list[str]], list[str]] | None = None, on_round: Callable[[], None] = lambda: None,
         status: Callable = lambda text: nullcontext(), ahead: compile_ahead.Workers | None = None) -> Patches:
    """Patch ``model`` with recipes ``names`` and gate them (``gate``: gate_settings); ``record`` (new_record) adds
    up every round's timings and verdicts, and ``on_round`` runs after each (to save). After a round that rolled
    something back, ``rechoose(rolled_back)`` (choose_again) may name a new set to try. With ``ahead``
    (compile_ahead.workers), other processes compile the recipes' kernels while the gate runs."""
    timings = record["timings"]
    while True:
        with ahead.compiling(names) if ahead else nullcontext([]) as compiling:  # from the start: patching too
            started = time.perf_counter()
            patches = apply(model, [catalog[n] for n in names])
            timings["patch_s"] = timings.get("patch_s", 0.0) + time.perf_counter() - started
            record["not_applicable"].update(patches.not_applicable)
            started = time.perf_counter()
            with status(f"validating {', '.join(patches.applied)}"):
                verdict = validate(patches, **gate)
            gate_s = time.perf_counter() - started
        record["compile_ahead"] = [asdict(child) for child in compiling]
        for key, seconds in (("gate_s", gate_s), ("gate_capture_s", verdict.capture_seconds),
                             ("gate_baselines_s", verdict.baseline_seconds),
                             ("gate_reference_s", verdict.reference_seconds)):
            timings[key] = timings.get(key, 0.0) + seconds
        record["gate"]["recipes"].update({n: asdict(r) for n, r in verdict.recipes.items()})
        record["gate"]["end_to_end"] = [asdict(e) for e in verdict.end_to_end]
        record["gate"]["reference_mode"] = verdict.reference_mode
        record["rolled_back"] += verdict.rolled_back
        record["applied"] = list(patches.applied)
        on_round()
        if not verdict.rolled_back or rechoose is None:
            return patches
        again = rechoose(record["rolled_back"])
        if not set(again) - set(names):
            return patches
        unpatch(model)
        names = again
