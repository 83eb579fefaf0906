"""Triton kernels compiled ahead, in other processes, while the gate computes its baselines.

With an empty kernel cache, nearly half of the time to optimized went to Triton's JIT: llama-3.1-8b on the H200 took
32.6 s (patch + gate + capture) cold and 17.7 s with a warm cache, for 25 kernels compiled one after another at
~0.6 s each, as the fused model first met each shape (BENCHMARKS.md, session 9). Which kernels a decode compiles
depends on the shapes of a layer, not on the number of layers or the weights' values, so a copy of the model cut to
one layer of each kind, patched with the same recipes and stepped through the same engines, compiles the same ones.
One process per concurrency does so while the gate runs the unpatched model, and writes them to Triton's on-disk cache
(written atomically), where the gate and the graph captures after it find them. It is best effort: a kernel not there
yet is compiled in place as before, and a process that fails costs nothing but its own time. CUDA only (the
interpreter compiles nothing); ``OPTIQ_COMPILE_AHEAD=0`` turns it off, to measure what it buys.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from optiq.validation import capture_cache_len, decode_cache_len

ENGINE_STEPS = 2  # eager decode steps per engine: the first compiles, the second meets the cache's next length


@dataclass
class Source:
    """What another process needs to rebuild the model's shapes and the workload measured after the gate."""
    model: str  # a preset name or a checkpoint directory (only its config is read)
    dtype: str
    recipes_dirs: tuple[str, ...]
    prompt_len: int
    max_len: int


def one_layer_of_each_kind(config):
    """``config`` (a copy) cut to its first layers up to and including one of each kind: one, or the leading dense
    layers and the first MoE one (DeepSeek's ``first_k_dense_replace``); per-layer lists are cut to match."""
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    layers = text.num_hidden_layers
    keep = min(layers, 1 + (getattr(text, "first_k_dense_replace", None) or 0))
    for name, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) == layers:
            setattr(text, name, value[:keep])
    if isinstance(getattr(text, "mlp_only_layers", None), list):
        text.mlp_only_layers = [i for i in text.mlp_only_layers if i < keep]
    text.num_hidden_layers = keep
    return config


def engines(gate: dict, prompt_len: int, max_len: int) -> list[list[tuple[int, int, int]]]:
    """Per process, the (batch, max_len, prompt_len) of every engine the fused model will first run in: the gate's
    capture step (validation._capture), its end-to-end decodes, then the measured workload's; one process per
    concurrency, the largest first (it also has the capture)."""
    gated = gate["prompt_len"]
    per_batch = [[(c, decode_cache_len(gated, gate["steps"]), gated), (c, max_len, prompt_len)]
                 for c in sorted(gate["concurrencies"], reverse=True)]
    per_batch[0].insert(0, (per_batch[0][0][0], capture_cache_len(gated), gated))
    return per_batch


def compile_in_this_process(source: dict, names: list[str], plan: list[list[int]]) -> None:
    """A child's work: the one-layer model patched with ``names``, one prefill and ENGINE_STEPS eager steps in each
    engine of ``plan``."""
    from optiq.engine import DecodeEngine
    from optiq.models import load_config, random_model, resolve_dtype
    from optiq.patching import apply
    from optiq.recipes import load_catalog

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    catalog = load_catalog(source["recipes_dirs"])
    model = random_model(one_layer_of_each_kind(load_config(source["model"])), resolve_dtype(source["dtype"], device),
                         device)
    patches = apply(model, [catalog[n] for n in names])
    vocab = model.config.get_text_config(decoder=True).vocab_size
    with torch.inference_mode():
        for batch, max_len, prompt_len in plan:
            engine = DecodeEngine(model, batch, max_len)
            patches.attach(engine)
            engine.prefill(torch.randint(0, vocab, (batch, prompt_len)))
            for _ in range(ENGINE_STEPS):
                engine.step()
            patches.detach(engine)
            engine.release()
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Child:
    engines: list[tuple[int, int, int]]
    status: str = "running"  # done, stopped (still compiling when the gate ended) or failed: its last error line
    seconds: float | None = None  # from its start to its end, if it ended by itself


def source(device: torch.device, model: str, dtype: str, recipes_dirs, prompt_len: int,
           max_len: int) -> Source | None:
    """The Source for ``fusing.fuse``, or None where nothing is compiled ahead (module docstring)."""
    if device.type != "cuda" or os.environ.get("OPTIQ_COMPILE_AHEAD", "1") == "0":
        return None
    return Source(model, dtype, tuple(recipes_dirs), prompt_len, max_len)


@contextmanager
def running(to_build: Source, names: list[str], gate: dict):
    """Children compiling ``names``' kernels for the gate ``gate`` (fusing.gate_settings) and the workload, for the
    duration; yields their records (Child), final when the block ends, by which time every child has ended."""
    plan = engines(gate, to_build.prompt_len, to_build.max_len)
    spec = json.dumps({"source": asdict(to_build), "names": names, "started": time.time()})
    children = []
    for part in plan:
        log = tempfile.TemporaryFile()  # its stderr: why it failed, if it does
        process = subprocess.Popen([sys.executable, "-m", "optiq.compile_ahead", spec, json.dumps(part)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        children.append((Child(part), process, log))
    try:
        yield [child for child, _, _ in children]
    finally:
        for child, process, log in children:
            if process.poll() is None:
                process.kill()
                child.status = "stopped"
            seconds, _ = process.communicate()  # the one line it prints last
            if child.status == "running" and process.returncode == 0:
                child.status, child.seconds = "done", float(seconds)
            elif child.status == "running":
                log.seek(0)
                lines = log.read().decode(errors="replace").strip().splitlines() or ["no message"]
                child.status = f"failed: {lines[-1]}"
            log.close()


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    compile_in_this_process(request["source"], request["names"], json.loads(sys.argv[2]))
    print(time.time() - request["started"])
