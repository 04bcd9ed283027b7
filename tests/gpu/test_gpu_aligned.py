"""On a CUDA machine: the training forward's gradients stay finite at widths where the cuDNN attention
backward under a mask returns NaN (64 past a multiple of 128, left-padded rows; pytorch/pytorch#196678).
Skipped without CUDA; the CPU side of the fix is tested in tests/unit/test_aligned_forward.py."""

import os

import pytest
import torch

from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer.models import response_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("width", [192, 704, 1344])
def test_left_padded_rows_train_with_finite_gradients(width):
    model = tiny_causal_lm("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, max_position_embeddings=2048, vocab_size=512)
    model = model.to("cuda", torch.bfloat16).train()
    g = torch.Generator().manual_seed(0)
    batch, response = 6, width // 2
    ids = torch.randint(3, 512, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    for row in range(batch):
        mask[row, :int(torch.randint(1, 60, (1,), generator=g))] = 0
    ids, mask = ids.cuda(), mask.cuda()
    logp, _ = response_logprobs(model, ids, mask, response)
    assert torch.isfinite(logp).all()
    (logp.float() * torch.randn_like(logp.float())).sum().backward()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients at width {width}: {bad[:4]}"


#: the micro-batch that made every gradient NaN in the reasoning benchmark's warm-up (RLCORE_CHECK_FINITE
#: saved it: 10 samples x 1,344 columns, left padding 6-58): 1,344 is 64 past a multiple of 128
SAVED = os.path.join(os.path.dirname(__file__), "data", "nonfinite_micro_batch.pt")


@pytest.mark.slow
def test_the_saved_micro_batch_trains_with_finite_gradients():
    """Replayed through the actor's loss on a random Qwen2.5-1.5B-shaped model: finite gradients with
    the rows moved left (and with the mask at a width off the bad remainder). Before the fix, this
    micro-batch gave NaN gradients for all 328 parameters on an H100 (torch 2.11, cuDNN attention)."""
    from collections import defaultdict

    from transformers import Qwen2Config

    from rlcore.config.schema import PPOConfig
    from rlcore.rollout.tiny import causal_lm_from_config
    from rlcore.trainer import aligned
    from rlcore.trainer.experience import Experience
    from rlcore.trainer.update import actor_micro_loss

    saved = torch.load(SAVED)
    assert saved["input_ids"].shape[1] % 128 == 64
    config = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6)
    exp = Experience(input_ids=saved["input_ids"].cuda(), attention_mask=saved["attention_mask"].cuda(),
                     response_mask=saved["response_mask"].cuda(), old_logprobs=None,
                     scores=torch.zeros(len(saved["input_ids"]), device="cuda"),
                     advantages=saved["advantages"].cuda())
    for enabled in (True, False):
        model = causal_lm_from_config(config, dtype=torch.bfloat16, device="cuda", seed=0).train()
        aligned.ENABLED = enabled
        try:
            actor_micro_loss(model, exp, PPOConfig(), 1.0, 0.0, 1.0, defaultdict(list), packed=False)
        finally:
            aligned.ENABLED = True
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f"aligned={enabled}: {len(bad)} non-finite gradients, first {bad[:3]}"
        del model
        torch.cuda.empty_cache()
