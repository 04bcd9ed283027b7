"""The Hugging Face ``generate`` backend and backend selection."""

from __future__ import annotations

import logging

import pytest
import torch

from rlcore.rollout import make_backend
from rlcore.rollout.base import RolloutBackend, SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.rollout.tiny import tiny_causal_lm

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


@pytest.fixture(scope="module")
def gpt2():
    return tiny_causal_lm("gpt2")


def teacher_forced(model, batch, temperature):
    ids, mask = batch.sequences()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = batch.prompt_ids.shape[1]
    scaled = logits[:, width - 1:-1] / temperature
    return torch.log_softmax(scaled, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)


def test_hf_logprobs_come_from_raw_logits(gpt2):
    # top-k/top-p change the sampling distribution, not the reported log-probs
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=5, top_p=0.9, seed=1)
    batch = HFGenerateBackend(gpt2).generate(PROMPTS, params)
    mask = batch.response_mask.bool()
    assert torch.allclose(batch.logprobs[mask], teacher_forced(gpt2, batch, 0.8)[mask], atol=1e-4)
    assert batch.prompt_ids.shape == (3, 5) and batch.prompt_mask[2].tolist() == [0, 0, 0, 0, 1]


def test_hf_seeded_and_eos_masking(gpt2):
    backend = HFGenerateBackend(gpt2)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    first, again = backend.generate(PROMPTS, params), backend.generate(PROMPTS, params)
    assert torch.equal(first.response_ids, again.response_ids)
    eos = int(first.response_ids[1, 2])
    stopped = backend.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=7,
                                                      eos_token_ids=(eos,)))
    assert stopped.response_mask[1, :3].tolist() == [1, 1, 1] and stopped.response_mask[1, 3:].sum() == 0
    assert torch.all(stopped.logprobs[stopped.response_mask == 0] == 0)
    assert not gpt2.training


def test_hf_restores_training_mode(gpt2):
    gpt2.train()
    try:
        HFGenerateBackend(gpt2).generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=0.0))
        assert gpt2.training
    finally:
        gpt2.eval()


def test_make_backend_auto_picks_engine_or_falls_back(gpt2, caplog):
    with caplog.at_level(logging.INFO, logger="rlcore.plugins.engine"):
        fallback = make_backend(gpt2, "auto", max_batch_size=4, max_seq_len=32)
    assert isinstance(fallback, HFGenerateBackend) and isinstance(fallback, RolloutBackend)
    assert "auto -> hf" in caplog.text
    batch = fallback.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert batch.response_ids.shape == (3, 4)
    fallback.sync_weights()
    engine = make_backend(tiny_causal_lm("qwen2"), "auto", max_batch_size=4, max_seq_len=32)
    assert isinstance(engine, RolloutEngine) and isinstance(engine, RolloutBackend)
    assert isinstance(make_backend(gpt2, "hf"), HFGenerateBackend)


def test_make_backend_errors(gpt2):
    with pytest.raises(ValueError, match="unknown; choose one of auto, engine, hf"):
        make_backend(gpt2, "vllm")
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        make_backend(gpt2, "engine", max_batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match="max_batch_size and max_seq_len"):
        make_backend(tiny_causal_lm("qwen2"), "engine")
