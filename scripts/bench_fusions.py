"""Microbenchmark each fusion on a GPU against the eager op sequence it replaces and against torch.compile of that
sequence, at decode row counts. Each variant is captured in a CUDA graph and timed by replay
(triton.testing.do_bench_cudagraph, median), as it runs inside a decode step: host launch overhead is out of the
numbers, and inputs stay in L2 when they fit, as activations do inside a step (a case whose weights must come from
HBM, as a layer's do, cycles through copies of them and says "compile": False, since its eager side is one op: its
compile column repeats eager's and its row says compiled: false).
Usage: python scripts/bench_fusions.py OUT.json [FUSION ...]"""

import importlib
import json
import pkgutil
import sys
import traceback

import torch
import triton

import optiq.fusions
from optiq.measure.roofline import copy_bandwidth
from optiq.gate.rules import sorted_by_id

ROWS = (1, 16, 64)


def _flat(result):
    return [t for t in (result if isinstance(result, (tuple, list)) else [result]) if isinstance(t, torch.Tensor)]


def _rel_err(fused, eager) -> float:
    """Largest relative difference over the outputs; top-k pairs compared as sets per row (their order within a row
    is unspecified among equal values)."""
    errors = [((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
              for a, b in zip(sorted_by_id(_flat(fused)), sorted_by_id(_flat(eager)))]
    return max(errors) if errors else float("nan")


def _median_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def _measure(name: str, rows: int, case, bandwidth: float) -> dict:
    """One benchmark case (or the exception that building it raised) timed: fused, eager, compiled eager."""
    row = {"fusion": name, "rows": rows}
    try:
        if isinstance(case, Exception):
            raise case
        row["rel_err_vs_eager"] = _rel_err(case["fused"](), case["eager"]())
        row.update(fused_ms=_median_ms(case["fused"]), eager_ms=_median_ms(case["eager"]), bytes=case["bytes"],
                   flops=case["flops"], compiled=case.get("compile", True))
        if row["compiled"]:
            compiled = torch.compile(case["eager"])
            compiled()
            row["compile_ms"] = _median_ms(compiled)
        else:  # the eager side is one op, which torch.compile leaves as it is
            row["compile_ms"] = row["eager_ms"]
        row["roof_fraction"] = case["bytes"] / (row["fused_ms"] * 1e-3) / bandwidth
        print(f"{name:28} {rows:4d} {row['fused_ms'] * 1e3:9.1f} {row['eager_ms'] * 1e3:9.1f} "
              f"{row['compile_ms'] * 1e3:10.1f} {row['eager_ms'] / row['fused_ms']:8.2f} "
              f"{row['compile_ms'] / row['fused_ms']:9.2f} {100 * row['roof_fraction']:7.1f} "
              f"{row['rel_err_vs_eager']:9.2e}", flush=True)
    except Exception as exc:  # noqa: BLE001 - one broken fusion must not hide the others' numbers
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{name:28} {rows:4d} FAILED {row['error'][:300]}", flush=True)
        traceback.print_exc()
    return row


def main(out_path: str, *names: str) -> None:
    names = names or sorted(m.name for m in pkgutil.iter_modules(optiq.fusions.__path__))
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results = []
    print(f"copy roof {bandwidth / 1e9:,.0f} GB/s")
    print(f"{'fusion':28} {'rows':>4} {'fused us':>9} {'eager us':>9} {'compile us':>10} {'x eager':>8} "
          f"{'x compile':>9} {'% roof':>7} {'rel err':>9}")
    for name in names:
        module = importlib.import_module(f"optiq.fusions.{name}")
        if not hasattr(module, "benchmark_case"):
            continue
        for rows in ROWS:
            try:
                cases = module.benchmark_case(rows, torch.bfloat16, torch.device("cuda"))
            except Exception as exc:  # noqa: BLE001 - one broken fusion must not hide the others' numbers
                cases = {name: exc}
            for label, case in ([(name, cases)] if "fused" in cases else cases.items()):
                results.append(_measure(label, rows, case, bandwidth))
            torch._dynamo.reset()
            json.dump({"bandwidth": bandwidth, "torch": torch.__version__, "triton": triton.__version__,
                       "device": torch.cuda.get_device_name(), "results": results}, open(out_path, "w"), indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
