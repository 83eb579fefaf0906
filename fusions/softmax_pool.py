"""Softmax-weighted pooling over slots in one launch: ``sum_s values[b, s] * softmax_s(gates[b, s])``, per feature.

A compressing attention (DeepSeek-V4's compressors) pools each window of positions into one entry this way: a gate
per position and feature, a softmax over the window's positions, a weighted sum. Eager code runs it as a transposed
copy, the softmax, a cast of the weights, the product and the sum over the window, five kernels a pooled entry; here
it is one, each program holding every slot of a block of features. ``softmax_pool_window`` also reads the window's
slots from the per-position buffers by itself (DeepSeek-V4's CSA overlap included), where eager code gathers them
first: two to six gathers, masked fills and concatenations a compressor fewer. The roundings are eager's: the softmax
in fp32, the weights and each product rounded to the values' dtype, the sum rounded once; the two sums over the slots
are accumulated in fp64, so that their order costs nothing (a 128-slot window summed in fp32 in the Triton
interpreter's order was ~6x further from float64 than eager's sum, and the gate rolled the recipe back for it).
"""

import torch
import triton
import triton.language as tl

from optiq.fusions.launch import launch_options, wait_for_predecessor

MAX_SLOTS = 1024  # slots a program holds at once (DeepSeek-V4's heavily compressed windows are 128)


@triton.jit
def _softmax_pool_kernel(
    values_ptr, gates_ptr, positions_ptr, out_ptr, slots, features, rate, overlap,
    values_stride_b, values_stride_s, gates_stride_b, gates_stride_s, out_stride_b,
    BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr, GATHER: tl.constexpr, OVERLAP: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One (row, block of features): the softmax over every slot of the row's gates, then the weighted sum.

    The slots are the row's first ``slots`` positions, or (GATHER) the ``rate`` positions of the window holding
    positions[row]; with OVERLAP, the previous window's first ``overlap`` features come first (none before the first
    window: they weigh nothing), then this window's features from ``overlap`` on."""
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_s = tl.arange(0, BLOCK_S)
    in_slots = offs_s < slots
    source = offs_s.to(tl.int64)
    feature_start = tl.zeros([BLOCK_S], dtype=tl.int64)
    if GATHER:
        start = tl.load(positions_ptr + row).to(tl.int64) // rate * rate
        source += start
        if OVERLAP:
            source -= rate  # the first rate slots are the previous window's: none before the first window
            feature_start = tl.where(offs_s >= rate, overlap, 0).to(tl.int64)
            in_slots = in_slots & (source >= 0)
            source = tl.where(in_slots, source, 0)
    mask = in_slots[:, None] & (cols[None, :] < features)
    features_at = feature_start[:, None] + cols[None, :]
    gates = tl.load(gates_ptr + row * gates_stride_b + source[:, None] * gates_stride_s + features_at, mask=mask,
                    other=0.0).to(tl.float32)
    gates = tl.where(in_slots[:, None], gates, float("-inf"))  # a slot past the window weighs nothing
    exponentials = tl.exp(gates - tl.max(gates, axis=0)[None, :])
    dtype: tl.constexpr = values_ptr.dtype.element_ty
    total = tl.sum(exponentials.to(tl.float64), axis=0).to(tl.float32)
    weights = (exponentials / total[None, :]).to(dtype).to(tl.float32)
    values = tl.load(values_ptr + row * values_stride_b + source[:, None] * values_stride_s + features_at,
                     mask=mask, other=0.0).to(tl.float32)
    pooled = tl.sum((values * weights).to(dtype).to(tl.float32).to(tl.float64), axis=0)
    tl.store(out_ptr + row * out_stride_b + cols, pooled.to(tl.float32).to(out_ptr.dtype.element_ty),
             mask=cols < features)


def tile_config(slots: int, features: int) -> dict:
    """Every slot in one tile (the softmax needs them all), and as many features as keep the tile near 2K elements
    (16 a thread at 4 warps), at most 128, so that one row's features still spread over several programs."""
    block_s = triton.next_power_of_2(slots)
    block_f = max(16, min(triton.next_power_of_2(features), 2048 // block_s, 128))
    return dict(BLOCK_S=block_s, BLOCK_F=block_f, num_warps=4)


def _launch(values: torch.Tensor, gates: torch.Tensor, positions: torch.Tensor | None, slots: int, features: int,
            rate: int, overlap: int) -> torch.Tensor:
    rows = values.shape[0]
    out = torch.empty((rows, features), dtype=values.dtype, device=values.device)
    config = tile_config(slots, features)
    torch.library.wrap_triton(_softmax_pool_kernel)[(rows, triton.cdiv(features, config["BLOCK_F"]))](
        values, gates, positions if positions is not None else out, out, slots, features, rate, overlap,
        values.stride(0), values.stride(1), gates.stride(0), gates.stride(1), out.stride(0),
        GATHER=positions is not None, OVERLAP=overlap > 0, **config, **launch_options(values),
    )
    return out


@torch.library.triton_op("optiq::softmax_pool", mutates_args=())
def _softmax_pool_op(values: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    return _launch(values, gates, None, values.shape[1], values.shape[2], 0, 0)


@torch.library.triton_op("optiq::softmax_pool_window", mutates_args=())
def _softmax_pool_window_op(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rate: int,
                            overlap: int) -> torch.Tensor:
    return _launch(kv, gate, positions, 2 * rate if overlap else rate, kv.shape[2] - overlap, rate, overlap)


def _check_features(*tensors: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the features must be the innermost, unit-stride axis")


def softmax_pool(values: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """values [B, S, F] (any dtype) weighted by the softmax over S of gates [B, S, F] (fp32 or the values' dtype),
    summed over S: [B, F] in the values' dtype."""
    if values.ndim != 3 or gates.shape != values.shape:
        raise ValueError(f"values {tuple(values.shape)} and gates {tuple(gates.shape)} are not both [B, S, F]")
    if values.shape[1] > MAX_SLOTS:
        raise ValueError(f"{values.shape[1]} slots: at most {MAX_SLOTS} are pooled at once")
    _check_features(values, gates)
    return torch.ops.optiq.softmax_pool(values, gates)


def softmax_pool_window(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rate: int,
                        overlap: int = 0) -> torch.Tensor:
    """The pooled entry of the window of ``rate`` positions holding positions[b], read from the per-position buffers
    kv and gate [B, L, W] themselves (no gathered copy): [B, W] in kv's dtype, or with ``overlap`` (DeepSeek-V4's
    CSA: W = 2 overlap) [B, overlap] pooled over 2 rate slots, the previous window's first ``overlap`` features then
    this window's last ones (none before the first window): the gathers eager code makes first (optiq's static
    DeepSeek-V4 cache, ``optiq.decode_caches.deepseek_v4:pool_position``), then ``softmax_pool`` of them."""
    if kv.ndim != 3 or gate.shape != kv.shape or positions.shape != kv.shape[:1]:
        raise ValueError(f"kv {tuple(kv.shape)}, gate {tuple(gate.shape)} and positions {tuple(positions.shape)} "
                         f"are not [B, L, W], [B, L, W] and [B]")
    if rate < 1 or (2 * rate if overlap else rate) > MAX_SLOTS or overlap and kv.shape[2] != 2 * overlap:
        raise ValueError(f"a window of {rate} positions with an overlap of {overlap} features does not fit "
                         f"{kv.shape[2]} features and at most {MAX_SLOTS} slots")
    _check_features(kv, gate)
    return torch.ops.optiq.softmax_pool_window(kv, gate, positions, rate, overlap)


def softmax_pool_reference(values: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Eager: the softmax over the slots in fp32 (or wider), the weights in the values' dtype, the product, the sum."""
    weights = gates.softmax(dim=1, dtype=torch.promote_types(gates.dtype, torch.float32)).to(values.dtype)
    return (values * weights).sum(dim=1)


POOLS = {  # (slots, features) of the windows a DeepSeek-V4-Flash step pools
    "deepseek-v4-flash csa": (8, 512),  # a CSA window with the previous window's overlap
    "deepseek-v4-flash hca": (128, 512),
    "deepseek-v4-flash indexer": (8, 128),  # the CSA indexer's keys
}


def benchmark_case(rows: int, dtype: torch.dtype, device) -> dict:
    """DeepSeek-V4-Flash's pooled entries at ``rows`` decode tokens: values in the model's dtype, fp32 gates (its
    position bias is fp32)."""
    generator = torch.Generator(device=device).manual_seed(rows)
    cases = {}
    for label, (slots, features) in POOLS.items():
        values = torch.randn(rows, slots, features, device=device, dtype=dtype, generator=generator)
        gates = torch.randn(rows, slots, features, device=device, dtype=torch.float32, generator=generator)
        cases[f"softmax_pool {label}"] = {
            "fused": lambda values=values, gates=gates: softmax_pool(values, gates),
            "eager": lambda values=values, gates=gates: softmax_pool_reference(values, gates),
            "bytes": values.numel() * values.element_size() + gates.numel() * 4 + rows * features * dtype.itemsize,
            "flops": 4 * values.numel(),
        }
    return cases
