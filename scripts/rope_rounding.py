"""Which rounding does the rope kernel do on the GPU? (Device diagnostic for the rope/HF mismatch seen on the H200.)

Runs the fused rope and HF's eager formula on the same bf16/fp16 inputs (llama-3.1-8b shapes, C=64) and compares the
kernel's q with candidate roundings of q1*cos - q2*sin: each product rounded then the difference rounded (HF), one
product unrounded (an FMA), nothing rounded but the result. Prints, per dtype, the share of elements that differ
from HF and which candidate the kernel matches bit for bit.
"""

import torch

from fusions.rope import _rope_eager, rope


def candidates(q, cos, sin):
    half = q.shape[-1] // 2
    x1, x2 = q[..., :half].float(), q[..., half:].float()
    c, s = cos.unsqueeze(1)[..., :half].float(), sin.unsqueeze(1)[..., :half].float()
    dt = q.dtype

    def r(t):
        return t.to(dt).float()

    return {"hf (round each product)": (r(x1 * c) - r(x2 * s)).to(dt),
            "fma (x1*cos unrounded)": (x1 * c - r(x2 * s)).to(dt),
            "fma (x2*sin unrounded)": (r(x1 * c) - x2 * s).to(dt),
            "round once": (x1.double() * c.double() - x2.double() * s.double()).to(dt)}


inference = torch.inference_mode()  # torch 2.11 fails the in-place op with its trailing optional args None otherwise
inference.__enter__()
for dtype in (torch.bfloat16, torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(64, 32, 1, 128, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(64, 8, 1, 128, generator=gen, device="cuda", dtype=dtype)
    angles = torch.rand(64, 1, 64, generator=gen, device="cuda") * 100
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want, _ = _rope_eager(q, k, cos, sin, None, None, 1e-6)
    got, _ = rope(q.clone(), k.clone(), cos, sin, None, None, 1e-6)
    print(f"{dtype}: kernel differs from HF eager at {(got != want).float().mean().item():.2%} of q's elements")
    first = got[..., :64]
    for name, value in candidates(q, cos, sin).items():
        print(f"  first half vs {name}: {(first != value).float().mean().item():.2%} differ")
