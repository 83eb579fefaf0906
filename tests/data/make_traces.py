"""The tiny annotated model behind the test traces: real GPU traces captured once on an H200 (kept here, gzipped) and
CPU traces the tests capture themselves.

A 2-layer Llama-shaped model with seeded random bf16 weights decodes a few steps at batch 4, annotated the way
``optiq profile`` annotates (optiq/step, optiq/layer, optiq/role), three ways:
``gpu_eager.json.gz`` (eager steps), ``gpu_graph.json.gz`` (the same step replayed from one CUDA graph: the eager
companion of the other) and ``gpu_compiled.json.gz`` (torch.compile'd forward, for Inductor kernel names).

    python tests/data/make_traces.py OUT_DIR     # on a CUDA machine: the three GPU traces
"""

from __future__ import annotations

import copy
import gzip
import shutil
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

BATCH, PROMPT, MAX_LEN, STEPS = 4, 16, 64, 3
ROLE_OF_CHILD = {"embed_tokens": "embed", "input_layernorm": "norm", "post_attention_layernorm": "norm",
                 "norm": "norm", "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "o_proj": "o_proj", "self_attn": "attention", "mlp": "mlp", "rotary_emb": "rope",
                 "lm_head": "lm_head"}


def annotate(model: torch.nn.Module) -> None:
    """Wrap each decoder layer and each role module in a record_function range, entered and left by hooks."""
    def wrap(module, name):
        ranges = []
        module.register_forward_pre_hook(lambda *_: ranges.append(record_function(name).__enter__()))
        module.register_forward_hook(lambda *_: ranges.pop().__exit__(None, None, None))

    for i, layer in enumerate(model.model.layers):
        wrap(layer, f"optiq/layer/{i}")
    for name, module in model.named_modules():
        role = ROLE_OF_CHILD.get(name.rsplit(".", 1)[-1])
        if role:
            wrap(module, f"optiq/role/{role}")


def tiny_llama(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def cpu_trace(path: Path, steps: int = 2) -> Path:
    """Profile ``steps`` annotated decode steps of the tiny model on the CPU (no cache: a CPU-only trace has no GPU
    events, which is what the tests need) and export the trace to ``path``."""
    model = tiny_llama("cpu", torch.float32)
    annotate(model)
    tokens = torch.randint(0, model.config.vocab_size, (2, 4))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for n in range(steps):
            with record_function(f"optiq/step/{n}"):
                logits = model(input_ids=tokens, use_cache=False).logits[:, -1]
                with record_function("optiq/role/sampling"):
                    tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    prof.export_chrome_trace(str(path))
    return path


def main(out_dir: Path) -> None:
    model = tiny_llama("cuda", torch.bfloat16)
    config = model.config
    plain = copy.deepcopy(model)  # dynamo cannot trace the annotation hooks; Inductor's kernel names are the point
    annotate(model)
    cache_kw = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
    cache = StaticCache(config=config, max_cache_len=MAX_LEN)
    tokens = torch.randint(0, config.vocab_size, (BATCH, PROMPT), device="cuda")
    positions = torch.zeros(BATCH, 1, dtype=torch.long, device="cuda")

    def forward_of(fn):
        def step():
            logits = fn(input_ids=tokens[:, -1:], position_ids=positions, use_cache=True, logits_to_keep=1,
                        **{cache_kw: cache}).logits[:, -1]
            with record_function("optiq/role/sampling"):
                tokens[:, -1:].copy_(logits.argmax(-1, keepdim=True))
            positions.add_(1)
        return step

    def record(path: Path, run_step) -> None:
        positions.fill_(PROMPT)
        for layer in cache.layers:
            if getattr(layer, "cumulative_length", None) is not None:
                layer.cumulative_length.fill_(PROMPT)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for n in range(STEPS):
                with record_function(f"optiq/step/{n}"):
                    run_step()
            torch.cuda.synchronize()
        raw = path.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()

    with torch.inference_mode():
        model(input_ids=tokens, position_ids=torch.arange(PROMPT, device="cuda").expand(BATCH, PROMPT),
              use_cache=True, **{cache_kw: cache})
        eager = forward_of(model)
        for _ in range(3):
            eager()
        record(out_dir / "gpu_eager.json.gz", eager)

        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            eager()
        record(out_dir / "gpu_graph.json.gz", graph.replay)

        compiled = forward_of(torch.compile(plain))
        for _ in range(3):
            compiled()
        record(out_dir / "gpu_compiled.json.gz", compiled)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
