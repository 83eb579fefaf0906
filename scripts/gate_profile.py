"""Where the validation gate's seconds go: cProfile of optiq's gate on a patched preset at the W1 workload's shapes
(C=1,16,64, prompt 512, 64 steps, graph mode), top entries by cumulative time. The profiler slows Python, so read
the shares, not the totals. Usage: python scripts/gate_profile.py MODEL RECIPE,... OUT.txt"""

import cProfile
import io
import pstats
import sys

import torch

from optiq.models import load_model
from optiq.patching import apply
from optiq.recipes import load_catalog
from optiq.validation import validate


def main(model_spec: str, recipes: str, out_path: str) -> None:
    model = load_model(model_spec, torch.bfloat16, torch.device("cuda"))
    catalog = load_catalog()
    patches = apply(model, [catalog[name] for name in recipes.split(",")])
    profiler = cProfile.Profile()
    report = profiler.runcall(validate, patches, concurrencies=(1, 16, 64), steps=64, prompt_len=512, mode="graph")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(60)
    summary = (f"passed {report.passed}; capture {report.capture_seconds:.2f} s, baselines {report.baseline_seconds:.2f}"
               f" s (reference {report.reference_seconds:.2f}), recipes "
               + ", ".join(f"{n} {r.seconds:.2f}" for n, r in report.recipes.items())
               + "; end to end " + ", ".join(f"C={e.concurrency} {e.seconds:.2f}" for e in report.end_to_end))
    open(out_path, "w").write(summary + "\n" + text.getvalue())
    print(summary)


if __name__ == "__main__":
    main(*sys.argv[1:])
