"""rope against a float64 reference in HF's order: plain, Qwen3 qk-norm, static-cache write, strided views, masks.

CPU cases run the kernel under the Triton interpreter at small shapes; CUDA cases use the presets' shapes.
"""

import pytest
import torch

from optiq.fusions.rope import (benchmark_case, heads_per_program, rope, rope_reference, trailing_rope,
                               trailing_rope_reference)
from kernel_testing import CUDA, OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda

# The interpreter rounds to bf16 by truncation, and rope rounds to the model dtype several times, as HF does.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
EPS = 1e-6
SPARE = 3  # extra columns after the heads in the projection output, which the kernel must leave alone


class Case:
    """Random inputs laid out as HF's attention forward has them: q, k, v are transposed views of projection outputs."""

    def __init__(self, seed, batch, heads_q, heads_kv, seq, head_dim, dtype, device, *, qk_norm=False,
                 positions=None, cache_len=None, cos_batch=None, layout=None, cos_width=None):
        self.layout = layout or {}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.dtype, self.device = dtype, device
        self.projections = [self.randn(batch, seq, heads * head_dim + SPARE) for heads in (heads_q, heads_kv)]
        self.q, self.k = (p[..., :-SPARE].view(batch, seq, -1, head_dim).transpose(1, 2) for p in self.projections)
        angles = torch.rand(cos_batch or batch, seq, cos_width or head_dim // 2, generator=self.generator,
                            device=device) * 50
        angles = angles if cos_width else torch.cat((angles, angles), dim=-1)  # Llama's: each half the same
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.norms = (1 + 0.5 * self.randn(head_dim), 1 + 0.5 * self.randn(head_dim)) if qk_norm else (None, None)
        self.cache = {}
        if positions is not None:
            self.cache = dict(
                v=self.randn(batch, seq, heads_kv * head_dim).view(batch, seq, heads_kv, head_dim).transpose(1, 2),
                k_cache=self.randn(batch, heads_kv, cache_len, head_dim),
                v_cache=self.randn(batch, heads_kv, cache_len, head_dim),
                positions=torch.tensor(positions, device=device),
            )

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.generator, device=self.device).to(self.dtype)

    def reference(self, cos=None, sin=None, eps=EPS):
        """rope_reference in float64 on the same inputs; cos, sin and eps can be overridden to get a wrong answer."""
        wide = lambda t: None if t is None else t.double()  # noqa: E731
        cache = {name: t if name == "positions" else wide(t) for name, t in self.cache.items()}
        return rope_reference(wide(self.q), wide(self.k), wide(self.cos if cos is None else cos),
                              wide(self.sin if sin is None else sin), *map(wide, self.norms), eps, **cache,
                              **self.layout)

    def run(self):
        """Poison the cache slots the op must write, run it, and return its results as the reference orders them."""
        if self.cache:
            seq, cache_len = self.q.shape[2], self.cache["k_cache"].shape[2]
            for b, start in enumerate(self.cache["positions"].tolist()):
                for cache in (self.cache["k_cache"], self.cache["v_cache"]):
                    cache[b, :, start:min(start + seq, cache_len)] = float("nan")
        spare_before = [p[..., -SPARE:].clone() for p in self.projections]
        q, k = rope(self.q, self.k, self.cos, self.sin, *self.norms, EPS, **self.cache, **self.layout)
        assert q is self.q and k is self.k, "rope works in place and returns its q and k"
        for p, before in zip(self.projections, spare_before):
            assert torch.equal(p[..., -SPARE:], before), "wrote outside the q/k views"
        results = (q, k) + ((self.cache["k_cache"], self.cache["v_cache"]) if self.cache else ())
        for t in results:
            assert torch.isfinite(t).all(), "an element the op should write was left unwritten"
        return results


def assert_matches(results, expected, dtype):
    tol = TOLERANCES[dtype]
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("with_cache", [False, True])
def test_variants_cpu(qk_norm, with_cache):
    """Prefill-shaped (S = 2): per-sequence cache positions, cos/sin for the whole batch or one row for all."""
    case = Case(seed=10 + 2 * qk_norm + with_cache, batch=3, heads_q=4, heads_kv=2, seq=2, head_dim=16,
                dtype=torch.float32, device="cpu", qk_norm=qk_norm, positions=[0, 5, 3] if with_cache else None,
                cache_len=7, cos_batch=1 if with_cache else None)
    expected = case.reference()
    assert_matches(case.run(), expected, torch.float32)


LAYOUTS = {  # the layouts of transformers' apply_rotary_pos_emb variants, by a model that has each
    "llama": {}, "cohere": dict(interleaved=True, fp32=True), "helium": dict(interleaved=True, pair_angles=True),
    "ernie4_5": dict(interleaved=True, pair_angles=True, fp32=True), "gpt_oss": dict(pair_angles=True),
    "nanochat": dict(clockwise=True), "every switch": dict(interleaved=True, pair_angles=True, clockwise=True, fp32=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layouts_cpu(layout, dtype):
    """Each layout on cos and sin whose every column is its own angle (Llama's repeat theirs, which would hide a
    channel turned by the wrong column), half as wide as a head for GPT-OSS's, with q/k norms and the cache write:
    the float64 reference of that layout matched, and in fp32 no other layout's that reads those columns."""
    case = Case(seed=70, batch=2, heads_q=4, heads_kv=2, seq=1, head_dim=16, dtype=dtype, device="cpu", qk_norm=True,
                positions=[3, 0], cache_len=5, cos_width=8 if layout == "gpt_oss" else 16)
    references = {}
    for name, switches in LAYOUTS.items():
        if switches.get("pair_angles") or layout != "gpt_oss":
            case.layout = switches
            references[name] = case.reference()
    case.layout = LAYOUTS[layout]
    results = case.run()
    assert_matches(results, references[layout], dtype)
    for other, expected in references.items():
        if dtype == torch.float32 and {**LAYOUTS[other], "fp32": 0} != {**LAYOUTS[layout], "fp32": 0}:
            with pytest.raises(AssertionError):
                assert_matches(results, expected, dtype)


@pytest.mark.parametrize("fp32", [False, True])
def test_rounding_as_the_eager_code_rounds_cpu(fp32):
    """In fp16, where the interpreter rounds as torch does: products rounded to the model dtype (Llama's eager bf16
    ops) or kept in fp32 and rounded once (Cohere's q.float()), each bit for bit as that eager code, and not as the
    other."""
    case = Case(seed=72, batch=2, heads_q=4, heads_kv=2, seq=1, head_dim=16, dtype=torch.float16, device="cpu",
                cos_width=16, layout=dict(interleaved=True, fp32=fp32))
    eager = {wide: rope_reference(case.q.clone(), case.k.clone(), case.cos, case.sin, interleaved=True, fp32=wide)
             for wide in (False, True)}
    results = case.run()
    assert all(torch.equal(got, want) for got, want in zip(results, eager[fp32]))
    assert not all(torch.equal(got, want) for got, want in zip(results, eager[not fp32]))


@pytest.mark.parametrize("offset, weight_first", [(False, False), (False, True)], ids=["llama", "olmo2"])
def test_norm_across_all_heads(request, offset, weight_first):
    """Norm weights as wide as all of q's heads and all of k's (OLMo 2's): each token's q normed over its whole row
    of heads, k over its own, then rotated and k written to the cache, as the float64 reference says; statistics
    taken per head with the same weights are not that. OLMo-2-1B's q (16 heads of 128) is more heads than rotation
    alone gives a program: one that read the others' heads after they were written in place would fail."""
    dtype = torch.float32 if SMALL_DEVICE == "cpu" else torch.bfloat16
    case = Case(seed=76, batch=3, heads_q=16, heads_kv=8, seq=1, head_dim=128, dtype=dtype, device=SMALL_DEVICE,
                qk_norm=True, positions=[2, 0, 4], cache_len=6, layout=dict(offset=offset, weight_first=weight_first))
    case.norms = tuple(1 + 0.5 * case.randn(heads * 128) for heads in (16, 8))
    expected = case.reference()

    def normed_per_head(x, weight):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double().view(x.shape[1], 1, -1)

    cache = {name: t if name == "positions" else t.double() for name, t in case.cache.items()}
    per_head = rope_reference(normed_per_head(case.q, case.norms[0]), normed_per_head(case.k, case.norms[1]),
                              case.cos.double(), case.sin.double(), **cache)
    results = case.run()
    assert_matches(results, expected, dtype)
    with pytest.raises(AssertionError):
        assert_matches(results, per_head, dtype)


def test_rejects_norm_weights_of_another_width():
    case = Case(seed=78, batch=1, heads_q=4, heads_kv=2, seq=1, head_dim=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="norm weights"):
        rope(case.q, case.k, case.cos, case.sin, torch.ones(64), torch.ones(16))


NORM_KINDS = {"qwen3": {}, "gemma3": dict(offset=True), "gemma4": dict(weight_first=True)}  # rmsnorm's orders


@pytest.mark.parametrize("kind", NORM_KINDS)
def test_qk_norm_rounds_as_its_kind(kind):
    """Each kind of per-head norm (w after the rounding, 1 + w before it, w before it) is computed in its own rounding
    order: in fp16 on the CPU (the interpreter rounds as torch does) and bf16 on the GPU, the kernel's q and k equal
    the eager sequence of that kind in all but rare rounding-boundary elements, and differ from each other kind's
    in many more (the orders are a rounding apart, which the gate sees in bf16). The rotation is Cohere's, in fp32
    and rounded once, which the GPU's fused multiply-adds leave as it is (in Llama's they round a product fewer than
    eager bf16 ops in a quarter of the elements: test_no_less_accurate_than_hf_eager_cuda)."""
    dtype = torch.float16 if SMALL_DEVICE == "cpu" else torch.bfloat16
    case = Case(seed=74, batch=8, heads_q=8, heads_kv=4, seq=1, head_dim=32, dtype=dtype, device=SMALL_DEVICE,
                qk_norm=True)
    eager = {name: rope_reference(case.q.clone(), case.k.clone(), case.cos, case.sin, *case.norms, EPS, fp32=True,
                                  **switches) for name, switches in NORM_KINDS.items()}
    case.layout = dict(fp32=True, **NORM_KINDS[kind])
    results = case.run()
    differing = {name: sum((got != want).sum().item() for got, want in zip(results, expected))
                 for name, expected in eager.items()}
    elements = sum(t.numel() for t in results)
    assert differing[kind] <= 0.01 * elements, differing
    assert all(count >= 10 * max(differing[kind], 1) for name, count in differing.items() if name != kind), differing


def test_odd_head_dim_decode_cpu():
    """head_dim 20: each half (10) pads to a 16-wide block, so every load and store is masked."""
    case = Case(seed=20, batch=2, heads_q=6, heads_kv=3, seq=1, head_dim=20, dtype=torch.float32, device="cpu",
                qk_norm=True, positions=[4, 0], cache_len=5)
    expected = case.reference()
    assert_matches(case.run(), expected, torch.float32)


def test_heads_in_blocks_cpu():
    """head_dim 256: four heads a program, so q's 10 heads are three blocks (the last of two) and k's 3 one block
    with a masked fourth; each head normed, rotated and cached as HF does it."""
    assert heads_per_program(10, 3, 128) == 4
    case = Case(seed=25, batch=2, heads_q=10, heads_kv=3, seq=1, head_dim=256, dtype=torch.float32, device="cpu",
                qk_norm=True, positions=[3, 1], cache_len=5)
    expected = case.reference()
    assert_matches(case.run(), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_cpu(dtype):
    case = Case(seed=30 if dtype == torch.bfloat16 else 31, batch=2, heads_q=4, heads_kv=2, seq=1, head_dim=16,
                dtype=dtype, device="cpu", qk_norm=True, positions=[2, 6], cache_len=8)
    expected = case.reference()
    assert_matches(case.run(), expected, dtype)


def test_positions_past_the_cache_are_dropped_cpu():
    """The cache is a view with slack after its last slot: tokens past the end must not land in the slack."""
    case = Case(seed=40, batch=2, heads_q=2, heads_kv=1, seq=3, head_dim=8, dtype=torch.float32, device="cpu",
                positions=[4, 1], cache_len=6)
    slack = {name: torch.cat((case.cache[name], torch.full((2, 1, 4, 8), 7.0)), dim=2)
             for name in ("k_cache", "v_cache")}
    for name, buffer in slack.items():
        case.cache[name] = buffer[:, :, :6]
    expected = case.reference()
    assert_matches(case.run(), expected, torch.float32)
    for buffer in slack.values():
        assert (buffer[:, :, 6:] == 7.0).all()


def test_wrong_inputs_fail_cpu():
    """The comparison can fail: cos and sin swapped, the rotation reversed, or another eps all give other answers."""
    case = Case(seed=50, batch=2, heads_q=2, heads_kv=1, seq=1, head_dim=16, dtype=torch.float32, device="cpu",
                qk_norm=True)
    wrong = [case.reference(cos=case.sin, sin=case.cos), case.reference(sin=-case.sin), case.reference(eps=0.1)]
    results = case.run()
    for expected in wrong:
        with pytest.raises(AssertionError):
            assert_matches(results, expected, torch.float32)


def test_argument_checks():
    case = Case(seed=60, batch=1, heads_q=2, heads_kv=1, seq=1, head_dim=8, dtype=torch.float32, device="cpu",
                qk_norm=True, positions=[0], cache_len=2)
    with pytest.raises(ValueError, match="q_norm_weight"):
        rope(case.q, case.k, case.cos, case.sin, case.norms[0])
    with pytest.raises(ValueError, match="k_cache"):
        rope(case.q, case.k, case.cos, case.sin, k_cache=case.cache["k_cache"])


def test_custom_op_registration():
    """Declared mutations match what the kernel writes (all checks on CUDA; see OPCHECKS)."""
    device = "cuda" if CUDA else "cpu"
    case = Case(seed=70, batch=2, heads_q=4, heads_kv=2, seq=1, head_dim=16, dtype=torch.float32, device=device,
                qk_norm=True, positions=[1, 3], cache_len=4)
    torch.library.opcheck(torch.ops.optiq.rope.default, (case.q, case.k, case.cos, case.sin, *case.norms, EPS),
                          **OPCHECKS)
    torch.library.opcheck(torch.ops.optiq.rope_cached.default,
                          (case.q, case.k, case.cos, case.sin, *case.cache.values(), *case.norms, EPS), **OPCHECKS)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_benchmark_case_cpu(qk_norm):
    """Called as the harness calls them, fused first, the benchmark's two callables agree (the fused op works in
    place on its own copies of the inputs)."""
    case = benchmark_case(1, torch.float32, "cpu", qk_norm=qk_norm, cache_len=4)
    for got, want in zip(case["fused"](), case["eager"](), strict=True):
        torch.testing.assert_close(got, want)
    assert case["bytes"] > 0 and case["flops"] > 0


PRESETS = {  # name: (q heads, kv heads, head_dim, qk_norm)
    "qwen3-0.6b": (16, 8, 128, True),
    "llama-3.2-1b": (32, 8, 64, False),
    "llama-3.1-8b": (32, 8, 128, False),
    "qwen3-30b-a3b": (32, 4, 128, True),
}


@needs_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch, seq", [(1, 1), (64, 1), (4, 17)])
def test_presets_cuda(preset, batch, seq):
    heads_q, heads_kv, head_dim, qk_norm = PRESETS[preset]
    case = Case(seed=batch * 100 + seq, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seq=seq, head_dim=head_dim,
                dtype=torch.bfloat16, device="cuda", qk_norm=qk_norm,
                positions=[(37 * b) % (1024 - seq) for b in range(batch)], cache_len=1024)
    expected = case.reference()
    assert_matches(case.run(), expected, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_less_accurate_than_hf_eager_cuda(dtype):
    """HF rounds both products and the sum; on the GPU the compiler folds one product into an FMA (measured on the
    H200: the kernel equals fma(x1, cos, -round(x2 * sin)) bit for bit), so the kernel is not bit-identical to HF but
    must be at least as close to float64."""
    case = Case(seed=80, batch=64, heads_q=32, heads_kv=8, seq=1, head_dim=128, dtype=dtype, device="cuda",
                positions=list(range(64)), cache_len=128)
    exact, hf = case.reference(), rope_reference(case.q, case.k, case.cos, case.sin, **case.cache)
    for got, theirs, want in zip(case.run(), hf, exact, strict=True):
        assert (got.double() - want).norm() <= (theirs.double() - want).norm()


@needs_cuda
def test_cuda_graph_replay_cuda():
    """The in-place op, captured, follows new positions and inputs when replayed (compiled: see the custom-op test)."""
    case = Case(seed=90, batch=4, heads_q=32, heads_kv=8, seq=1, head_dim=128, dtype=torch.bfloat16, device="cuda",
                qk_norm=True, positions=[0, 1, 2, 3], cache_len=64)
    originals = (case.q.clone(), case.k.clone())

    def refill():
        case.q.copy_(originals[0])
        case.k.copy_(originals[1])
        case.cache["positions"].copy_(torch.tensor([9, 40, 63, 5]))

    results = (case.q, case.k, case.cache["k_cache"], case.cache["v_cache"])
    assert_graph_replay_and_compile(
        lambda: rope(case.q, case.k, case.cos, case.sin, *case.norms, EPS, **case.cache), refill,
        expect=case.reference,
        same=lambda _, expected: assert_matches(results, expected, torch.bfloat16), compile=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_qk_norm_against_hf(dtype):
    """Gemma 3's q/k norms scale by 1 + w (offset weights near zero): the kernel against Gemma3RMSNorm itself
    followed by HF's rotation, and the plain-weight reading of the same weights is far from it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

    case = Case(71, 2, 4, 2, 1, 16, dtype, SMALL_DEVICE)
    weights = [0.3 * case.randn(16) for _ in range(2)]
    norms = []
    for weight in weights:
        norm = Gemma3RMSNorm(16, eps=EPS).to(case.device)
        norm.weight.data.copy_(weight.float())
        norms.append(norm.to(dtype))
    want_q, want_k = apply_rotary_pos_emb(norms[0](case.q.clone()), norms[1](case.k.clone()), case.cos, case.sin)
    got_q, got_k = rope(case.q.clone(), case.k.clone(), case.cos, case.sin, *weights, EPS, offset=True)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), want_k.float(), rtol=tol, atol=tol)
    plain_q, _ = rope(case.q.clone(), case.k.clone(), case.cos, case.sin, *weights, EPS)
    assert not torch.allclose(plain_q.float(), want_q.float(), rtol=0.1, atol=0.1)


def one_tensor_case(seed, batch, heads, head_dim, half, dtype, device, cos_batch=None):
    """x as V4's attention has it (a projection viewed per head and transposed), cos / sin one entry a pair."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, 1, heads * head_dim + SPARE, generator=generator, device=device, dtype=dtype)
    x = x[..., :-SPARE].view(batch, 1, heads, head_dim).transpose(1, 2)
    angles = torch.rand(cos_batch or batch, 1, half, generator=generator, device=device) * 50
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cos_batch", [None, 1])
def test_trailing_rope_is_deepseek_v4s_rotation(dtype, cos_batch):
    """The kernel against V4's own apply_rotary_pos_emb (products in fp32, rounded once) and a float64 reference:
    the leading channels pass, the trailing pairs turn; one row of cos / sin may serve the batch. At V4-Flash's
    widths (64 heads of 512, 32 pairs) on a GPU."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch, heads, head_dim, half = (3, 64, 512, 32) if CUDA else (3, 4, 40, 8)
    x, cos, sin = one_tensor_case(7 + (cos_batch or 0), batch, heads, head_dim, half, dtype, SMALL_DEVICE, cos_batch)
    before = x.clone()
    out = trailing_rope(x, cos, sin)
    assert torch.equal(x, before) and out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, apply_rotary_pos_emb(x, cos, sin), rtol=TOLERANCES[dtype], atol=1e-6)
    want = trailing_rope_reference(x, cos, sin)
    torch.testing.assert_close(out.double(), want.double(), rtol=TOLERANCES[dtype], atol=1e-6)
    assert torch.equal(out[..., :head_dim - 2 * half], x[..., :head_dim - 2 * half])
    assert not torch.allclose(out, trailing_rope_reference(x, cos, -sin), rtol=1e-2, atol=1e-2)


def test_trailing_rope_refuses_shapes_it_does_not_rotate():
    x, cos, sin = one_tensor_case(8, 2, 2, 16, 4, torch.float32, SMALL_DEVICE)
    for args in ((x, cos[..., :3], sin[..., :3]), (x[..., :6], cos, sin), (x[0], cos, sin), (x, cos, sin[..., :2])):
        with pytest.raises(ValueError, match="shapes do not fit"):
            trailing_rope(*args)


@needs_cuda
def test_trailing_rope_graph_replay_and_compile():
    x, cos, sin = one_tensor_case(9, 16, 64, 512, 32, torch.bfloat16, "cuda")
    assert_graph_replay_and_compile(lambda: trailing_rope(x, cos, sin), lambda: cos.copy_(sin))
