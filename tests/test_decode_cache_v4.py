"""DeepSeek-V4's static decode cache computes what HF's own cache does, step after step, across many compression
windows and the sliding window, and rewinds to any length from the prefill's on."""

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from optiq.decode_caches import deepseek_v4
from optiq.engine import DecodeEngine, graph_mode_problem, static_problem
from optiq.errors import OptiqError
from optiq.models import load_config, load_model, random_model

STEPS = 40  # 5 + 40 positions: 11 CSA windows of 2, 5 HCA windows of 4, the window of 8 slid 5 times over
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32: HF's and the static cache's sums differ in order only


@pytest.fixture(scope="module")
def model():
    """tiny-deepseek-v4 (rates 2 and 4, a window of 8, top 4 of the CSA entries) with 16 indexer heads instead of 3.
    With 3, a closed entry that every head's ReLU zeroes scores exactly 0 for about one query in eight, and the
    indexer's top-k among equal scores is torch.topk's arbitrary pick, which differs between HF's tensor of the
    closed entries and the static cache's of every slot; with 16 such ties are gone and the picks are the scores'."""
    config = load_config("tiny-deepseek-v4")
    config.index_n_heads = 16
    return random_model(config, torch.float32, torch.device("cpu")).eval()


def _prompt(batch, length, seed=1):
    return torch.randint(256, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _hf_decode(model, prompt, inputs):
    """HF's own decode (its DynamicCache, its forward): the logits of each of ``inputs`` [batch, n] fed one at a
    time after ``prompt``."""
    cache = DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model(input_ids=prompt, use_cache=True, **{name: cache})
    batch, start = prompt.shape
    logits = []
    for i in range(inputs.shape[1]):
        out = model(input_ids=inputs[:, i:i + 1], position_ids=torch.full((batch, 1), start + i), use_cache=True,
                    **{name: cache})
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


def _engine_decode(engine, steps, forced=None):
    """The engine's logits [steps, batch, vocab] and its inputs [batch, steps] (its greedy picks, or ``forced``)."""
    logits, inputs = [], []
    for i in range(steps):
        if forced is not None:
            engine.tokens.copy_(forced[:, i:i + 1])
        inputs.append(engine.tokens.clone())
        logits.append(engine.step().clone())
    return torch.stack(logits), torch.cat(inputs, dim=1)


@pytest.mark.parametrize("batch", [1, 3])
# 1: the decode closes the first windows (no window before them); 8: the prefill closes every window it opens
@pytest.mark.parametrize("prompt_len", [1, 5, 8])
def test_decode_matches_hf_own_cache(model, batch, prompt_len):
    """Every step's logits equal HF's own-cache decode of the same tokens."""
    prompt = _prompt(batch, prompt_len)
    engine = DecodeEngine(model, batch, max_len=prompt_len + STEPS)
    assert engine.family and engine.static
    engine.prefill(prompt)
    logits, inputs = _engine_decode(engine, STEPS)
    torch.testing.assert_close(logits, _hf_decode(model, prompt, inputs), **TOLERANCE)


def test_a_prefill_in_groups_of_sequences_decodes_the_same(model, monkeypatch):
    """Prefilled two sequences at a time (each group on an HF cache of its own, absorbed into its rows of the
    buffers), a batch of five decodes as HF's own cache does."""
    monkeypatch.setattr(deepseek_v4.StaticDeepseekV4Cache, "prefill_rows", 2)
    prompt = _prompt(5, 6, seed=3)
    engine = DecodeEngine(model, 5, max_len=6 + STEPS)
    engine.prefill(prompt)
    logits, inputs = _engine_decode(engine, STEPS)
    torch.testing.assert_close(logits, _hf_decode(model, prompt, inputs), **TOLERANCE)


def test_seek_back_to_the_prefill_replays_the_decode(model):
    engine = DecodeEngine(model, 3, max_len=5 + STEPS)
    engine.prefill(_prompt(3, 5))
    first = engine.tokens.clone()
    run1, _ = _engine_decode(engine, STEPS)
    engine.seek(5)
    engine.tokens.copy_(first)
    run2, _ = _engine_decode(engine, STEPS)
    assert torch.equal(run1, run2)


@pytest.mark.parametrize("length", [19, 24])  # inside a window at both rates; at the start of one at both
def test_seek_to_a_later_length_continues_as_hf_decoded_to_it(model, length):
    """After 40 steps, back to ``length`` and on with other tokens than the first run's (so that what the first
    run left past ``length`` would show if it were read): HF decoded to ``length`` and then fed those tokens."""
    prompt, batch = _prompt(3, 5), 3
    engine = DecodeEngine(model, batch, max_len=5 + STEPS)
    engine.prefill(prompt)
    _, inputs = _engine_decode(engine, STEPS)
    engine.seek(length)
    other = _prompt(batch, 5 + STEPS - length, seed=2)
    logits, _ = _engine_decode(engine, other.shape[1], forced=other)
    want = _hf_decode(model, prompt, torch.cat([inputs[:, :length - 5], other], dim=1))[length - 5:]
    torch.testing.assert_close(logits, want, **TOLERANCE)


def _off_by_one_visibility(monkeypatch, engine):
    visible = deepseek_v4._Compression.visible
    monkeypatch.setattr(deepseek_v4._Compression, "visible", lambda self, count: visible(self, count + 1))


def _window_one_longer(monkeypatch, engine):
    for layer in engine.cache.layers.values():
        monkeypatch.setattr(layer, "recent", torch.cat([layer.recent[:1] - 1, layer.recent]))


def _prefill_projections_lost(monkeypatch, engine):
    absorb = deepseek_v4._Compression.absorb

    def forgetting(self, *args):
        absorb(self, *args)
        self.kv.zero_()
    monkeypatch.setattr(deepseek_v4._Compression, "absorb", forgetting)


@pytest.mark.parametrize("mutant", [_off_by_one_visibility, _window_one_longer, _prefill_projections_lost])
def test_the_comparison_catches_a_wrong_cache(model, monkeypatch, mutant):
    """Entries visible one window early, a window one position longer, the prefill's open window and CSA overlap
    not taken over: each fails the comparison with HF by far more than its tolerance."""
    prompt = _prompt(3, 5)
    engine = DecodeEngine(model, 3, max_len=5 + STEPS)
    mutant(monkeypatch, engine)
    engine.prefill(prompt)
    logits, inputs = _engine_decode(engine, STEPS)
    assert (logits - _hf_decode(model, prompt, inputs)).abs().max() > 1e-3


class _Ops(TorchDispatchMode):
    """Every aten op a block runs, with its output shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                  if isinstance(t, torch.Tensor)]
        self.ops.append((func.__name__, shapes))
        return out


@torch.inference_mode()
def test_a_step_is_the_same_ops_at_every_position(model):
    """What a CUDA graph needs, checked on the CPU: the steps at the first positions, inside windows, closing them,
    past the sliding window run the same aten ops on the same shapes, and none of them reads a value back to the
    host (``.item()``, ``nonzero``)."""
    engine = DecodeEngine(model, 2, max_len=48)
    engine.prefill(_prompt(2, 1))
    runs = []
    for _ in range(40):
        with _Ops() as ops:
            engine._step()
        engine.length += 1
        runs.append(ops.ops)
    assert all(run == runs[0] for run in runs)
    host_reads = {"item.default", "_local_scalar_dense.default", "nonzero.default", "is_nonzero.default", "equal.default"}
    assert not {name for name, _ in runs[0]} & host_reads


def test_seek_before_the_prefill_end_is_one_line(model):
    engine = DecodeEngine(model, 1, max_len=16)
    engine.prefill(_prompt(1, 8))
    with pytest.raises(OptiqError, match="cannot be rewound to 7 positions, before the end of the prefill") as err:
        engine.seek(7)
    assert "\n" not in str(err.value)


def test_the_gate_copies_convert_the_layers_a_call_reads(model):
    """A captured call's float64 copy converts the buffers of the layers it reads and shares the others; a scaled
    copy scales them; a plain copy shares them all (a step writes its own position before it reads it)."""
    cache = DecodeEngine(model, 1, max_len=16).cache
    double = cache.converted(torch.float64, layers={1})
    assert double.layers[1].window.dtype == double.layers[1].indexing.gate.dtype == torch.float64
    assert double.layers[0].window is cache.layers[0].window
    assert cache.layers[1].window.dtype == torch.float32
    cache.layers[0].compression.kv.fill_(3.0)
    assert torch.equal(cache.converted(scale=0.5).layers[0].compression.kv, cache.layers[0].compression.kv / 2)
    assert cache.converted().layers[2].window is cache.layers[2].window


def test_a_replaced_attention_forward_falls_back_to_the_own_cache():
    """A recipe's forward on the attention (which the decode forward would replace) keeps the model on HF's cache,
    eager, with the reason; graph mode names it."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    assert static_problem(model) == ""
    attention = model.model.layers[0].self_attn
    attention.forward = type(attention).forward.__get__(attention)
    engine = DecodeEngine(model, 1, max_len=16)
    assert not engine.static and "forward is replaced" in engine.why_not_static
    engine.prefill(_prompt(1, 8))
    engine.step()
    assert "forward is replaced" in graph_mode_problem(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the H200 via device)")
@pytest.mark.parametrize("batch", [1, 16])
@torch.inference_mode()
def test_graph_replay_equals_eager(batch):
    """The step captures (no host synchronisation, no shape that moves with the position) and replaying it gives
    eager's logits and tokens across windows, and a rewind to the prefill replays the same again."""
    model = load_model("tiny-deepseek-v4", torch.bfloat16, torch.device("cuda"))
    assert graph_mode_problem(model) == ""
    prompt = _prompt(batch, 5)
    runs = {}
    for mode in ("eager", "graph"):
        engine = DecodeEngine(model, batch, max_len=5 + STEPS, mode=mode)
        engine.prefill(prompt)
        first = engine.tokens.clone()
        runs[mode] = [(engine.step().float().clone(), engine.tokens.clone()) for _ in range(STEPS - 1)]
        if mode == "graph":
            engine.seek(5)
            engine.tokens.copy_(first)
            for logits, _ in runs[mode]:
                assert torch.equal(engine.step().float(), logits)
        engine.release()
    for (eager_logits, eager_tokens), (graph_logits, graph_tokens) in zip(runs["eager"], runs["graph"]):
        torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=0)
        assert torch.equal(graph_tokens, eager_tokens)
