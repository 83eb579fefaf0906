"""Op classes: what a GPU kernel does, in the terms a fusion recipe matches (copy_, mul, attention, norm, ...).

A kernel's class comes from the aten op that launched it when the trace links them, else from the kernel's own name:
ATen kernels carry their functor (``direct_copy_kernel_cuda``, ``MulFunctor``), vendor kernels their purpose
(``nvjet``, ``flash_fwd``, ``rms_norm``), and Inductor kernels (``triton_poi_fused__to_copy_mul_3``) list the aten ops
they fused. Classification works on distinct names, so it runs once per name, not once per kernel.

Every pattern runs in time linear in the name (names come from traces, and a hostile one can be megabytes): no
pattern retries an unbounded scan from each start position; "A, later B on the line" is written with an atomic group
that commits to the line's first A.
"""

from __future__ import annotations

import re
from functools import lru_cache

CLASSES = ("copy_", "mul", "add", "clamp_min", "elementwise", "reduction", "bmm", "gemm", "attention", "norm", "rope",
           "activation", "grouped_gemm", "routing", "scatter_gather", "sampling", "collective", "memcpy/memset",
           "other")
UNATTRIBUTED = "unattributed"  # GPU time that neither linkage, alignment nor the kernel name could place

# Exact aten op names (without the "aten::" namespace and the in-place/out "_" suffix) -> class.
_ATEN = {
    **dict.fromkeys(("copy", "_to_copy", "to", "clone", "contiguous", "cat", "index_copy", "index_put", "repeat",
                     "repeat_interleave", "slice_scatter", "_copy_from", "_copy_from_and_resize", "_index_put_impl",
                     "stack",
                     "constant_pad_nd", "narrow_copy", "expand_copy", "view_copy", "_unsafe_index_put"), "copy_"),
    **dict.fromkeys(("mul", "multiply"), "mul"),
    **dict.fromkeys(("add", "addcmul", "addcdiv"), "add"),
    **dict.fromkeys(("clamp_min",), "clamp_min"),
    **dict.fromkeys(("sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "linalg_vector_norm", "softmax",
                     "_softmax", "log_softmax", "_log_softmax", "logsumexp", "cumsum", "var", "std", "all", "any"),
                    "reduction"),
    **dict.fromkeys(("bmm", "baddbmm"), "bmm"),
    **dict.fromkeys(("mm", "addmm", "matmul", "linear", "_scaled_mm", "addmv", "mv", "dot", "einsum",
                     "_int_mm", "_weight_int4pack_mm", "_weight_int8pack_mm"), "gemm"),
    **dict.fromkeys(("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                     "_efficient_attention_forward", "_cudnn_attention_forward", "_fused_sdp_choice",
                     "_scaled_dot_product_attention_math"), "attention"),
    **dict.fromkeys(("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                     "native_group_norm", "batch_norm", "native_batch_norm"), "norm"),
    **dict.fromkeys(("silu", "gelu", "relu", "sigmoid", "tanh", "softplus", "hardswish", "mish", "glu", "elu",
                     "leaky_relu"), "activation"),
    # MoE: the experts' GEMMs, the router's top-k, and packing tokens per expert and back (sort, count, move)
    **dict.fromkeys(("_grouped_mm", "grouped_mm"), "grouped_gemm"),
    **dict.fromkeys(("topk",), "routing"),
    **dict.fromkeys(("sort", "argsort", "scatter", "scatter_add", "scatter_reduce", "gather", "index_add", "bincount",
                     "histc"), "scatter_gather"),
    **dict.fromkeys(("argmax", "argmin", "multinomial", "exponential", "uniform", "bernoulli"), "sampling"),
    **dict.fromkeys(("neg", "pow", "rsqrt", "sqrt", "exp", "log", "div", "sub", "where", "fill", "zero", "eq", "ne",
                     "lt", "le", "gt", "ge", "cos", "sin", "arange", "masked_fill", "bitwise_and", "bitwise_or",
                     "bitwise_not", "logical_and", "logical_or", "logical_not", "abs", "reciprocal", "maximum",
                     "minimum", "clamp", "clamp_max", "floor", "ceil", "round", "sign", "erf", "lerp", "remainder",
                     "fmod", "ones_like", "zeros_like", "full", "ones", "zeros", "triu", "tril", "isnan", "isinf",
                     "nan_to_num", "rsub", "square", "exp2", "log2", "sigmoid_backward"), "elementwise"),
}

# Kernel (or vendor op) names: the first pattern that matches wins, so specific names precede generic ones.
# The serving engines' kernels come first (see tests/data/engine_traces.py for where each name is from): collectives
# (NCCL's, vLLM's and SGLang's custom all-reduce, FlashInfer's fused all-reduce) are time waiting on other ranks, not
# compute; FlashInfer's norms, activations, rotary and samplers carry "flashinfer" in their name, which the attention
# pattern would otherwise take; vLLM's KV-cache write ``reshape_and_cache_flash`` is a copy, not attention.
_KERNEL_PATTERNS = [(re.compile(p, re.IGNORECASE), c) for p, c in [
    (r"^memcpy|^memset|cudaMemcpy|cudaMemset", "memcpy/memset"),
    (r"nccl|cross_device_reduce|cross_device_all_gather|allreduce|all_reduce|all_gather|allgather|reduce_scatter|"
     r"alltoall|all_to_all|quickreduce", "collective"),
    (r"reshape_and_cache|concat_and_cache|store_kvcache", "copy_"),
    (r"flashinfer::sampling|samplingfromprob|sampling_from", "sampling"),
    (r"rms_?norm|layer_?norm", "norm"),
    (r"act_and_mul|silu_and_mul|gelu_and_mul|gelu_tanh_and_mul", "activation"),
    (r"rotary_embedding|applyrotary|apply_rope|rotary_emb", "rope"),
    (r"_fwd_(?:grouped_)?kernel_stage[12]", "attention"),  # SGLang's Triton decode attention (two stages)
    (r"flash|fmha|sdpa|attention|attn|paged|mla_|(?:\A|(?<=\n))(?>.*?decode_kernel).*kv|splitkv", "attention"),
    (r"vectorized_gather_kernel", "other"),  # ATen's index_select / embedding row gather
    # top-k sorts its k winners with a bitonic sort; packing tokens by expert sorts them with a radix sort (H200 MoE)
    (r"topk|router|routing|bitonicsort", "routing"),
    (r"moe_align|permute|radixsort|radix_sort|sort_kernel|segmented_sort|scatter|gather_kernel|histogram",
     "scatter_gather"),
    (r"moe|grouped_gemm|grouped_mm|groupproblemshape|ptrarray|expert", "grouped_gemm"),
    (r"catarraybatchedcopy|direct_copy|copy_kernel|index_copy|index_put|_to_copy|copy_device_to_device|"
     r"repeat_interleave|cat_kernel", "copy_"),
    (r"batched|bmm", "bmm"),
    (r"gemm|gemv|nvjet|cutlass|xmma|cublas|_mm_|matmul|(?:\A|(?<=\n))(?>.*?sm\d+_).*tensorop|wgmma|splitk|"
     r"dot_kernel|marlin|scaled_mm", "gemm"),  # Marlin and the scaled_mm family: quantized (int4, fp8) GEMMs
    (r"group_?norm|batch_?norm|_norm_", "norm"),
    (r"rotary|rope", "rope"),
    (r"argmax|argmin|multinomial|sampl|top_p|top_k_|exponential|distribution", "sampling"),
    (r"silu|gelu|relu|sigmoid|tanh|swiglu|act_and_mul|softplus", "activation"),
    (r"clamp_min|clamp_scalar|clampmin", "clamp_min"),
    (r"mulfunctor|mul_kernel|\bmul\b", "mul"),
    (r"(?<!\w)(?>\w*?functor)\w*_add\b|addfunctor|add_kernel", "add"),  # a word with functor, then _add at its end
    (r"reduce_kernel|reduction|softmax|sum_kernel|mean_kernel|norm_kernel|cub::device(reduce|scan)", "reduction"),
    (r"elementwise|functor|pointwise|unrolled|vectorized|fill|where|compare|pow_|rsqrt|neg_|cos_|sin_|exp_|"
     r"arange|index_elementwise", "elementwise"),
]]

_INDUCTOR = re.compile(r"triton_(?P<kind>[a-z]+)_fused_(?P<ops>[^\n]*)\n?")
# Aten op names Inductor writes into fused kernel names; longest first so "_to_copy" wins over "copy".
_FUSED_OPS = sorted({*_ATEN, "expand", "embedding", "_scaled_dot_product_cudnn_attention", "_unsafe_view"},
                    key=len, reverse=True)
_FUSED_OP = re.compile("|".join(re.escape(op) for op in _FUSED_OPS))


def _inductor(name: str) -> tuple[str, str] | None:
    """An Inductor kernel name's kind and fused-op list, less the numeric suffixes (``_3``, ``_1_2``) Inductor adds
    to tell kernels apart: ``triton_poi_fused__to_copy_mul_3`` -> ("poi", "_to_copy_mul"). The suffixes are split
    off, not matched by a pattern that would rescan them from every position."""
    match = _INDUCTOR.fullmatch(name)
    if not match:
        return None
    head, *parts = match.group("ops").split("_")
    while parts and parts[-1].isdecimal():
        parts.pop()
    return match.group("kind"), "_".join([head, *parts])


def inductor_ops(name: str) -> list[str]:
    """The aten ops an Inductor kernel name lists (``triton_poi_fused__to_copy_mul_3`` -> ["_to_copy", "mul"])."""
    found = _inductor(name)
    if found is None:
        return []
    text = "_" + found[1] + "_"
    return [m.group(0) for m in _FUSED_OP.finditer(text) if _is_whole(m, text)]


def _is_whole(match: re.Match, text: str) -> bool:
    """An op found inside Inductor's underscore-joined list must start and end at a separator."""
    start, end = match.start(), match.end()
    before_ok = start == 0 or text[start - 1] == "_" or text[start] == "_"
    after_ok = end == len(text) or text[end] == "_"
    return before_ok and after_ok


def _class_of_fused(kind: str, ops: list[str]) -> str:
    """The class of an Inductor kernel from its kind (poi = pointwise, per/red = reduction, tem = template GEMM)
    and the ops it fused. Casts (_to_copy) ride along in almost every bf16 kernel, so they decide only when nothing
    else does; a materialised broadcast (expand + clone, as in GQA's repeat_kv) is a copy whatever else is fused."""
    found = set(ops)
    if kind == "tem":
        return "bmm" if "bmm" in found else "attention" if any("attention" in op for op in found) else "gemm"
    if kind in ("per", "red"):
        if "rsqrt" in found and ("mean" in found or "pow" in found) or found & {"native_layer_norm", "layer_norm"}:
            return "norm"
        if found & {"argmax", "argmin", "multinomial", "exponential"}:
            return "sampling"
        if "topk" in found:
            return "routing"
        if "sort" in found:
            return "scatter_gather"
        return "reduction"
    if "expand" in found and found & {"clone", "copy"}:
        return "copy_"
    for group, cls in ((("silu", "gelu", "relu", "sigmoid", "tanh"), "activation"), (("cos", "sin"), "rope"),
                       (("clone", "copy", "cat", "index_copy", "index_put", "slice_scatter", "stack"), "copy_"),
                       (("mul",), "mul"), (("add",), "add"), (("clamp_min",), "clamp_min"),
                       (("_to_copy",), "copy_")):
        if found & set(group):
            return cls
    return "elementwise"


def _aten_base(name: str) -> str | None:
    """``aten::index_copy_`` -> ``index_copy``; None for names outside the aten namespace."""
    if not name.startswith("aten::"):
        return None
    base = name[6:].removesuffix(".out")
    if base not in _ATEN and base.endswith("_"):
        base = base[:-1]
    return base


# optiq's own fused ops, by what dominates their time (gate_up_swiglu is a GEMM with SwiGLU in its epilogue).
_OPTIQ_OPS = {"decode_attention": "attention", "gate_up_swiglu": "gemm", "qkv_proj": "gemm", "rmsnorm": "norm",
              "add_rmsnorm": "norm", "rope": "rope", "rope_cached": "rope", "trailing_rope": "rope",
              "swiglu": "activation", "greedy_sample": "sampling", "moe_experts": "grouped_gemm",
              "mla_decode": "attention", "moe_route": "routing", "moe_route_gemm": "routing"}


@lru_cache(maxsize=None)
def class_of_op(name: str) -> str:
    """The class of a CPU op name (``aten::copy_``, ``optiq::rope``, an Inductor kernel's launcher op, a vendor op),
    or "other"."""
    base = _aten_base(name)
    if base is not None:
        return _ATEN.get(base, "other")
    if name.startswith("optiq::") and name[7:] in _OPTIQ_OPS:
        return _OPTIQ_OPS[name[7:]]
    return class_of_kernel(name)


# Top-level ops whose inner ops misname them: an embedding lookup runs aten::gather (an MoE class) underneath.
_DECIDED_BY_TOP = {"embedding": "other", "index_select": "other"}


@lru_cache(maxsize=None)
def class_of_top_op(name: str) -> str | None:
    """The class a top-level op imposes on every kernel under it, or None where the innermost op decides."""
    return _DECIDED_BY_TOP.get(_aten_base(name) or "")


@lru_cache(maxsize=None)
def class_of_kernel(name: str) -> str:
    """The class a GPU kernel's name reveals, or "other" when it reveals none."""
    found = _inductor(name)
    if found is not None:
        return _class_of_fused(found[0], inductor_ops(name))
    for pattern, cls in _KERNEL_PATTERNS:
        if pattern.search(name):
            return cls
    return "other"


_GENERIC_FUNCTORS = {"BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "UnaryFunctor", "gpu_kernel_impl"}
_WORD = re.compile(r"\w+")
_FIRST_LETTER = re.compile(r"[A-Za-z]")
_FUNCTOR_ENDINGS = ("Ops", "_kernel_cuda", "_kernel_impl", "_cuda_out", "_kernel")


def _functors(text: str):
    """The functor-like words of a signature, from each word's first letter on: those that hold "Functor" after that
    letter or end in a kernel suffix (``MulFunctor``, ``clamp_min_scalar_kernel_impl``). Word by word, so a long name
    is scanned once; a pattern with a lazy ``\\w*?`` would rescan each word from every letter in it."""
    for word in _WORD.findall(text):
        letter = _FIRST_LETTER.search(word)
        if letter is None:
            continue
        rest = word[letter.start() + 1:]
        if "Functor" in rest or rest.endswith(_FUNCTOR_ENDINGS):
            yield word[letter.start():]


def short_kernel_name(name: str, width: int = 60) -> str:
    """A readable kernel name: a C++ signature becomes its function name and the functor it was instantiated with
    (``vectorized_elementwise_kernel<MulFunctor>``); other names are only cut to ``width``."""
    text = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    head = re.split(r"[<(]", text, maxsplit=1)[0].split("::")[-1]
    rest = text[len(text.split("<", 1)[0]):] if "<" in text else ""
    functor = next((word for word in _functors(rest) if word not in _GENERIC_FUNCTORS), None)
    short = f"{head}<{functor}>" if functor else head
    return short if len(short) <= width else short[: width - 1] + "…"
