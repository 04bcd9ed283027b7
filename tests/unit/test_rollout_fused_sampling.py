"""The one-pass Triton sampler, run through Triton's interpreter on CPU when Triton is installed."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from rlcore.rollout.fused_sampling import plan, sample_rows  # noqa: E402

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
def test_sampling_follows_the_tempered_softmax_and_is_seeded():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * 1030).repeat(800, 1).to(DEVICE)
    tokens, logprobs = sample_rows(logits, 0.5, 123)
    again, _ = sample_rows(logits, 0.5, 123)
    other, _ = sample_rows(logits, 0.5, 124)
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)
    freq = torch.bincount(tokens.cpu(), minlength=4)[:4].float() / len(tokens)
    assert torch.allclose(freq, torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]) / 0.5, -1), atol=0.06)
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-4)


def test_splitting_rows_does_not_change_the_draw():
    logits = (torch.randn(3, 2500) * 2).to(DEVICE)
    assert plan(3, 2500)[0] == 3 and plan(3, 2500, splits=1) == (1, 3072)
    for temperature in (0.0, 0.8):
        whole = sample_rows(logits, temperature, 7, splits=1)
        split = sample_rows(logits, temperature, 7)
        assert torch.equal(whole[0], split[0])
        assert torch.allclose(whole[1], split[1], atol=1e-5)
