"""How the kernels are launched: grids sized to the GPU's SMs, and programmatic dependent launch.

Programmatic dependent launch (PDL, Hopper and later) lets the next kernel of a decode step start before this one ends.

A decode step at small batch is a chain of short kernels, and between two of them the GPU idles while the first
drains and the second is launched and spread over the SMs (qwen3-0.6b's C=1 step: 355 kernels, 14% idle in CUDA-graph
replay). Launched with PDL, a kernel's programs may be resident before its predecessor has finished; each one waits
(``griddepcontrol.wait``) until the predecessor has completed and its writes are visible, then lets its own successor
launch. Waiting first, before any load or store, keeps every read-after-write and write-after-read order of the
stream, so the kernels need no other change. A predecessor launched without PDL (cuBLAS, torch's own kernels) just
ends the overlap there: its successor starts when it completes, as without PDL. What it buys alone is in
BENCHMARKS.md (scripts/pdl_ab.py).

Off under the Triton interpreter (it has no such instructions), under torch.compile (its tracing tensors are not
plain ones; it launches kernels its own way and cannot analyse the wait's inline assembly), before Hopper, and with
``OPTIQ_PDL=0`` in the environment (to measure what it buys).
"""

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """SMs to fill on CUDA; elsewhere (the interpreter runs programs one by one) a small number keeps it quick."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=None)
def shared_memory_per_multiprocessor(device: torch.device) -> int:
    """Bytes of shared memory the programs resident on one SM share; elsewhere the H200's 228 KiB, so the interpreter
    takes the tiles a Hopper GPU would."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor
    return 228 * 1024


def enabled(tensor: torch.Tensor) -> bool:
    """Whether a kernel launched on ``tensor`` (a plain CUDA tensor: not one torch.compile traces with) uses PDL."""
    return (type(tensor) is torch.Tensor and tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
            and os.environ.get("OPTIQ_PDL", "1") != "0" and torch.cuda.get_device_capability(tensor.device)[0] >= 9)


def launch_options(tensor: torch.Tensor, programs: int | None = None) -> dict:
    """Keyword arguments for a kernel launched on ``tensor``'s device: the kernel's ``USE_PDL`` and Triton's
    ``launch_pdl``, set together (a kernel launched with PDL must wait for its predecessor). Given its ``programs``,
    a kernel of as many programs as the device has SMs or more launches without PDL: under PDL its programs start
    as soon as its predecessor does and wait on their SMs, holding SMs the predecessor still needs."""
    on = enabled(tensor) and (programs is None or programs < multiprocessor_count(tensor.device))
    return {"USE_PDL": on, "launch_pdl": on} if on else {"USE_PDL": False}


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr):
    """First thing in every kernel: wait until the kernel before has finished and its writes are visible, then let
    the kernel after launch (it waits in turn, so at most two kernels overlap)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
