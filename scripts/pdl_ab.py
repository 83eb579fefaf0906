"""Decode tok/s of a patched preset with programmatic dependent launch off and on (OPTIQ_PDL=0 / 1), alternating
in one process: same model, recipes and workload, so the ratio is PDL's alone. The recipes are applied without the
gate (`optiq apply-fusion` gates the same set). Usage: python scripts/pdl_ab.py MODEL RECIPE,... OUT.json [C,...]"""

import json
import os
import sys
from dataclasses import asdict

import torch

from optiq.catalog.recipes import load_catalog
from optiq.measure.roofline import copy_bandwidth
from optiq.measure.sweep import free_memory, measure_point
from optiq.models import load_model
from optiq.patching import apply
from optiq.record import Workload


def main(model_spec: str, recipes: str, out_path: str, concurrencies: str = "1,16,64") -> None:
    device = torch.device("cuda")
    model = load_model(model_spec, torch.bfloat16, device)
    catalog = load_catalog()
    apply(model, [catalog[name] for name in recipes.split(",")])
    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in (int(c) for c in concurrencies.split(",")):
        for pdl in ("0", "1", "0", "1"):
            os.environ["OPTIQ_PDL"] = pdl
            row = measure_point(model, batch, Workload(), "graph", bandwidth, variant=f"pdl={pdl}")
            rows.append(row)
            free_memory()
            print(f"{model_spec} C={batch} PDL={pdl}: {row.tok_per_s:.1f} tok/s, {row.ms_per_step:.4f} ms/step",
                  flush=True)
            json.dump([asdict(r) for r in rows], open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
