"""Time moe_experts' grouped GEMMs under fixed tile configs against the shape heuristic (_tile_config), at decode
row counts of Qwen3-30B-A3B's MoE layer, on a GPU: which N/K tiles and stages keep HBM busiest with few slots.
Usage: python scripts/moe_tiles.py OUT.json"""

import itertools
import json
import sys

import torch
import triton

import fusions.moe_experts as moe


def main(out_path: str) -> None:
    heuristic = moe._tile_config
    fixed = [dict(BLOCK_N=n, BLOCK_K=k, num_stages=s) for n, k, s in itertools.product((16, 32, 64), (64, 128), (3, 4))]
    results = []
    for rows in (1, 16, 64):
        case = moe.benchmark_case(rows, torch.bfloat16, torch.device("cuda"))
        for config in [None, *fixed]:
            moe._tile_config = heuristic if config is None else (
                lambda slots, experts, n, config=config: {**heuristic(slots, experts, n), **config})
            ms = triton.testing.do_bench_cudagraph(case["fused"], rep=50, return_mode="median")
            roof = case["bytes"] / (ms * 1e-3) / 4.25e12
            results.append({"rows": rows, "config": config or "heuristic", "us": ms * 1e3, "roof": roof})
            print(f"rows {rows:3d} {str(config or 'heuristic'):55} {ms * 1e3:8.1f} us {100 * roof:5.1f}% roof",
                  flush=True)
        moe._tile_config = heuristic
    json.dump(results, open(out_path, "w"), indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
