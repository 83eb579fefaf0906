"""decode_attention against a float64 reference: per-sequence lengths, GQA group sizes, head dims, KV splits.

Small cases run on the CPU under the Triton interpreter (or on the GPU when there is one); CUDA-only cases use
the presets' shapes.
"""

import pytest
import torch

from optiq.fusions.decode_attention import (ATTENTION_SHAPES, benchmark_case, decode_attention,
                                            decode_attention_reference)
from kernel_testing import CUDA, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def make_inputs(seed, batch, num_q_heads, num_kv_heads, head_dim, max_len, lengths, dtype, device):
    """Random q (as HF's transposed view of [B, 1, Hq, D]), caches and lengths; never zeros."""
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, 1, num_q_heads, head_dim, generator=generator, device=device, dtype=dtype).transpose(1, 2)
    cache_shape = (batch, num_kv_heads, max_len, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    return q, k_cache, v_cache, torch.tensor(lengths, device=device)


def reference(q, k_cache, v_cache, lengths, scale, **variant):
    return decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), lengths, scale, **variant)


def check(seed, batch, num_q_heads, num_kv_heads, head_dim, max_len, lengths, dtype, device, num_splits=None,
          **variant):
    """The kernel against the reference; `variant` is softcap and sinks as decode_attention takes them, and a
    sliding `window` (the starts it stands for, as transformers' sliding masks place them)."""
    q, k_cache, v_cache, lengths = make_inputs(seed, batch, num_q_heads, num_kv_heads, head_dim, max_len,
                                               lengths, dtype, device)
    if "window" in variant:
        variant["starts"] = window_starts(lengths, variant.pop("window"))
    scale = head_dim ** -0.5
    out = decode_attention(q, k_cache, v_cache, lengths, scale, num_splits, **variant)
    assert out.shape == (batch, 1, num_q_heads, head_dim) and out.dtype == dtype
    assert torch.isfinite(out).all(), "an output element was left unwritten"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, lengths, scale, **variant),
                               rtol=tol, atol=tol)
    return q, k_cache, v_cache, lengths, out


def window_starts(lengths, window):
    """First position a query at lengths - 1 sees: keys k with k > q - window."""
    return (lengths - window).clamp_min(0)


def random_sinks(seed, num_q_heads, device):
    """Sink logits of the size scores have, so they take a real share of each softmax."""
    return 2.0 * torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("window", [1, 5, 16, 200])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window(window, num_splits):
    """Only the last `window` filled positions count: windows shorter than one block, spanning splits, and longer
    than every sequence (then the same as no window)."""
    check(seed=200 + window, batch=4, num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=90,
          lengths=[90, 3, 47, 16], dtype=torch.float32, device=SMALL_DEVICE, num_splits=num_splits, window=window)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("softcap", [1.0, 50.0])
def test_logit_softcap(softcap):
    """A scale of 1 makes scores large enough that a cap of 1 bends every one of them."""
    q, k_cache, v_cache, lengths = make_inputs(230, 3, 4, 2, 16, 40, [40, 9, 1], torch.float32, SMALL_DEVICE)
    out = decode_attention(q, k_cache, v_cache, lengths, 1.0, num_splits=2, softcap=softcap)
    want = reference(q, k_cache, v_cache, lengths, 1.0, softcap=softcap)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, reference(q, k_cache, v_cache, lengths, 1.0), rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_sinks_with_a_window(num_splits):
    """GPT-OSS's combination: a window and per-head sinks; an idle slot still gives zeros."""
    _, _, _, _, out = check(seed=240 + num_splits, batch=3, num_q_heads=8, num_kv_heads=2, head_dim=16,
                            max_len=64, lengths=[64, 0, 21], dtype=torch.float32, device=SMALL_DEVICE,
                            num_splits=num_splits, window=12, sinks=random_sinks(num_splits, 8, SMALL_DEVICE))
    assert (out[1] == 0).all()


def test_each_variant_changes_the_result():
    """Dropping the window, the cap or the sinks gives another result, so the tests above can fail."""
    q, k_cache, v_cache, lengths = make_inputs(250, 2, 4, 2, 16, 30, [30, 20], torch.float32, SMALL_DEVICE)
    variant = dict(starts=window_starts(lengths, 8), softcap=2.0, sinks=random_sinks(250, 4, SMALL_DEVICE))
    out = decode_attention(q, k_cache, v_cache, lengths, 1.0, **variant).double()
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, lengths, 1.0, **variant), rtol=1e-5, atol=1e-5)
    for left_out in variant:
        fewer = {name: value for name, value in variant.items() if name != left_out}
        assert not torch.allclose(out, reference(q, k_cache, v_cache, lengths, 1.0, **fewer), rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_group_sizes_and_head_dims(group_size, head_dim):
    check(seed=10 * group_size + head_dim, batch=4, num_q_heads=2 * group_size, num_kv_heads=2,
          head_dim=head_dim, max_len=45, lengths=[1, 7, 45, 29], dtype=torch.float32, device=SMALL_DEVICE)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 1000])
def test_split_counts(num_splits):
    """Several blocks per split, splits that start past a short sequence, and more splits than blocks."""
    check(seed=100 + (num_splits or 0), batch=3, num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=150,
          lengths=[1, 150, 83], dtype=torch.float32, device=SMALL_DEVICE, num_splits=num_splits)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    check(seed=7 if dtype == torch.bfloat16 else 8, batch=3, num_q_heads=8, num_kv_heads=2, head_dim=32,
          max_len=40, lengths=[40, 5, 17], dtype=dtype, device=SMALL_DEVICE)


@pytest.mark.usefixtures("poisoned_empty")
def test_odd_head_dim_and_int32_lengths():
    """head_dim 24 pads to a 32-wide tile (masked columns); lengths arrive as int32 as well as int64."""
    q, k_cache, v_cache, lengths = make_inputs(21, 3, 6, 3, 24, 33, [33, 1, 12], torch.float32, SMALL_DEVICE)
    out = decode_attention(q, k_cache, v_cache, lengths.int(), 0.3)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, lengths, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("poisoned_empty")
def test_idle_slot_of_length_zero_gives_zeros():
    _, _, _, _, out = check(seed=27, batch=3, num_q_heads=4, num_kv_heads=1, head_dim=16, max_len=20,
                            lengths=[20, 0, 3], dtype=torch.float32, device=SMALL_DEVICE, num_splits=2)
    assert (out[1] == 0).all()


def poison_beyond_lengths(cache, lengths):
    """Fill every position at or past each sequence's length with NaN and huge values."""
    poisoned = cache.clone()
    for b, length in enumerate(lengths.tolist()):
        poisoned[b, :, length:] = float("nan")
        poisoned[b, :, length::2] = 1e30
    return poisoned


def test_positions_beyond_length_are_ignored():
    """No program may read (let alone weigh) cache positions past a sequence's length."""
    q, k_cache, v_cache, lengths = make_inputs(31, 4, 8, 2, 32, 70, [1, 70, 9, 64], torch.float32, SMALL_DEVICE)
    out = decode_attention(q, poison_beyond_lengths(k_cache, lengths), poison_beyond_lengths(v_cache, lengths),
                           lengths, 0.2, num_splits=3)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, lengths, 0.2), rtol=1e-5, atol=1e-5)


def test_positions_before_the_window_are_ignored():
    """Nor positions that slid out of the window: poisoned, they would turn the output to NaN."""
    q, k_cache, v_cache, lengths = make_inputs(32, 3, 4, 2, 16, 70, [70, 9, 40], torch.float32, SMALL_DEVICE)
    window = 7
    poisoned = [cache.clone() for cache in (k_cache, v_cache)]
    for cache in poisoned:
        for b, length in enumerate(lengths.tolist()):
            cache[b, :, :length - window] = float("nan")
    starts = window_starts(lengths, window)
    out = decode_attention(q, *poisoned, lengths, 0.2, num_splits=4, starts=starts)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, lengths, 0.2, starts=starts),
                               rtol=1e-5, atol=1e-5)


def test_wrong_length_or_scale_fails_the_comparison():
    """The comparison can fail: one position fewer, or another scale, gives a different result."""
    q, k_cache, v_cache, lengths, out = check(seed=41, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                              max_len=20, lengths=[20, 6], dtype=torch.float32, device=SMALL_DEVICE)
    scale = 16 ** -0.5
    for wrong in (reference(q, k_cache, v_cache, lengths - 1, scale), reference(q, k_cache, v_cache, lengths, 1.0)):
        assert not torch.allclose(out.double(), wrong, rtol=1e-3, atol=1e-3)


def random_visibility(seed, batch, max_len, device):
    """A mask of the kind gathered keys have: scattered positions, a run longer than any tile wholly hidden (so a
    block holds no visible key), and one sequence that sees nothing."""
    generator = torch.Generator().manual_seed(seed)
    visible = torch.rand(batch, max_len, generator=generator) < 0.6
    visible[0, 10:150] = False
    visible[-1] = False
    return visible.to(device)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_visibility_mask_with_sinks(num_splits):
    """Only the visible positions count, hidden ones may hold anything, whole tiles of hidden keys leave no NaN, and a
    sequence that sees nothing gives zeros (its sinks take the whole softmax)."""
    batch, max_len = 3, 200
    q, k_cache, v_cache, lengths = make_inputs(260 + num_splits, batch, 8, 2, 16, max_len, [max_len] * batch,
                                               torch.float32, SMALL_DEVICE)
    visible = random_visibility(num_splits, batch, max_len, SMALL_DEVICE)
    hidden = ~visible[:, None, :, None]
    poisoned = [cache.masked_fill(hidden, float("nan")) for cache in (k_cache, v_cache)]
    sinks = random_sinks(num_splits, 8, SMALL_DEVICE)
    out = decode_attention(q, *poisoned, lengths, 0.3, num_splits, sinks=sinks, visible=visible)
    want = reference(q, k_cache, v_cache, lengths, 0.3, sinks=sinks, visible=visible)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert (out[-1] == 0).all()
    assert not torch.allclose(want, reference(q, k_cache, v_cache, lengths, 0.3, sinks=sinks), rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("num_q_heads", [48, 64])
def test_wide_query_group_over_keys_that_are_their_values(num_q_heads):
    """DeepSeek-V4's layout: every query head over one shared KV head whose keys are its values (one tensor), 512
    wide, so the group is cut into blocks of heads (48 leaves a last block part-filled)."""
    batch, head_dim, max_len = 2, 512, 40
    q, keys, _, lengths = make_inputs(270 + num_q_heads, batch, num_q_heads, 1, head_dim, max_len, [40, 23],
                                      torch.float32, SMALL_DEVICE)
    visible = random_visibility(num_q_heads, batch, max_len, SMALL_DEVICE)
    visible[-1, :3] = True
    sinks = random_sinks(num_q_heads, num_q_heads, SMALL_DEVICE)
    out = decode_attention(q, keys, keys, lengths, head_dim ** -0.5, sinks=sinks, visible=visible)
    want = reference(q, keys, keys, lengths, head_dim ** -0.5, sinks=sinks, visible=visible)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# (num_q_heads, num_kv_heads, head_dim) of qwen3-0.6b, llama-3.2-1b, llama-3.1-8b, qwen3-30b-a3b, tiny presets
PRESET_HEADS = [(16, 8, 128), (32, 8, 64), (32, 8, 128), (32, 4, 128), (4, 2, 16)]


@needs_cuda
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("heads", PRESET_HEADS)
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_preset_shapes_cuda(heads, batch, dtype):
    num_q_heads, num_kv_heads, head_dim = heads
    max_len = 1024
    generator = torch.Generator().manual_seed(batch + head_dim)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=generator)
    lengths[0] = max_len
    lengths[-1] = 1 if batch > 1 else max_len
    check(seed=batch * head_dim + num_q_heads, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
          head_dim=head_dim, max_len=max_len, lengths=lengths.tolist(), dtype=dtype, device="cuda")


@needs_cuda
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("variant", ["gemma-3-1b sliding", "gpt-oss sinks", "gemma-2 softcap"])
def test_zoo_variants_cuda(batch, variant):
    """The zoo's heads with the variants they use, bf16, at W1's cache length: Gemma-3-1B's 4 q / 1 kv heads of
    256 in a 512-window, GPT-OSS's 64 / 8 of 64 with a 128-window and sinks, Gemma-2's softcap 50."""
    heads, extra = {
        "gemma-3-1b sliding": ((4, 1, 256), dict(window=512)),
        "gpt-oss sinks": ((64, 8, 64), dict(window=128, sinks=random_sinks(batch, 64, "cuda"))),
        "gemma-2 softcap": ((8, 4, 256), dict(softcap=50.0)),
    }[variant]
    lengths = torch.randint(1, 1025, (batch,), generator=torch.Generator().manual_seed(batch))
    lengths[0] = 1024
    check(seed=300 + batch, batch=batch, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
          max_len=1024, lengths=lengths.tolist(), dtype=torch.bfloat16, device="cuda", **extra)


@needs_cuda
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_deepseek_v4_gathered_keys_cuda(batch):
    """DeepSeek-V4-Flash's CSA call, bf16: 64 heads of 512 over one shared key-value tensor, the 128-window and 160
    entries gathered, part of them hidden, and its sinks; a graph replay follows a new visibility."""
    q, keys, _, lengths = make_inputs(320 + batch, batch, 64, 1, 512, 288, [288] * batch, torch.bfloat16, "cuda")
    visible = random_visibility(batch, batch, 288, "cuda")
    visible[-1, -1] = True
    sinks = random_sinks(batch, 64, "cuda")
    out = decode_attention(q, keys, keys, lengths, 512 ** -0.5, sinks=sinks, visible=visible)
    want = reference(q, keys, keys, lengths, 512 ** -0.5, sinks=sinks, visible=visible)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    assert_graph_replay_and_compile(
        lambda: decode_attention(q, keys, keys, lengths, 512 ** -0.5, sinks=sinks, visible=visible),
        lambda: visible.copy_(random_visibility(batch + 1, batch, 288, "cuda")),
        same=lambda got, want: torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3))


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 5, 16])
def test_float32_cuda(num_splits):
    """fp32 dots must run in full precision (not tf32) to meet the fp32 tolerance."""
    check(seed=50 + num_splits, batch=5, num_q_heads=32, num_kv_heads=8, head_dim=128, max_len=700,
          lengths=[700, 1, 7, 333, 512], dtype=torch.float32, device="cuda", num_splits=num_splits)


@needs_cuda
def test_cuda_graph_capture_and_compile():
    """Replayed, the graph follows new lengths; inductor passes the scale as a float64 constant, so the last bf16 bit
    of the compiled op may differ from eager."""
    q, k_cache, v_cache, lengths = make_inputs(61, 4, 32, 8, 128, 256, [256, 3, 100, 17], torch.bfloat16, "cuda")
    assert_graph_replay_and_compile(
        lambda: decode_attention(q, k_cache, v_cache, lengths, 0.1),
        lambda: lengths.copy_(torch.tensor([5, 256, 1, 64])),
        same=lambda got, want: torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3))


def test_benchmark_cases_run():
    rows, dtype = (16, torch.bfloat16) if CUDA else (1, torch.float32)
    cases = benchmark_case(rows, dtype, SMALL_DEVICE)
    for label, (num_q_heads, num_kv_heads, head_dim) in ATTENTION_SHAPES.items():
        case = cases[f"decode_attention {label}"]
        fused, eager = case["fused"](), case["eager"]()
        assert fused.shape == eager.shape == (rows, 1, num_q_heads, head_dim)
        torch.testing.assert_close(fused, eager, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])
        assert case["bytes"] > 2 * rows * num_kv_heads * 1024 * head_dim * fused.element_size() and case["flops"] > 0
    gathered = cases["decode_attention deepseek-v4-flash"]
    fused, eager = gathered["fused"](), gathered["eager"]()
    assert fused.shape == eager.shape == (rows, 1, 64, 512)
    torch.testing.assert_close(fused, eager, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])
