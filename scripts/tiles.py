"""Time a fusion under the fixed tile configs of its TILE_GRID against its shape heuristic (tile_config), at decode
row counts of its benchmark cases, on a GPU: which tiles keep HBM busiest with few rows (and the eager path
it replaces, timed the same way).
Usage: python scripts/tiles.py FUSION OUT.json [ROWS] [CASES]   (FUSION: moe_experts, linear, decode_attention; ROWS
e.g. 1,16,64, the default; CASES, comma-separated parts of case labels, times only the cases that hold one). A config
the GPU cannot run (too much shared memory) is reported and skipped. TILES_CONTEXT=N times decode_attention at N
filled positions of its 1024-long cache (W1's mean is 576) instead of all of them."""

import importlib
import json
import os
import sys

import torch
import triton

from optiq.measure.roofline import copy_bandwidth


def main(name: str, out_path: str, rows_list: str = "1,16,64", cases_wanted: str = "") -> None:
    module = importlib.import_module(f"optiq.fusions.{name}")
    heuristic = module.tile_config
    if hasattr(module, "MAX_BLOCK_M"):  # past DECODE_ROWS the fusion hands over to cuBLAS: time the kernel itself
        module.DECODE_ROWS = module.MAX_BLOCK_M
    bandwidth = copy_bandwidth(torch.device("cuda"))  # measured here, as bench_fusions.py does
    results = []
    for rows in map(int, rows_list.split(",")):
        context = {"context": int(os.environ["TILES_CONTEXT"])} if os.environ.get("TILES_CONTEXT") else {}
        cases = module.benchmark_case(rows, torch.bfloat16, torch.device("cuda"), **context)
        for label, case in ([(name, cases)] if "fused" in cases else cases.items()):
            if cases_wanted and not any(part in label for part in cases_wanted.split(",")):
                continue
            for config in [None, *module.TILE_GRID]:
                module.tile_config = heuristic if config is None else (
                    lambda *shape, config=config: {**heuristic(*shape), **config})
                try:
                    ms = triton.testing.do_bench_cudagraph(case["fused"], rep=50, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - e.g. triton's OutOfResources for a too-large tile
                    print(f"{label:28} rows {rows:3d} {str(config):45} skipped: {str(exc).splitlines()[0]}")
                    continue
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
