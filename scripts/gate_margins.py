"""The error distributions the gate's factors are derived from: each built-in recipe that applies to MODEL, patched
alone, its sites' captured calls at every concurrency of the plan run through the gate's three paths
(optiq.gate.per_recipe.call_errors), and per recipe the quantiles of err(fused) / err(unfused) and of
err(unfused) / err(rounded) over all calls (the unit the floor is counted in). Writes one JSON document.

Usage: python scripts/gate_margins.py MODEL DTYPE CONCURRENCIES PROMPT MAX_LEN OUT.json
(e.g. qwen3-0.6b bf16 1,16,64 512 1024 margins.json; tiny-llama fp32 1,4 16 81 margins.json on a CPU)"""

import json
import sys

import torch

from optiq.catalog.recipes import load_catalog
from optiq.gate.capture import capture_inputs
from optiq.gate.per_recipe import call_errors
from optiq.gate.plan import GatePlan

from optiq.models import load_model, resolve_dtype
from optiq.patching import apply


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None  # noqa: E731
    return {"n": len(ordered), "min": pick(0.0), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1] if ordered
            else None}


def main(spec, dtype_name, concurrencies, prompt_len, max_len, out_path):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(spec, resolve_dtype(dtype_name, device), device)
    plan = GatePlan(tuple(int(c) for c in concurrencies.split(",")), prompt_len=int(prompt_len),
                    max_len=int(max_len))
    found = {}
    for name, recipe in load_catalog().items():
        patches = apply(model, [recipe])
        if name not in patches.applied:
            continue
        ratios, floors = [], []
        try:
            points = plan.capture_points()
            for batch, context in points:
                with torch.inference_mode():
                    captured = capture_inputs(patches, plan, batch, context)
                    for call in call_errors(patches, name, captured[name], scaled=(batch, context) == points[0]):
                        if call.err_unfused > 0:
                            ratios.append(call.err_fused / call.err_unfused)
                            floors.append(call.err_fused / max(call.bound, 1e-300))
        finally:
            patches.undo()
        found[name] = {"tolerance": recipe.tolerance, "fused_over_unfused": quantiles(ratios),
                       "fused_over_bound": quantiles(floors)}
        print(name, recipe.tolerance, json.dumps(found[name]), flush=True)
    with open(out_path, "w") as f:
        json.dump({"model": spec, "dtype": dtype_name, "plan": vars(plan), "recipes": found}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
