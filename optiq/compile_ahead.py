"""Triton kernels compiled ahead, in other processes, while the gate computes its baselines.

With an empty kernel cache much of the time to optimized went to Triton's JIT, compiling one kernel after another
as the fused model first met each shape (BENCHMARKS.md, sessions 9 and 10). Which kernels a decode compiles depends
on the shapes of a layer, not on the number of layers or the weights' values, so a copy of the model cut to one
layer of each kind, patched with the same recipes and stepped through the same engines, compiles the same ones.

One worker process per engine the fused model will run in (the gate's, which its plan publishes, then the measured
workload's) starts before the proposals are profiled: it imports, builds that copy and waits for the recipes'
names. Given them, it compiles while the gate runs the unpatched model, and Triton writes the kernels to its on-disk
cache (atomically), where the gate and the graph captures after it find them. It is best effort: a kernel not there
yet is compiled in place, and a worker that fails costs nothing but its own time. While they wait, the workers hold
their CUDA contexts and copies in GPU memory, so none starts when the copies would take more than ``COPIES_SHARE``
of the memory the model left free (DeepSeek-V4-Flash's one layer holds 256 experts, 13 GB: five copies beside its
81 GB did not fit). CUDA only (the interpreter compiles nothing); ``OPTIQ_COMPILE_AHEAD=0`` turns it off, to measure
what it buys.
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
from pathlib import Path

import torch

from optiq.gate.plan import GatePlan
from optiq.record import CompiledAhead

ENGINE_STEPS = 2  # eager decode steps per engine: the first compiles, the second meets the cache's next length
COPIES_SHARE = 0.25  # of the device's free memory, the most the workers' one-layer copies may hold together


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


def engines(plan: GatePlan, prompt_len: int, max_len: int) -> list[tuple[int, int, int]]:
    """The (batch, cache length, prompt length) of every engine the fused model will first run in, in the order it
    does, each once: the gate's (``plan``), then the measured workload's."""
    return list(dict.fromkeys([*plan.engines(), *((c, max_len, prompt_len) for c in plan.concurrencies)]))


def one_layer_model(source: dict) -> tuple[torch.nn.Module, dict]:
    """A worker's preparation: the one-layer copy of ``source``'s model on this process's device, and the catalog."""
    from optiq.models import load_config, random_model, resolve_dtype
    from optiq.catalog.recipes import load_catalog

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(one_layer_of_each_kind(load_config(source["model"])), resolve_dtype(source["dtype"], device),
                         device)
    return model, load_catalog(source["recipes_dirs"])


def copy_bytes(source: Source) -> int:
    """The parameter bytes of one worker's one-layer copy, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    from optiq.models import load_config, resolve_dtype

    config = one_layer_of_each_kind(load_config(source.model))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(source.dtype, torch.device("meta")))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def compile_engine(model: torch.nn.Module, catalog: dict, names: list[str], engine: tuple[int, int, int]) -> None:
    """A worker's work: ``model`` patched with ``names``, one prefill and ENGINE_STEPS eager steps in ``engine``."""
    from optiq.engine import opened
    from optiq.patching import apply

    batch, max_len, prompt_len = engine
    apply(model, [catalog[n] for n in names])
    vocab = model.config.get_text_config(decoder=True).vocab_size
    with torch.inference_mode(), opened(model, batch, max_len) as decode:
        decode.prefill(torch.randint(0, vocab, (batch, prompt_len)))
        for _ in range(ENGINE_STEPS):
            decode.step()
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def _same_optiq() -> dict[str, str]:
    """The environment of a worker that imports this very optiq: the folder holding it first on its path, and not
    the working directory (``-P``), where a folder of the same name would take its place."""
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


class _Worker:
    """One worker process, started at once. It prints the time when it is ready, waits for the names on its stdin
    (EOF, when this process is gone: it exits unused), and prints the time when it has compiled."""

    def __init__(self, source: Source, engine: tuple[int, int, int]):
        self.child = CompiledAhead(list(engine))
        self.started = self.sent = time.time()
        self.log = tempfile.TemporaryFile()  # its stderr: why it failed, if it does
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "optiq.compile_ahead", json.dumps(asdict(source)), json.dumps(engine)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=_same_optiq())

    def send(self, names: list[str]) -> None:
        self.sent = time.time()
        self.child.sent_s = self.sent - self.started
        try:
            self.process.stdin.write((json.dumps(names) + "\n").encode())
            self.process.stdin.flush()  # (communicate closes it)
        except OSError:  # it has died already; end() says why
            pass

    def end(self) -> None:
        """Stop it if still running, then record how it ended."""
        running = self.process.poll() is None
        if running:
            self.process.kill()
        printed, _ = self.process.communicate()
        times = [float(t) for t in printed.split()]
        if times:
            self.child.ready_s = times[0] - self.started
        if len(times) == 2:
            self.child.status, self.child.seconds = "done", times[1] - self.sent
        elif running:
            self.child.status = "stopped"
        else:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines() or ["no message"]
            self.child.status = f"failed: {lines[-1]}"
        self.log.close()


class Workers:
    """One waiting worker per engine of the gate's ``plan`` and of the workload in ``source``."""

    def __init__(self, source: Source, plan: GatePlan):
        self.source, self.plan = source, engines(plan, source.prompt_len, source.max_len)
        self.waiting = self._start()

    def _start(self) -> list[_Worker]:
        return [_Worker(self.source, e) for e in self.plan]

    @contextmanager
    def compiling(self, names: list[str]):
        """The workers compiling ``names``' kernels for the duration (new ones if the waiting ones were used by an
        earlier round); yields their records, final when the block ends, by which time every one has ended."""
        working = self.waiting or self._start()
        self.waiting = []
        for worker in working:
            worker.send(names)
        try:
            yield [worker.child for worker in working]
        finally:
            for worker in working:
                worker.end()

    def close(self) -> None:
        """Stop the workers never given names."""
        for worker in self.waiting:
            worker.end()
        self.waiting = []


@contextmanager
def workers(device: torch.device, source: Source, plan: GatePlan, note=lambda line: None):
    """For ``workflow.fuse(ahead=)``, the workers for ``source``'s model and workload and the gate's ``plan`` for the
    duration, or None where nothing is compiled ahead (module docstring: ``note(line)`` says why when the copies
    would not fit); those still running when the block ends are stopped."""
    if device.type != "cuda" or os.environ.get("OPTIQ_COMPILE_AHEAD", "1") == "0":
        yield None
        return
    count = len(engines(plan, source.prompt_len, source.max_len))
    needed, free = count * copy_bytes(source), torch.cuda.mem_get_info(device)[0]
    if needed > COPIES_SHARE * free:
        note(f"kernels not compiled ahead: {count} one-layer copies of the model would hold {needed / 1e9:.1f} GB, "
             f"more than {COPIES_SHARE:.0%} of the {free / 1e9:.1f} GB free")
        yield None
        return
    pool = Workers(source, plan)
    try:
        yield pool
    finally:
        pool.close()


if __name__ == "__main__":
    model, catalog = one_layer_model(json.loads(sys.argv[1]))
    print(time.time(), flush=True)
    line = sys.stdin.readline()
    if line:
        compile_engine(model, catalog, json.loads(line), tuple(json.loads(sys.argv[2])))
        print(time.time())
