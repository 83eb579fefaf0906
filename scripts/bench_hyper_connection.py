"""HF's DeepseekV4HyperConnection against optiq's hyper_connection kernels at DeepSeek-V4-Flash's widths (4 streams
of 4096, fn in fp32, streams in bf16), both replayed from CUDA graphs, at 1, 16 and 64 decode tokens: microseconds
per call (median), the fused pair also launched without programmatic dependent launch (PDL), then where each path's
time goes, every kernel of a few graph replays under torch.profiler.

Usage (on a GPU): python scripts/bench_hyper_connection.py OUT.json

OUT.json, per token count: hf_graph_us, fused_us, fused_without_pdl_us, ratio (HF over fused), pdl (whether the fused
path's kernels used it: Hopper and later, unless OPTIQ_PDL=0), and under "kernels" for each of the three ("hf",
"fused", "fused_without_pdl") the activities on the GPU's timeline (kernels, and a memcpy or memset by its name should
a path have one), each with its count per call and mean duration, the longest in total first. Under PDL a fused
kernel starts before its predecessor ends and waits for it, so its duration includes that wait; without, each
duration is the kernel's own.
"""

import contextlib
import json
import os
import sys
from collections import defaultdict

import torch
import transformers
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from optiq.fusions import launch
from optiq.fusions.hyper_connection import hyper_connection
from optiq.patching.structure import EPS_ATTRIBUTES

TOKEN_COUNTS = (1, 16, 64)
PROFILED_REPLAYS = 10


def kernels_of(call) -> list[dict]:
    """The GPU activities of ``call`` captured in a CUDA graph and replayed PROFILED_REPLAYS times: name, count per
    call, mean microseconds. One replay before them is the profiler's warm-up (CUPTI instruments a graph on its
    first launch under it), left out."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=1),
                 acc_events=True) as prof:  # the events kept past the cycle's end, to be read after it
        graph.replay()
        torch.cuda.synchronize()
        prof.step()
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        prof.step()
    durations = defaultdict(list)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            durations[event.name].append(event.time_range.elapsed_us())
    rows = [{"name": name, "per_call": len(times) / PROFILED_REPLAYS, "mean_us": sum(times) / len(times)}
            for name, times in durations.items()]
    return sorted(rows, key=lambda row: -row["per_call"] * row["mean_us"])


@contextlib.contextmanager
def without_pdl():
    """optiq's kernels launched as plain kernels inside (launch.enabled reads OPTIQ_PDL at every call)."""
    before = os.environ.get("OPTIQ_PDL")
    os.environ["OPTIQ_PDL"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OPTIQ_PDL"]
        else:
            os.environ["OPTIQ_PDL"] = before


def main(out_path: str) -> None:
    config = DeepseekV4Config()
    module = DeepseekV4HyperConnection(config).cuda().float()
    # transformers 5.17 names the unweighted norm's epsilon eps, 5.25 variance_epsilon.
    norm_eps = next(getattr(module.input_norm, name) for name in EPS_ATTRIBUTES if hasattr(module.input_norm, name))
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # not initialisation's zeros and ones
        module.fn.normal_(0, 0.02, generator=generator)
        module.base.normal_(0, 0.5, generator=generator)
        module.scale.normal_(1, 0.3, generator=generator)
    results = {"versions": {"torch": torch.__version__, "triton": triton.__version__,
                            "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name()}}
    for tokens in TOKEN_COUNTS:
        streams = torch.randn(tokens, 1, config.hc_mult, config.hidden_size, device="cuda",
                              generator=generator).bfloat16()

        def hf():
            return module(streams)

        def fused():
            return hyper_connection(streams, module.fn, module.base, module.scale, norm_eps, module.hc_eps,
                                    module.hc_sinkhorn_iters)

        timings, kernels = {}, {}
        with torch.no_grad():
            for name, call, launching in (("hf", hf, contextlib.nullcontext), ("fused", fused, contextlib.nullcontext),
                                          ("fused_without_pdl", fused, without_pdl)):
                with launching():
                    timings[name] = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median") * 1e3
                    kernels[name] = kernels_of(call)
        results[tokens] = {"hf_graph_us": timings["hf"], "fused_us": timings["fused"],
                           "fused_without_pdl_us": timings["fused_without_pdl"],
                           "ratio": timings["hf"] / timings["fused"], "pdl": launch.enabled(streams),
                           "kernels": kernels}
        print(tokens, {key: value for key, value in results[tokens].items() if key != "kernels"}, flush=True)
        for name, rows in kernels.items():
            for row in rows:
                print(f"  {name:17} {row['per_call']:5.1f} x {row['mean_us']:7.2f} us  {row['name'][:80]}",
                      flush=True)
    with open(out_path, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
