"""Op classes from aten op names, kernel names and Inductor kernel names."""

import gzip
import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optiq.traces.op_classes import CLASSES, class_of_kernel, class_of_op, inductor_ops, short_kernel_name

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("op, cls", [
    ("aten::copy_", "copy_"), ("aten::_to_copy", "copy_"), ("aten::index_copy_", "copy_"), ("aten::cat", "copy_"),
    ("aten::mul", "mul"), ("aten::mul_", "mul"), ("aten::add_", "add"), ("aten::clamp_min_", "clamp_min"),
    ("aten::sum", "reduction"), ("aten::mean", "reduction"), ("aten::bmm", "bmm"), ("aten::mm", "gemm"),
    ("aten::addmm", "gemm"), ("aten::_scaled_dot_product_flash_attention", "attention"), ("aten::rms_norm", "norm"),
    ("aten::silu", "activation"), ("aten::topk", "routing"), ("aten::sort", "scatter_gather"),
    ("aten::_grouped_mm", "grouped_gemm"),
    ("aten::scatter_add_", "scatter_gather"), ("optiq::gate_up_swiglu", "gemm"),
    ("optiq::decode_attention", "attention"), ("aten::argmax", "sampling"), ("aten::multinomial", "sampling"),
    ("aten::neg", "elementwise"), ("aten::embedding", "other"), ("aten::something_new", "other"),
    ("_C::rotary_embedding", "rope"), ("vllm::unified_attention", "attention"), ("_C::silu_and_mul", "activation"),
])
def test_aten_and_vendor_ops(op, cls):
    assert class_of_op(op) == cls


@pytest.mark.parametrize("name, cls", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::clamp_min_scalar_kernel_impl(at::"
     "TensorIteratorBase&, c10::Scalar)::{lambda()#1}>(int)", "clamp_min"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()>, unsigned int, float, 4, 4> >", "reduction"),
    ("fused_moe_kernel", "grouped_gemm"), ("flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*)", "norm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rope"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>", "activation"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<int>", "scatter_gather"),
    ("_decode_attention_split_kernel", "attention"), ("_gate_up_gemm_swiglu_kernel", "gemm"),
    ("Memcpy DtoH (Device -> Pinned)", "memcpy/memset"), ("some_custom_kernel_xyz", "other"),
])
def test_kernel_names(name, cls):
    assert class_of_kernel(name) == cls


def test_kernel_names_agree_with_their_linked_ops_in_a_real_h200_trace():
    """Under CUDA graphs only the name is left: on an eager trace, the name alone must give the op's class."""
    events = json.load(gzip.open(DATA / "gpu_eager.json.gz"))["traceEvents"]
    op_of = {e["args"]["External id"]: e["name"] for e in events if e.get("cat") == "cpu_op"}
    pairs = {(op_of[e["args"]["External id"]], e["name"]) for e in events if e.get("cat") == "kernel"}
    assert len(pairs) > 20
    disagree = [(op, short_kernel_name(name)) for op, name in pairs if class_of_op(op) != class_of_kernel(name)]
    assert disagree == []
    assert {class_of_kernel(name) for _, name in pairs} >= {"copy_", "mul", "add", "gemm", "bmm", "attention",
                                                           "reduction", "activation", "sampling", "elementwise"}


def test_inductor_names_list_their_fused_ops():
    assert inductor_ops("triton_poi_fused__to_copy_mul_3") == ["_to_copy", "mul"]
    assert inductor_ops("triton_per_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0") == [
        "_to_copy", "add", "embedding", "mean", "mul", "pow", "rsqrt"]
    assert inductor_ops("nvjet_sm90_tst") == []


@pytest.mark.parametrize("name, cls", [
    # GQA's repeat_kv materialised before cuDNN SDPA (the 38% kernel of DESIGN.md) is a copy, not attention or rope
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_arange_cat_clone_cos_expand_le_"
     "mul_neg_scalar_tensor_sin_slice_transpose_unsqueeze_view_where_5", "copy_"),
    ("triton_poi_fused__to_copy__unsafe_view_add_arange_cat_cos_index_copy_mul_neg_sin_slice_transpose_unsqueeze_"
     "view_3", "rope"),
    ("triton_per_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_poi_fused__unsafe_view_mul_silu_9", "activation"), ("triton_poi_fused_add_copy__13", "copy_"),
    ("triton_poi_fused__to_copy_mul_3", "mul"), ("triton_poi_fused_clamp_min_2", "clamp_min"),
    ("triton_red_fused_sum_4", "reduction"), ("triton_tem_fused_mm_0", "gemm"), ("triton_tem_fused_bmm_1", "bmm"),
    ("triton_poi_fused__to_copy_1", "copy_"), ("triton_poi_fused_neg_7", "elementwise"),
])
def test_inductor_kernel_classes(name, cls):
    assert class_of_kernel(name) == cls
    assert class_of_op(name) == cls  # Inductor's launcher op carries the kernel's name


def test_every_class_is_declared():
    names = [e["name"] for e in json.load(gzip.open(DATA / "gpu_compiled.json.gz"))["traceEvents"]
             if e.get("cat") == "kernel"]
    assert {class_of_kernel(n) for n in names} <= set(CLASSES)


@pytest.mark.parametrize("name, short", [
    ("void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
     "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int)",
     "vectorized_elementwise_kernel<MulFunctor>"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>,"
     " unsigned int, 4, 64, 64>(int)", "CatArrayBatchedCopy"),
    ("nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN", "nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN"),
])
def test_short_kernel_names(name, short):
    assert short_kernel_name(name) == short


def test_moe_classes_are_named_apart_in_the_h200_moe_traces():
    """qwen3-30b-a3b at C=64: the experts' grouped GEMM, the router's top-k and the token packing are three classes,
    and the graph replay's kernel names alone give the eager trace's linked shares."""
    from optiq.traces.attribution import attribute
    from optiq.traces.reader import read_trace

    traces = Path(__file__).parent.parent / "traces"
    shares = [attribute([read_trace(traces / f"qwen3-30b-a3b_{mode}_C64.json.gz")], "class").table
              .set_index("class")["pct"] for mode in ("eager", "graph")]
    for cls, low in (("grouped_gemm", 15), ("routing", 0.3), ("scatter_gather", 0.5)):
        assert shares[0][cls] > low
        assert abs(shares[0][cls] - shares[1][cls]) < 0.5


# Repeated units that made a pattern rescan the rest of the name from every position (a 100 KB "k<aaa..." took 57 s
# in short_kernel_name, an 80 KB "triton_poi_fused_1_1_..." 43 s), and the fragments of every other pattern.
HOSTILE_UNITS = ["a", "1_", "sm1_", "functor", "Functor", "decode_kernel", "execute_1", "mul_", "_to_copy", "Ops"]
HOSTILE_PREFIXES = ["", "void k<", "triton_poi_fused_"]


@pytest.mark.parametrize("unit", HOSTILE_UNITS)
def test_name_patterns_run_in_linear_time(unit):
    """50 KB names of a repeated unit behind each prefix classify and shorten in a few ms each: every pattern is
    linear in the name. (Quadratic, these took 1 to 45 s.)"""
    from optiq.traces.reader import _is_marker

    for prefix in HOSTILE_PREFIXES:
        name = prefix + unit * (50_000 // len(unit))
        for classify in (class_of_kernel.__wrapped__, class_of_op.__wrapped__, short_kernel_name, inductor_ops,
                         _is_marker):
            started = time.perf_counter()
            classify(name)
            assert time.perf_counter() - started < 0.5, (prefix, unit, classify.__name__)


@pytest.mark.parametrize("name, cls", [
    ("sm90_xmma_tensorop_gemm", "gemm"), ("sm80_x\nsm90_y_tensorop", "gemm"), ("sm80_x\ntensorop", "other"),
    ("decode_kernel_with_kv", "attention"), ("functorish_add", "add"), ("my_functor_x_add y", "add"),
    ("functor_addx", "elementwise"), ("triton_poi_fused_1_1_1", "elementwise"), ("triton_poi_fused_\nmul", "mul"),
])
def test_rewritten_patterns_keep_their_meaning(name, cls):
    """The linear forms of "A, later on the line B", "a word with functor ending in _add" and Inductor's numeric
    suffixes classify as the quadratic ones did, line breaks included."""
    assert class_of_kernel(name) == cls


def test_inductor_suffixes_are_split_off():
    assert inductor_ops("triton_poi_fused_mul_1_2_3") == ["mul"]
    assert inductor_ops("triton_poi_fused__to_copy_mul_12") == ["_to_copy", "mul"]
    assert inductor_ops("triton_poi_fused_1_2") == []
    assert short_kernel_name("void k<" + "a" * 50 + "Functor>(int)") == "k<" + "a" * 50 + "Functor>"


FRAGMENTS = ["sm90_", "tensorop", "Functor", "functor", "_add", "_kernel", "Ops", "triton_poi_fused_", "_1", "mul",
             "copy", "<", ">", "(", "::", " ", "a", "9", "_", "decode_kernel", "kv", "é", "\n", "execute_", "step["]


@given(parts=st.lists(st.tuples(st.sampled_from(FRAGMENTS), st.integers(1, 4000)), min_size=1, max_size=6))
@settings(deadline=None, derandomize=True, database=None, max_examples=60)
def test_long_names_of_pattern_fragments_classify_quickly(parts):
    """Names up to ~100 KB made of long runs of the patterns' own fragments (what makes a backtracking pattern
    rescan): every function answers, with a declared class, in well under a second."""
    name = "".join(fragment * repeat for fragment, repeat in parts)[:100_000]
    started = time.perf_counter()
    assert class_of_kernel.__wrapped__(name) in CLASSES and class_of_op.__wrapped__(name) in CLASSES
    assert len(short_kernel_name(name)) <= 60 and isinstance(inductor_ops(name), list)
    assert time.perf_counter() - started < 1.0, [(fragment, repeat) for fragment, repeat in parts]
