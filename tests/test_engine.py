"""The decode engine computes what the model computes without a cache, at the right positions."""

import pytest
import torch

from optiq.engine import DecodeEngine, graph_mode_problem
from optiq.errors import OptiqError
from optiq.models import load_model


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v2", "tiny:gemma3_text",
                                        "tiny:qwen3_next", "tiny:mamba", "tiny:deepseek_v4", "tiny:openai-gpt"])
def decoder(request):
    """The tiny presets: llama-style GQA, a Qwen3 MoE, and DeepSeek-V2's MLA (its cache holds the compressed latent);
    and from the zoo Gemma-3 (sliding-window layers, a window of 32), DeepSeek-V4 (layer types transformers'
    StaticCache does not know, held by optiq's static cache of its family), Qwen3-Next (linear attention beside
    full attention) and Mamba (no attention), which decode with the cache they make themselves, and GPT-1, which
    makes none (each step recomputes the sequence)."""
    return load_model(request.param, torch.float32, torch.device("cpu"))


def _prompt(model, batch, length, seed=1):
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_decode_matches_full_recompute(decoder):
    """Each cached decode step's logits equal a cache-free forward over prompt + generated tokens, past the sliding
    window too (a prompt of 35 positions, a window of 32)."""
    batch, prompt_len, steps = 3, 35, 6
    engine = DecodeEngine(decoder, batch, max_len=48)
    prompt = _prompt(decoder, batch, prompt_len)
    engine.prefill(prompt)
    sequence = torch.cat([prompt, engine.tokens.clone()], dim=1)
    for _ in range(steps):
        logits = engine.step().clone()
        reference = decoder(input_ids=sequence).logits[:, -1]
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        sequence = torch.cat([sequence, engine.tokens.clone()], dim=1)
    assert engine.length == prompt_len + steps
    assert torch.equal(engine.positions, torch.full((batch, 1), prompt_len + steps))
    if engine.static and not engine.family:
        assert all(int(layer.cumulative_length) == prompt_len + steps for layer in engine.cache.layers)
    assert engine.static == (decoder.config.model_type not in ("qwen3_next", "mamba", "openai-gpt"))
    assert engine.family == (decoder.config.model_type == "deepseek_v4")
    assert engine.recompute == (decoder.config.model_type == "openai-gpt")


@torch.inference_mode()
def test_seek_replays_the_same_decode(decoder):
    """Rewinding to the prompt and restoring the first token reproduces the decode exactly (the timing loop relies
    on it)."""
    engine = DecodeEngine(decoder, 2, max_len=32)
    engine.prefill(_prompt(decoder, 2, 8))
    first = engine.tokens.clone()
    run1 = [engine.step().clone() for _ in range(5)]
    engine.seek(8)
    engine.tokens.copy_(first)
    run2 = [engine.step().clone() for _ in range(5)]
    for a, b in zip(run1, run2):
        assert torch.equal(a, b)


def test_engine_refuses_to_overflow_the_cache():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    engine = DecodeEngine(model, 1, max_len=10)
    engine.prefill(_prompt(model, 1, 8))
    engine.step()
    engine.step()
    with pytest.raises(RuntimeError, match="cache is full"):
        engine.step()
    with pytest.raises(ValueError, match="does not fit"):
        engine.prefill(_prompt(model, 1, 10))


def test_own_cache_rewinds_only_to_the_prefill():
    """A cache the model makes itself is rewound from the copy kept at the end of the prefill, nowhere else."""
    model = load_model("tiny:mamba", torch.float32, torch.device("cpu"))
    engine = DecodeEngine(model, 1, max_len=16)
    engine.prefill(_prompt(model, 1, 8))
    engine.step()
    with pytest.raises(OptiqError, match="cannot be rewound to 5 positions"):
        engine.seek(5)


@torch.inference_mode()
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny:deepseek_v4"])
def test_own_cache_is_hfs_own_step_and_computes_what_the_static_one_does(preset):
    """``own_cache`` decodes on the cache the model makes (DynamicCache for Llama, DeepSeek-V4's own compressor
    caches, where optiq has a static cache of the family), and its logits are the static engine's."""
    model = load_model(preset, torch.float32, torch.device("cpu"))
    static, own = DecodeEngine(model, 2, max_len=48), DecodeEngine(model, 2, max_len=48, own_cache=True)
    assert static.static and not own.static and own.cache is None
    prompt = _prompt(model, 2, 21)
    static.prefill(prompt)
    own.prefill(prompt)
    assert type(own.cache).__module__.startswith("transformers") and own.cache is not static.cache
    for _ in range(5):
        torch.testing.assert_close(own.step(), static.step(), rtol=1e-4, atol=1e-4)
        assert torch.equal(own.tokens, static.tokens)
    with pytest.raises(OptiqError, match="cannot be rewound"):
        own.seek(22)


def test_graph_mode_problem_names_the_cache_a_graph_cannot_hold():
    """A model decoding with its own cache gets graph mode's one-line reason without a capture being tried."""
    model = load_model("tiny:mamba", torch.float32, torch.device("cpu"))
    problem = graph_mode_problem(model)
    assert "cannot capture" in problem and "LinearAttentionLayer" in problem and "\n" not in problem


def test_graph_mode_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeEngine(model, 1, max_len=16, mode="graph")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the H200 via device)")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe", "qwen3-0.6b"])
@pytest.mark.parametrize("batch", [1, 16])
@torch.inference_mode()
def test_graph_replay_equals_eager(preset, batch):
    """Replaying the captured step, with positions advancing, gives eager's logits and tokens step after step."""
    model = load_model(preset, torch.bfloat16, torch.device("cuda"))
    prompt = _prompt(model, batch, 40)
    runs = {}
    for mode in ("eager", "graph"):
        engine = DecodeEngine(model, batch, max_len=64, mode=mode)
        engine.prefill(prompt)
        runs[mode] = [(engine.step().float().clone(), engine.tokens.clone()) for _ in range(12)]
        engine.release()
    for (eager_logits, eager_tokens), (graph_logits, graph_tokens) in zip(runs["eager"], runs["graph"]):
        torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=0)
        assert torch.equal(graph_tokens, eager_tokens)
