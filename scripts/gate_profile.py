"""Where the validation gate's seconds go: optiq's gate on a patched preset at the W1 workload's shapes (C=1,16,64,
prompt 512, 64 steps, graph mode) under torch.profiler, each of its decodes in a range of its own (reference,
unpatched or patched, and the concurrency). Prints each range's wall and GPU seconds and the kernels with the most
GPU time. Usage: python scripts/gate_profile.py MODEL RECIPE,... OUT.txt"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import optiq.gate.end_to_end as gate_end_to_end
from optiq.catalog.recipes import load_catalog
from optiq.gate import GatePlan, validate
from optiq.models import load_model
from optiq.patching import apply


def main(model_spec: str, recipes: str, out_path: str) -> None:
    model = load_model(model_spec, torch.bfloat16, torch.device("cuda"))
    catalog = load_catalog()
    patches = apply(model, [catalog[name] for name in recipes.split(",")])
    plain_decode, walls = gate_end_to_end.decode, []

    def decode(model, prompt, steps, forced, changes, mode="eager", dtype=None, against=None):
        kind = "reference" if dtype is not None else "patched" if changes else "unpatched"
        name = f"gate/{kind} C={prompt.shape[0]}"
        started = time.perf_counter()
        with record_function(name):
            result = plain_decode(model, prompt, steps, forced, changes, mode, dtype, against)
            torch.cuda.synchronize()
        walls.append((name, time.perf_counter() - started))
        return result

    gate_end_to_end.decode = decode
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        report = validate(patches, GatePlan((1, 16, 64), steps=64, prompt_len=512, mode="graph"))
    events = prof.key_averages()
    gpu = {e.key: e.device_time_total / 1e6 for e in events if e.key.startswith("gate/")}
    lines = [f"passed {report.passed}; capture {report.capture_seconds:.2f} s, baselines "
             f"{report.baseline_seconds:.2f} s (reference {report.reference_seconds:.2f}); recipes "
             + ", ".join(f"{n} {r.seconds:.2f}" for n, r in report.recipes.items())
             + "; end to end " + ", ".join(f"C={e.concurrency} {e.seconds:.2f}" for e in report.end_to_end)]
    lines += [f"{name:28} wall {wall:7.2f} s   GPU {gpu.get(name, float('nan')):7.2f} s" for name, wall in walls]
    lines.append(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
    open(out_path, "w").write("\n".join(lines))
    print("\n".join(lines[:1 + len(walls)]))


if __name__ == "__main__":
    main(*sys.argv[1:])
