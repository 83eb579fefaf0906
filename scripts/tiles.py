"""Time a fusion under the fixed tile configs of its TILE_GRID against its shape heuristic (tile_config), at decode
row counts of its benchmark cases, on a GPU: which tiles keep HBM busiest with few rows (and the eager path
it replaces, timed the same way).
Usage: python scripts/tiles.py FUSION OUT.json   (FUSION: moe_experts, linear)"""

import importlib
import json
import sys

import torch
import triton

from optiq.measure.roofline import copy_bandwidth


def main(name: str, out_path: str) -> None:
    module = importlib.import_module(f"optiq.fusions.{name}")
    heuristic = module.tile_config
    bandwidth = copy_bandwidth(torch.device("cuda"))  # measured here, as bench_fusions.py does
    results = []
    for rows in (1, 16, 64):
        cases = module.benchmark_case(rows, torch.bfloat16, torch.device("cuda"))
        for label, case in ([(name, cases)] if "fused" in cases else cases.items()):
            for config in [None, *module.TILE_GRID]:
                module.tile_config = heuristic if config is None else (
                    lambda *shape, config=config: {**heuristic(*shape), **config})
                ms = triton.testing.do_bench_cudagraph(case["fused"], rep=50, return_mode="median")
                roof = case["bytes"] / (ms * 1e-3) / bandwidth
                results.append({"case": label, "rows": rows, "config": config or "heuristic", "us": ms * 1e3,
                                "roof": roof})
                print(f"{label:28} rows {rows:3d} {str(config or 'heuristic'):45} "
                      f"{ms * 1e3:8.1f} us {100 * roof:5.1f}% roof", flush=True)
            module.tile_config = heuristic
            if "eager" in case:  # what the fusion replaces (cuBLAS for a GEMM), timed the same way
                ms = triton.testing.do_bench_cudagraph(case["eager"], rep=50, return_mode="median")
                results.append({"case": label, "rows": rows, "config": "eager", "us": ms * 1e3,
                                "roof": case["bytes"] / (ms * 1e-3) / bandwidth})
                print(f"{label:28} rows {rows:3d} {'eager':45} {ms * 1e3:8.1f} us", flush=True)
    json.dump(results, open(out_path, "w"), indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
