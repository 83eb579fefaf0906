"""The activations of gated MLPs, for the kernels that fuse them: ``silu`` (SwiGLU: Llama, Qwen, Mistral, Phi-3) and
``gelu_tanh`` (GeGLU with the tanh approximation: Gemma), as ``silu(x) = x * sigmoid(x)`` and
``gelu_tanh(x) = 0.5 x (1 + tanh(z)) = x * sigmoid(2 z)``, ``z = sqrt(2 / pi) (x + 0.044715 x^3)``."""

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def gated_activation(x, KIND: tl.constexpr):
    """ACTIVATIONS[KIND] of fp32 ``x``."""
    if KIND == 0:
        return x * tl.sigmoid(x)
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2 sqrt(2 / pi)


def activation_index(name: str) -> int:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {name!r}")
    return ACTIVATIONS.index(name)


def activation_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """What HF's modules compute: F.silu, or F.gelu(approximate="tanh")."""
    activation_index(name)
    return torch.nn.functional.silu(x) if name == "silu" else torch.nn.functional.gelu(x, approximate="tanh")
