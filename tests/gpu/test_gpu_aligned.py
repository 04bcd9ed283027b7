"""On a CUDA machine: the training forward's gradients stay finite at widths where the cuDNN attention
backward under a mask returns NaN (64 past a multiple of 128, left-padded rows; pytorch/pytorch#196678).
Skipped without CUDA; the CPU side of the fix is tested in tests/unit/test_aligned_forward.py."""

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
