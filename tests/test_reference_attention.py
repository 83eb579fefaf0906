"""The fp32 reference's grouped decode attention computes what HF's sdpa path computes, without repeat_kv."""

from contextlib import nullcontext

import pytest
import torch
from transformers.modeling_utils import AttentionInterface

from optiq.models import load_model
from optiq.gate.references.attention import NAME, grouped_attention, grouped_decode_attention
import optiq.gate.references.fp32 as fp32_reference
from optiq.gate.end_to_end import decode


@pytest.mark.parametrize("num_q_heads, num_kv_heads, value_dim", [(8, 2, 16), (4, 4, 16), (4, 4, 8)])
@pytest.mark.parametrize("bool_mask", [True, False])
def test_matches_hf_sdpa_on_one_query_token(num_q_heads, num_kv_heads, value_dim, bool_mask):
    """GQA, MHA, and MLA's narrower values."""
    gen = torch.Generator().manual_seed(num_q_heads * 10 + num_kv_heads + value_dim + bool_mask)
    batch, length, dim = 3, 11, 16
    query = torch.randn(batch, num_q_heads, 1, dim, generator=gen)
    key = torch.randn(batch, num_kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, num_kv_heads, length, value_dim, generator=gen)
    filled = torch.tensor([11, 4, 7])
    mask = (torch.arange(length)[None, :] < filled[:, None])[:, None, None, :]
    if not bool_mask:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = num_q_heads // num_kv_heads, False, False
    want, _ = AttentionInterface._global_mapping["sdpa"](module, query.double(), key.double(), value.double(), mask
                                                         if bool_mask else mask.double(), scaling=0.3)
    got, weights = grouped_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None and got.shape == want.shape == (batch, 1, num_q_heads, value_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # a key past a sequence's filled length changes nothing; one inside does
    key[1, :, 5] += 10.0
    torch.testing.assert_close(grouped_attention(module, query, key, value, mask, scaling=0.3)[0], got)
    key[1, :, 2] += 10.0
    assert not torch.allclose(grouped_attention(module, query, key, value, mask, scaling=0.3)[0][1], got[1])


def test_a_reference_decode_is_hf_s_sdpa_decode(monkeypatch):
    """Tiny llama (GQA) computing in fp32: the same logits and picks with the grouped attention as through sdpa, and
    the model's own implementation back afterwards."""
    model = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    with grouped_decode_attention(model):
        assert model.config._attn_implementation == "optiq_reference"
    assert model.config._attn_implementation == "sdpa"
    calls = []
    monkeypatch.setitem(AttentionInterface._global_mapping, NAME,
                        lambda *args, **kwargs: calls.append(args[1].shape[2]) or grouped_attention(*args, **kwargs))
    with torch.inference_mode():
        grouped, grouped_picks = decode(model, prompt, 5, None, [], dtype=torch.float32)
    assert calls.count(1) == 5 * model.config.num_hidden_layers  # every decode step's layers, one query token each
    with torch.inference_mode():
        monkeypatch.setattr(fp32_reference, "grouped_decode_attention", lambda model: nullcontext())
        sdpa, sdpa_picks = decode(model, prompt, 5, None, [], dtype=torch.float32)
    torch.testing.assert_close(grouped, sdpa, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped_picks, sdpa_picks)
