"""On a CUDA machine: compiled layers with ``recompute_pointwise`` keep fewer activations than the
default split (measured by the allocator) and give its gradients up to bf16 rounding (Inductor fuses
the recomputed pointwise work into other kernels than the forward's, so the bits may differ on CUDA;
on CPU they are equal, ``tests/integration/test_train_compile.py``). Skipped without CUDA."""

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_recomputing_pointwise_results_holds_less_memory_with_the_same_gradients():
    from rlcore.distributed.fsdp import compile_layers
    from rlcore.rollout.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("qwen2", hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                           num_key_value_heads=2, num_hidden_layers=4, vocab_size=1024,
                           max_position_embeddings=4096).to("cuda", torch.bfloat16)
    ids = torch.randint(3, 1024, (4, 2048), device="cuda")
    runs = {}
    for pointwise in (False, True):
        torch._dynamo.reset()
        m = compile_layers(copy.deepcopy(model), "actor", recompute_pointwise=pointwise)
        hidden = m.model(input_ids=ids).last_hidden_state  # compiles
        hidden.float().square().mean().backward()
        m.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        hidden = m.model(input_ids=ids).last_hidden_state
        kept = torch.cuda.memory_allocated() - before  # what the forward keeps for the backward
        hidden.float().square().mean().backward()
        runs[pointwise] = (kept, [p.grad.clone() for p in m.parameters()])
    assert runs[True][0] < 0.8 * runs[False][0], (runs[True][0], runs[False][0])
    for a, b in zip(runs[False][1], runs[True][1]):
        # same gradients up to bf16 rounding: the relative error of each tensor is a few bf16 ulps at most
        err = (a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)
        assert err < 2e-2, err
