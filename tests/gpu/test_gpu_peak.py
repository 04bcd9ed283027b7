"""On a CUDA machine: a peak-memory window measures its own work and the run's peak survives it; the
activation rate ``gradient_checkpointing=auto`` measures is below the shape's estimate. Skipped without CUDA."""

import pytest
import torch

from rlcore.distributed.fsdp import enable_gradient_checkpointing
from rlcore.observe import peak
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import recompute

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_window_measures_its_work_and_keeps_the_runs_peak():
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB, then freed: the run's peak
    del big
    before = peak.max_allocated("cuda")
    assert before >= 256 << 20
    with peak.window("cuda") as w:
        small = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
        del small
    assert (16 << 20) <= w.above_base < (64 << 20)
    assert peak.max_allocated("cuda") == before  # the window's reset did not lose the earlier peak


def test_auto_measures_activations_of_a_micro_batch_without_checkpointing():
    model = tiny_causal_lm("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, max_position_embeddings=4096, vocab_size=512)
    model = model.to("cuda", torch.bfloat16).train()
    enable_gradient_checkpointing(model)
    policy = recompute.Recompute(model, "auto", model.config, torch.device("cuda"))
    ids = torch.randint(3, 512, (2, recompute.MEASURE_MIN_TOKENS), device="cuda")
    with policy.for_tokens(ids.numel()):
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    assert policy.measured_tokens == ids.numel()
    assert 0 < policy.measured_bytes_per_token < policy.estimated_bytes_per_token * 2
