"""HF's DeepseekV4HyperConnection against optiq's hyper_connection kernels at DeepSeek-V4-Flash's widths (4 streams
of 4096, fn in fp32, streams in bf16), both replayed from CUDA graphs, at 1, 16 and 64 decode tokens; microseconds
per call, median. Usage (on a GPU): python scripts/bench_hyper_connection.py OUT.json"""

import json
import sys

import torch
import triton
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from optiq.fusions.hyper_connection import hyper_connection


def main(out_path: str) -> None:
    config = DeepseekV4Config()
    module = DeepseekV4HyperConnection(config).cuda().float()
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # not initialisation's zeros and ones
        module.fn.normal_(0, 0.02, generator=generator)
        module.base.normal_(0, 0.5, generator=generator)
        module.scale.normal_(1, 0.3, generator=generator)
    results = {}
    for tokens in (1, 16, 64):
        streams = torch.randn(tokens, 1, config.hc_mult, config.hidden_size, device="cuda",
                              generator=generator).bfloat16()
        with torch.no_grad():
            hf = triton.testing.do_bench_cudagraph(lambda: module(streams), rep=200, return_mode="median")
            fused = triton.testing.do_bench_cudagraph(
                lambda: hyper_connection(streams, module.fn, module.base, module.scale, module.input_norm.eps,
                                         module.hc_eps, module.hc_sinkhorn_iters), rep=200, return_mode="median")
        results[tokens] = {"hf_graph_us": hf * 1e3, "fused_us": fused * 1e3, "ratio": hf / fused}
        print(tokens, results[tokens], flush=True)
    json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
