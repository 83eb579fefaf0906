"""Greedy sampling must equal torch.argmax exactly: ties to the lowest index, first NaN wins, strided rows."""

import pytest
import torch

from optiq.fusions.greedy_sample import greedy_sample, greedy_sample_reference
from kernel_testing import SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

POISON = -1  # no valid token id


def make_logits(shape, dtype, device, seed, levels=None):
    """Random logits; with `levels`, only that many distinct values, so most rows hold ties for the max."""
    generator = torch.Generator().manual_seed(seed)
    if levels is None:
        logits = torch.randn(shape, generator=generator)
    else:
        logits = torch.randint(0, levels, shape, generator=generator).float()
    return logits.to(device=device, dtype=dtype)


def check(token_ids, logits):
    """Every id must be written and equal the float64 argmax (upcasting keeps order, so it is exact)."""
    assert not (token_ids == POISON).any(), "the kernel left poisoned ids unwritten"
    assert token_ids.dtype == torch.int64
    expected = greedy_sample_reference(logits.double())
    assert torch.equal(token_ids, expected), f"{token_ids.tolist()} != {expected.tolist()}"


def run_poisoned(logits):
    out = torch.full(logits.shape[:-1], POISON, dtype=torch.int64, device=logits.device)
    assert greedy_sample(logits, out=out) is out
    return out


@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 500), (1, 37), (2, 2, 515)])
def test_matches_argmax_small(request, shape, dtype, levels):
    """Each vocab splits into 16- or 32-wide tiles with a ragged, masked last one."""
    logits = make_logits(shape, dtype, SMALL_DEVICE, seed_of(request), levels)
    check(run_poisoned(logits), logits)


def test_nan_and_infinities_small():
    """As torch.argmax: the first NaN wins over everything, +inf over numbers, an all -inf row gives 0."""
    nan, inf = float("nan"), float("inf")
    logits = torch.zeros(5, 100, device=SMALL_DEVICE)
    logits[0, [70, 5]] = nan
    logits[1, [90, 40]] = inf
    logits[2] = -inf
    logits[3, [20, 80]] = inf
    logits[3, 60] = nan
    logits[4, 99] = 1.0
    out = run_poisoned(logits)
    assert out.tolist() == [5, 40, 0, 60, 99]
    assert torch.equal(out, greedy_sample_reference(logits))


def test_last_position_of_a_sequence(request):
    """logits[:, -1, :] of [batch, seq, vocab] is read in place through its row stride."""
    logits = make_logits((3, 4, 300), torch.float32, SMALL_DEVICE, seed_of(request))[:, -1, :]
    check(greedy_sample(logits), logits)


def test_hidden_maximum_fails_the_check(request):
    """The comparison can fail: sampling logits whose maxima were masked out is caught."""
    logits = make_logits((2, 500), torch.float32, SMALL_DEVICE, seed_of(request))
    masked = logits.scatter(-1, logits.argmax(-1, keepdim=True), float("-inf"))
    with pytest.raises(AssertionError):
        check(greedy_sample(masked), logits)


@needs_cuda
@pytest.mark.parametrize("levels", [None, 50])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("vocab", [128256, 151936])
def test_matches_argmax_cuda(request, vocab, rows, dtype, levels):
    logits = make_logits((rows, vocab), dtype, "cuda", seed_of(request), levels)
    token_ids = run_poisoned(logits)
    check(token_ids, logits)
    assert torch.equal(token_ids, greedy_sample_reference(logits))


@needs_cuda
def test_nan_cuda():
    logits = torch.zeros(2, 128256, device="cuda", dtype=torch.bfloat16)
    logits[0, [100000, 7000]] = float("nan")
    logits[1, 128255] = 1.0
    assert greedy_sample(logits).tolist() == greedy_sample_reference(logits).tolist() == [7000, 128255]


@needs_cuda
def test_cuda_graph_and_compile(request):
    logits = make_logits((16, 128256), torch.bfloat16, "cuda", seed_of(request))
    assert_graph_replay_and_compile(
        lambda: greedy_sample(logits),
        lambda: logits.copy_(make_logits((16, 128256), torch.bfloat16, "cuda", seed_of(request) + 1)),
        expect=lambda: greedy_sample_reference(logits))
