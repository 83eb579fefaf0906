"""How the kernels are launched: grids sized to the GPU's SMs, and programmatic dependent launch.

Programmatic dependent launch (PDL, Hopper and later) lets the next kernel of a decode step start before this one ends.

A decode step at small batch is a chain of short kernels, and between two of them the GPU idles while the first
drains and the second is launched and spread over the SMs (qwen3-0.6b's C=1 step: 355 kernels, 14% idle in CUDA-graph
replay). Launched with PDL, a kernel's programs may be resident before its predecessor has finished; each one waits
(``griddepcontrol.wait``) until the predecessor has completed and its writes are visible, then lets its own successor
launch. Waiting first, before any load or store, keeps every read-after-write and write-after-read order of the
stream, so the kernels need no other change. A predecessor launched without PDL (cuBLAS, torch's own kernels) just
ends the overlap there: its successor starts when it completes, as without PDL. What it buys alone is in
BENCHMARKS.md (scripts/knob_ab.py).

Before it waits, a kernel may already ask L2 for the data it will read first (``prefetch_rows``): a decode GEMM's
weight rows, decode attention's cached keys and values. HBM then keeps streaming across the boundary between two
kernels instead of idling through the next kernel's first loads (a GEMM a few microseconds long spends one or two of
them on that ramp). A prefetch is a hint that loads nothing into registers: L2 is where every SM's writes land, so
asking it for a line the predecessor is still writing is safe, only wasted.

Off under the Triton interpreter (it has no such instructions), under torch.compile (its tracing tensors are not
plain ones; it launches kernels its own way and cannot analyse the wait's inline assembly), before Hopper, and with
``OPTIQ_PDL=0`` in the environment (to measure what it buys).
"""

import functools
import os

import torch
import triton
import triton.language as tl


PREFETCH_KB = 32  # weight bytes a program asks L2 for before it waits (prefetch_options; 64 and 128 measured slower)
PREFETCH_LINE_BYTES = 128  # an L2 cache line


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


def prefetch_options(launch: dict, rows: int, k: int, itemsize: int) -> dict:
    """``PREFETCH_LINES`` and ``LINE`` for a kernel whose programs each stream ``rows`` weight rows of ``k``
    elements: the cache lines of each row's start to ask L2 for before waiting, about ``OPTIQ_PREFETCH_KB`` (default
    PREFETCH_KB) a program, a power of two of them and no more than the row holds; none without PDL (nothing to
    overlap, and the interpreter has no prefetch instruction). ``OPTIQ_PREFETCH_KB=0`` turns it off, to measure it."""
    line = PREFETCH_LINE_BYTES // itemsize
    budget = int(os.environ.get("OPTIQ_PREFETCH_KB", PREFETCH_KB)) * 1024 // (PREFETCH_LINE_BYTES * rows)
    lines = min(triton.next_power_of_2(budget + 1) // 2, triton.next_power_of_2(triton.cdiv(k, line)))
    return {"PREFETCH_LINES": lines if launch["USE_PDL"] else 0, "LINE": line}


@triton.jit
def prefetch_rows(w_ptr, w_rows, W_ROWS, K, stride_wn, stride_wk, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first PREFETCH_LINES cache lines (LINE elements each) of rows ``w_rows`` of a matrix [W_ROWS,
    K]: no registers held, no wait, nothing for rows or lines past it (those addresses fold onto its first line).
    Issued before ``wait_for_predecessor``, it overlaps the predecessor's tail."""
    if PREFETCH_LINES > 0:
        offs = tl.arange(0, PREFETCH_LINES) * LINE
        ptrs = w_ptr + w_rows[:, None].to(tl.int64) * stride_wn + offs[None, :] * stride_wk
        ptrs = tl.where((w_rows[:, None] < W_ROWS) & (offs[None, :] < K), ptrs, w_ptr)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr):
    """In every kernel before its first load (prefetches aside) or store: wait until the kernel before has finished
    and its writes are visible, then let the kernel after launch (it waits in turn, so at most two kernels
    overlap)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
