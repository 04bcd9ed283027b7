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
    ids = torch.randint(3, 512, (4, recompute.MEASURE_MIN_TOKENS), device="cuda")
    # the process's first backward allocates once what no micro-batch adds again (the library's
    # workspaces, the gradients): at this tiny shape that is more than the activations themselves
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    torch.cuda.synchronize()
    with policy.for_tokens(ids.numel()):
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    assert policy.measured_tokens == ids.numel()
    assert 0 < policy.measured_bytes_per_token < policy.estimated_bytes_per_token * 2


@pytest.mark.parametrize("selective", [False, True])
def test_a_partly_checkpointed_micro_batch_stays_within_the_memory_it_planned_for(monkeypatch, selective):
    """Once a micro-batch without checkpointing measured the rate, a micro-batch with the free memory set
    to about 60% of what it needs (85% with selective checkpointing) checkpoints some layers, not all,
    and its forward and backward add at most the memory the plan allowed."""
    model = tiny_causal_lm("qwen2", hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=3072, max_position_embeddings=8192,
                           vocab_size=4096)
    model = model.to("cuda", torch.bfloat16).train()
    enable_gradient_checkpointing(model, selective=selective)
    policy = recompute.Recompute(model, "auto", model.config, torch.device("cuda"), selective=selective)

    def step(ids):
        with policy.for_tokens(ids.numel()):
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        torch.cuda.synchronize()

    step(torch.randint(3, 4096, (2, 4096), device="cuda"))  # measures the rate (the device has room)
    assert policy.measured_tokens == 8192
    ids = torch.randint(3, 4096, (4, 4096), device="cuda")
    tokens = ids.numel()
    # selective checkpointing frees about half a layer's activations: it needs less of a shortfall to
    # checkpoint some layers and not all
    usable = (0.85 if selective else 0.6) * tokens * policy.bytes_per_token
    monkeypatch.setattr(recompute, "free_bytes", lambda device: usable / recompute.FREE_SHARE)  # gradients exist now
    count = policy.layers_needed(tokens)
    assert 0 < count < len(policy.layers)
    policy.take_metrics()
    with peak.window("cuda") as w:
        step(ids)
    assert policy.take_metrics()["actor/recompute_frac"] == count / len(policy.layers)
    assert 0 < w.above_base <= usable, (w.above_base / 1e6, usable / 1e6, count)
