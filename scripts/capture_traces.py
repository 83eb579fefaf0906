"""Capture eager and graph decode traces of presets on a GPU (until `optiq profile` lands, this is how the traces in
traces/ are made). Usage: python scripts/capture_traces.py OUTDIR MODEL C1,C2 [eager,graph]"""

import sys
import time
from pathlib import Path

import torch

from optiq.models import load_model
from optiq.profiling.capture import capture


def main(outdir: str, model_spec: str, concurrencies: str, modes: str = "eager,graph") -> None:
    model = load_model(model_spec, torch.bfloat16, torch.device("cuda"))
    for batch in (int(c) for c in concurrencies.split(",")):
        for mode in modes.split(","):
            path = Path(outdir) / f"{model_spec}_{mode}_C{batch}.json.gz"
            t0 = time.perf_counter()
            try:
                capture(model, batch, prompt_len=512, max_len=1024, mode=mode, path=path)
                print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other traces
                print(f"{path.name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
