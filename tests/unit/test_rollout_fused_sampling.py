"""The one-pass Triton sampler, run through Triton's interpreter on CPU when Triton is installed."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from rlcore.kernels.fused_sampling import DRAW_CHUNK, plan, sample_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_greedy_and_logprobs_match_torch():
    logits = (torch.randn(6, 3000) * 3).to(DEVICE)
    logits[2, 2999] = 50.0  # winner in the ragged last block
    logits[3, :2] = 40.0  # tie: the first index wins, as torch.argmax
    tokens, logprobs = sample_rows(logits, 0.0, 0)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cdf", "gumbel"])
@pytest.mark.parametrize("at", [0, DRAW_CHUNK - 2, 2 * DRAW_CHUNK + 100])  # first, straddling, last (ragged) chunk
def test_sampling_follows_the_tempered_softmax_and_is_seeded(method, at):
    row = torch.full((2 * DRAW_CHUNK + 300,), -30.0)
    row[at:at + 4] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    row[-1] = float("-inf")  # never drawn
    logits = row.repeat(800, 1).to(DEVICE)
    tokens, logprobs = sample_rows(logits, 0.5, 123, method=method)
    again, _ = sample_rows(logits, 0.5, 123, method=method)
    other, _ = sample_rows(logits, 0.5, 124, method=method)
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)
    assert ((tokens >= at) & (tokens < at + 4)).float().mean() > 0.99  # the -30 logits hold < 1e-20 of the mass
    freq = torch.bincount((tokens - at).clamp(0, 4).cpu(), minlength=5)[:4].float() / len(tokens)
    assert torch.allclose(freq, torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]) / 0.5, -1), atol=0.06)
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-4)


def test_inverse_cdf_draw_matches_the_softmax_over_many_tokens():
    """Mass spread over chunks: each row draws from its own softmax (checked by the mean probability
    rank of the drawn tokens) and its log-probability is the tempered log-softmax."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 3 * DRAW_CHUNK, generator=gen) * 2).to(DEVICE)
    tokens, logprobs = sample_rows(logits, 0.7, 11, method="cdf")
    probs = torch.softmax(logits.float().cpu() / 0.7, -1)
    expected = torch.log(probs.gather(-1, tokens.cpu()[:, None])).squeeze(-1)
    assert torch.allclose(logprobs.cpu(), expected, atol=1e-4)
    # under the model, P(token drawn has probability below the row's median-by-mass) is 1/2 per row
    order = probs.sort(-1, descending=True)
    cum = order.values.cumsum(-1)
    rank = (order.indices == tokens.cpu()[:, None]).float().argmax(-1)
    upper_half = (cum.gather(-1, rank[:, None]).squeeze(-1) <= 0.5).float().mean()
    assert 0.3 < upper_half < 0.7


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method 'topk'"):
        sample_rows(torch.randn(2, 10).to(DEVICE), 1.0, 0, method="topk")


def test_splitting_rows_does_not_change_the_draw():
    logits = (torch.randn(3, 2500) * 2).to(DEVICE)
    assert plan(3, 2500)[0] == 3 and plan(3, 2500, splits=1) == (1, 3072)
    for temperature, method in ((0.0, "cdf"), (0.8, "gumbel")):
        whole = sample_rows(logits, temperature, 7, splits=1, method=method)
        split = sample_rows(logits, temperature, 7, method=method)
        assert torch.equal(whole[0], split[0])
        assert torch.allclose(whole[1], split[1], atol=1e-5)


def test_keyed_draws_match_the_pytorch_inverse_cdf():
    """Given per-row uniforms, the kernel's inverse-CDF draw picks the token the PyTorch path picks
    from the same uniforms, and the same uniforms give the same tokens whatever the row order."""
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.sampling import keyed_uniforms, sample_keyed

    logits = (torch.randn(5, 3000) * 2).to(DEVICE)
    uniforms = keyed_uniforms(7, torch.arange(5, device=DEVICE) * 1000 + 3)
    tokens, logprobs = sample_rows(logits, 0.8, 0, uniforms=uniforms)
    ref, ref_lp = sample_keyed(logits, SamplingParams(temperature=0.8), uniforms)
    assert torch.equal(tokens, ref)
    assert torch.allclose(logprobs, ref_lp, atol=1e-4)
    flipped, _ = sample_rows(logits.flip(0), 0.8, 0, uniforms=uniforms.flip(0))
    assert torch.equal(flipped.flip(0), tokens)


@pytest.mark.parametrize("seed", [7, 2**40 + 12345, 2**62 - 1])
def test_keys_hashed_in_the_kernel_draw_as_the_keyed_uniforms(seed):
    """Keys hashed inside the kernel give the tokens of the uniforms ``keyed_uniforms`` computes (the same
    bits): on a flat distribution over 3,000 tokens the token is the uniform to 1 part in 3,000; keys and
    seeds past 2^32 included."""
    from rlcore.rollout.sampling import keyed_uniforms

    logits = torch.zeros(64, 3000, device=DEVICE)
    keys = torch.arange(64, device=DEVICE) * 7919 + torch.tensor([0, 2**33 + 5], device=DEVICE).repeat(32)
    want, want_lp = sample_rows(logits, 1.0, 0, uniforms=keyed_uniforms(seed, keys))
    got, got_lp = sample_rows(logits, 1.0, 0, keys=keys, key_seed=seed)
    assert torch.equal(got, want) and torch.equal(got_lp, want_lp)
    assert len(set(got.tolist())) > 50  # the keys draw apart
    other, _ = sample_rows(logits, 1.0, 0, keys=keys, key_seed=seed + 1)
    assert not torch.equal(other, got)
    with pytest.raises(ValueError, match="not both"):
        sample_rows(logits, 1.0, 0, uniforms=keyed_uniforms(seed, keys), keys=keys)
