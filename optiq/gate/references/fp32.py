"""A model computing in fp32 (or another dtype) while its weights stay stored in their own: the end-to-end
reference of a half-precision model."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from optiq.gate.references import experts as reference_experts
from optiq.gate.references import split_matmul
from optiq.gate.references.attention import grouped_decode_attention
from optiq.patching.structure import swiglu_experts


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype):
    """The model computes in ``dtype`` while its weights stay stored in their own: each module's parameters are cast
    when it starts and put back when it ends, so one module's cast weights are alive at a time (an fp32 copy of a
    large bf16 model does not fit beside it on one GPU). Computing in fp32 on a GPU, linear layers and MoE experts
    with bf16 weights keep them and take their products from bf16 parts of the activations on the tensor cores
    (``split_matmul``, linear layers only where it is faster than a cast; the experts through ``experts``, which a
    graph captures)."""
    stored: dict[torch.nn.Parameter, torch.Tensor] = {}

    def cast(module, *_):
        for param in module.parameters(recurse=False):
            stored[param], param.data = param.data, param.data.to(dtype)

    def restore(module, *_):
        for param in module.parameters(recurse=False):
            param.data = stored.pop(param)

    def from_parts(module) -> bool:
        weight = next(module.parameters(recurse=False), None)
        return (dtype == torch.float32 and weight is not None and weight.dtype == torch.bfloat16 and weight.is_cuda
                and "forward" not in vars(module))

    split = {m: partial(split_matmul.fp32_linear, weight=m.weight, bias=m.bias) for m in model.modules()
             if type(m) is torch.nn.Linear and from_parts(m)}
    split.update({m: reference_experts.experts_forward(m) for m in model.modules()
                  if from_parts(m) and swiglu_experts(m) is not None})
    owners = [m for m in model.modules() if m not in split and next(m.parameters(recurse=False), None) is not None]
    handles = [h for m in owners for h in (m.register_forward_pre_hook(cast), m.register_forward_hook(restore))]
    for module, forward in split.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in split:
            del module.forward
        for handle in handles:
            handle.remove()
        for param, data in stored.items():  # a forward that raised half-way
            param.data = data


@contextmanager
def as_reference(model: torch.nn.Module, dtype: torch.dtype):
    """The model as the end-to-end reference: computing in ``dtype``, its decode steps' attention grouped by kv head
    (``attention``) rather than HF's sdpa path with its copies of the keys and values."""
    with computing_in(model, dtype), grouped_decode_attention(model):
        yield
