"""Decode tok/s of a patched preset under each value of one of optiq's measuring knobs (OPTIQ_PDL, OPTIQ_SPLIT_K,
OPTIQ_PREFETCH_KB, ...), alternating twice in one process: same model, recipes and workload, so the ratios are the
knob's alone. The recipes are applied without the gate (`optiq apply-fusion` gates the same set); each value's graph
is captured afresh. With TRACES set to a directory, a graph trace of the first and last values at the first
concurrency is written there. Usage: python scripts/knob_ab.py MODEL RECIPE,... OUT.json KNOB=V,V[,...] [C,...]"""

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from optiq.catalog.recipes import load_catalog
from optiq.measure.roofline import copy_bandwidth
from optiq.measure.sweep import free_memory, measure_point
from optiq.models import load_model
from optiq.patching import apply
from optiq.profiling.capture import capture
from optiq.record import Workload

REPEATS = 2  # passes over the values


def main(model_spec: str, recipes: str, out_path: str, knob: str, concurrencies: str = "1,16,64") -> None:
    name, values = knob.split("=")
    values = values.split(",")
    device = torch.device("cuda")
    model = load_model(model_spec, torch.bfloat16, device)
    catalog = load_catalog()
    apply(model, [catalog[recipe] for recipe in recipes.split(",")])
    bandwidth = copy_bandwidth(device)
    rows = []
    batches = [int(c) for c in concurrencies.split(",")]
    for batch in batches:
        for _ in range(REPEATS):
            for value in values:
                os.environ[name] = value
                row = measure_point(model, batch, Workload(), "graph", bandwidth, variant=f"{name}={value}")
                rows.append(row)
                free_memory()
                print(f"{model_spec} C={batch} {name}={value}: {row.tok_per_s:.1f} tok/s, {row.ms_per_step:.4f} "
                      f"ms/step, {100 * row.floor_ms_per_step / row.ms_per_step:.1f}% of the floor", flush=True)
                json.dump([asdict(r) for r in rows], open(out_path, "w"), indent=1)
    if os.environ.get("TRACES"):
        for value in (values[0], values[-1]):
            os.environ[name] = value
            capture(model, batches[0], Workload().prompt_len, Workload().max_len, "graph",
                    Path(os.environ["TRACES"]) / f"{model_spec}_{name}_{value}_C{batches[0]}.json.gz")
            free_memory()


if __name__ == "__main__":
    main(*sys.argv[1:])
