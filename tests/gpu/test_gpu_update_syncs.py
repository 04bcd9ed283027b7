"""On a CUDA machine: an actor micro-batch shaped from the host's sizes reads nothing of the device (the
model's own check of its position ids for packed sequences answered without a read, as its rows are moved
left: rlcore.trainer.aligned.rows_not_packed), so the host queues the next micro-batch while this one runs
(``torch.cuda.set_sync_debug_mode``: a read raises).
Skipped without CUDA; its CPU side (the same update bit for bit) is tested in tests/unit/test_trainer_trim.py."""

from collections import defaultdict

import pytest
import torch

from rlcore.config.schema import PPOConfig
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer.experience import Experience
from rlcore.trainer.sizes import host_sizes
from rlcore.rollout.base import host_to_device
from rlcore.trainer.update import actor_micro_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _experience(batch=8, prompt=32, response=48, vocab=512) -> Experience:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    trained = torch.zeros(batch, response)
    for row in range(batch):
        mask[row, :int(torch.randint(0, prompt - 1, (1,), generator=g))] = 0
        length = int(torch.randint(1, response + 1, (1,), generator=g))
        trained[row, :length] = 1
        mask[row, prompt + length:] = 0
    advantages = torch.randn(batch, response, generator=g) * trained
    return Experience(input_ids=ids.cuda(), attention_mask=mask.cuda(), response_mask=trained.cuda(),
                      old_logprobs=torch.zeros(batch, response).cuda(), scores=torch.zeros(batch).cuda(),
                      advantages=advantages.cuda())


def test_a_micro_batch_with_the_host_sizes_reads_nothing_of_the_device():
    model = tiny_causal_lm("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, max_position_embeddings=2048, vocab_size=512)
    model = model.to("cuda", torch.bfloat16).train()
    exp = _experience()
    sizes = host_sizes(exp)
    group = torch.tensor([1, 4, 6])
    stats = defaultdict(list)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        idx = host_to_device(group, exp.input_ids.device)
        actor_micro_step(model, exp, idx, 1.0, stats, ppo=PPOConfig(), temperature=1.0, kl_loss_coef=0.0,
                         packed=False, recompute={}, used=sizes.used(group), known=sizes.known(group))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert torch.isfinite(torch.stack([v.float() for v in stats["loss/policy"]])).all()
