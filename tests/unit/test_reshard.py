"""Reshard policies in one process: validation, pass-through behaviour, and the pure helpers of ``remesh``."""

from __future__ import annotations

import pytest
import torch

from rlcore.config.schema import FSDPConfig, RemeshingConfig
from rlcore.distributed.remesh import (
    RemeshPolicy,
    check_model,
    check_sizes,
    local_chunk,
    meta_skeleton,
    tp_plan,
)
from rlcore.distributed.reshard import FSDPReshardPolicy
from rlcore.errors import ConfigError
from rlcore.protocols import DistInfo, GenerationShare, ReshardPolicy
from rlcore.rollout.base import RolloutBatch, SamplingParams, slice_rollout
from rlcore.rollout.tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def tiny():
    return tiny_causal_lm("qwen2")


def remesh(t=1, g=1, enabled=True):
    return RemeshingConfig(enabled=enabled, training_shard_size=t, generation_shard_size=g)


@pytest.mark.parametrize("make", [lambda: FSDPReshardPolicy(FSDPConfig(), DistInfo()),
                                  lambda: RemeshPolicy(FSDPConfig(), remesh(), DistInfo())])
def test_single_process_is_a_pass_through(make, tiny):
    policy = make()
    assert isinstance(policy, ReshardPolicy)
    assert policy.prepare(tiny, "actor") is tiny
    with policy.generation(tiny) as gen:
        assert gen is tiny
    share = policy.generation_share([[1, 2]], SamplingParams())
    assert share == GenerationShare([[1, 2]], SamplingParams()) and share.own("batch") == "batch"
    assert policy.stats() == {}


def test_unknown_strategy_and_dtype_are_config_errors():
    with pytest.raises(ConfigError, match="sharding_strategy' = 'ZERO3'") as info:
        FSDPReshardPolicy(FSDPConfig(sharding_strategy="ZERO3", param_dtype="int8"), DistInfo())
    assert "param_dtype' = 'int8'" in str(info.value)


def test_remesh_sizes_must_divide_the_world():
    with pytest.raises(ConfigError) as info:
        check_sizes(remesh(t=3, g=0), 4)
    text = str(info.value)
    assert "actor.remeshing.training_shard_size' = 3 does not divide the world size 4" in text
    assert "divisors: 1, 2, 4" in text
    assert "actor.remeshing.generation_shard_size' = 0: must be an integer >= 1" in text
    with pytest.raises(ConfigError, match="generation_shard_size' = 2 does not divide the world size 1"):
        RemeshPolicy(FSDPConfig(), remesh(g=2), DistInfo())
    check_sizes(remesh(t=4, g=2), 8)


def test_remesh_sizes_must_divide_the_heads(tiny):
    check_model(tiny, 2)
    with pytest.raises(ConfigError, match="does not divide the model's num_key_value_heads = 2"):
        check_model(tiny, 4)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        check_model(torch.nn.Linear(2, 2), 2)


def test_remesh_plugin_answers_only_when_enabled():
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(["remesh"])
    on = pm.build("rlcore_reshard_policy", fsdp=FSDPConfig(), remeshing=remesh(), dist=DistInfo())
    off = pm.build("rlcore_reshard_policy", fsdp=FSDPConfig(), remeshing=remesh(enabled=False), dist=DistInfo())
    assert isinstance(on, RemeshPolicy)
    assert isinstance(off, FSDPReshardPolicy)


def test_tp_plan_covers_projections_embedding_and_head(tiny):
    plan = tp_plan(tiny)
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.1.mlp.down_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.up_proj"] == "colwise"
    assert plan["model.embed_tokens"] == "embedding" and plan["lm_head"] == "head"
    assert len(plan) == 2 * 7 + 2


def test_meta_skeleton_keeps_ties_and_uses_no_memory(tiny):
    skel = meta_skeleton(tiny, torch.bfloat16)
    assert skel.lm_head.weight is skel.model.embed_tokens.weight
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in skel.parameters())
    assert all(b.is_meta for b in skel.buffers())
    assert all(b.dtype == torch.float32 for b in skel.buffers())  # buffers keep their dtype (rotary tables)
    assert not any(p.is_meta for p in tiny.parameters())


@pytest.mark.parametrize("rows, parts", [(10, 4), (8, 2), (3, 4)])
def test_local_chunk_follows_torch_chunk(rows, parts):
    from torch.distributed.tensor import Replicate, Shard

    full = torch.arange(rows * 6.0).reshape(rows, 6)
    pieces = [local_chunk(full, Shard(0), i, parts) for i in range(parts)]
    assert torch.equal(torch.cat(pieces), full)
    assert [p.shape[0] for p in pieces] == [c.shape[0] for c in torch.chunk(full, parts)] + \
        [0] * (parts - len(torch.chunk(full, parts)))
    assert torch.equal(torch.cat([local_chunk(full, Shard(1), i, 2) for i in range(2)], dim=1), full)
    assert local_chunk(full, Replicate(), 1, parts) is full
    assert local_chunk(full, None, 0, parts) is full


def test_slice_rollout_drops_padding_the_rows_do_not_need():
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]]), prompt_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        response_ids=torch.tensor([[3, 2, 0], [4, 4, 4]]), response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        logprobs=torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]), stats={"rollout/seconds": 1.0})
    first = slice_rollout(batch, 0, 1)
    assert first.prompt_ids.tolist() == [[5, 6]] and first.prompt_mask.tolist() == [[1, 1]]
    assert first.response_ids.tolist() == [[3, 2]] and first.logprobs.tolist() == [[-1.0, -2.0]]
    second = slice_rollout(batch, 1, 2)
    assert second.prompt_ids.tolist() == [[7, 8, 9, 1]] and second.response_ids.shape == (1, 3)
    assert second.stats == {"rollout/seconds": 1.0}
    both = slice_rollout(batch, 0, 2)
    assert torch.equal(both.prompt_ids, batch.prompt_ids) and torch.equal(both.response_mask, batch.response_mask)


class FakeBackend:
    def __init__(self, module, kind):
        self.module, self.kind, self.syncs = module, kind, 0

    def sync_weights(self):
        self.syncs += 1


def test_generation_backends_build_inside_the_layout_then_refresh_only_after_a_change():
    from rlcore.trainer.generation import ActorGeneration, has_dtensor_params

    model = tiny_causal_lm("qwen2")  # its own: this test changes the weights
    assert not has_dtensor_params(model)
    made = []
    policy = FSDPReshardPolicy(FSDPConfig(), DistInfo())
    gen = ActorGeneration(model, policy, lambda m, tp: made.append(FakeBackend(m, tp)) or made[-1], 4)
    first = gen.backend(model)
    assert made == [first] and first.kind is False and first.syncs == 0
    assert gen.backend(model) is first and first.syncs == 0  # nothing changed since it read the weights
    gen.weights_changed()  # e.g. a checkpoint loaded
    assert gen.backend(model) is first and first.syncs == 1
    assert gen.backend(model) is first and first.syncs == 1
    with torch.no_grad():  # written in place without a word: the parameters' write counters tell
        next(model.parameters()).add_(1.0)
    assert gen.backend(model) is first and first.syncs == 2
    prebuilt = FakeBackend(model, False)
    gen = ActorGeneration(model, policy, lambda m, tp: pytest.fail("must not build"), 4, prebuilt={id(model): prebuilt})
    assert gen.backend(model) is prebuilt and prebuilt.syncs == 0  # built for the current weights already
    assert gen.backend(model) is prebuilt and prebuilt.syncs == 0
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # a fused step bumps no write counter
    gen.follow(optim)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optim.step()
    assert gen.backend(model) is prebuilt and prebuilt.syncs == 1
    assert gen.backend(model) is prebuilt and prebuilt.syncs == 1
