"""Device sampling: filters, the exponential-race draw and the reported log-probs."""

from __future__ import annotations

import pytest
import torch

from rlcore.rollout.base import SamplingParams
from rlcore.rlmath import logprobs_from_logits
from rlcore.rollout.sampling import filter_top_k_top_p, make_generator, sample_next


def test_top_k_then_top_p_keep_the_nucleus():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept, index = filter_top_k_top_p(scores, top_k=3, top_p=0.7)
    assert index.tolist() == [[0, 1, 2]]
    assert torch.isfinite(kept).tolist() == [[True, True, False]]  # 0.5 < 0.7 <= 0.8
    kept, _ = filter_top_k_top_p(scores, top_k=0, top_p=0.01)
    assert torch.isfinite(kept).sum() == 1  # the top token always survives


def test_sampling_frequencies_follow_softmax_of_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    params = SamplingParams(temperature=0.5)
    tokens, logprobs = sample_next(logits, params, make_generator(0, "cpu"))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = torch.softmax(logits[0] / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.01)
    assert torch.allclose(logprobs, logprobs_from_logits(logits, tokens, 0.5))


def test_top_p_never_draws_outside_the_nucleus_but_reports_full_logprobs():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]]).repeat(2000, 1)
    tokens, logprobs = sample_next(logits, SamplingParams(top_p=0.6), make_generator(1, "cpu"))
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_greedy_reports_temperature_one_logprobs():
    logits = torch.randn(5, 11)
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0.0), None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("seed", [0, 123])
def test_same_seed_same_draw(seed):
    logits = torch.randn(8, 50)
    params = SamplingParams(temperature=1.0, top_k=10)
    first, _ = sample_next(logits, params, make_generator(seed, "cpu"))
    again, _ = sample_next(logits, params, make_generator(seed, "cpu"))
    assert torch.equal(first, again)


def test_keyed_uniforms_depend_only_on_seed_and_key_and_draw_the_softmax():
    from rlcore.rollout.sampling import keyed_uniforms, sample_keyed

    keys = torch.arange(20000)
    u = keyed_uniforms(3, keys)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(keyed_uniforms(3, keys.flip(0)).flip(0), u)
    assert not torch.equal(keyed_uniforms(4, keys), u)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).expand(20000, 5)
    tokens, logprobs = sample_keyed(logits, SamplingParams(temperature=1.0, max_new_tokens=1), u)
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015) and freq[4] == 0
    kept, _ = sample_keyed(logits, SamplingParams(temperature=1.0, top_k=2, max_new_tokens=1), u)
    assert set(kept.tolist()) == {0, 1}
