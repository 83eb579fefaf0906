"""Rounding fp32 values to a narrower float as the model's own ops round them, inside a kernel.

A fused kernel that must compare or combine the values an unfused model would have stored (a router's scores, an
operand flipped to bf16) rounds them itself: to nearest, ties to even, as the GPU converts. The Triton interpreter's
fp32 -> bf16 conversion truncates instead, so for bf16 the rounding is done on fp32's bits, the same on both.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (to nearest, ties to even) and returned as fp32."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)
