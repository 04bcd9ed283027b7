"""``ppo.rollout_batch_size=auto``: the sizing rule and the out-of-memory retry."""

from __future__ import annotations

import pytest
import torch

from rlcore.config.schema import FSDPConfig
from rlcore.distributed.reshard import FSDPReshardPolicy
from rlcore.protocols import DistInfo
from rlcore.rollout.autosize import CPU_DEFAULT_BATCH_SIZE, auto_rollout_batch_size, estimate_sample_bytes
from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad
from rlcore.rollout.tiny import tiny_config

GIB = 2**30


def test_rule_uses_free_memory_times_fraction_over_sample_bytes():
    # 80 GB free x 0.6 / 1.2 GB per sample = 40, the classic example
    assert auto_rollout_batch_size(sample_bytes=int(1.2 * GIB), free_bytes=80 * GIB) == 40
    assert auto_rollout_batch_size(sample_bytes=int(1.2 * GIB), free_bytes=80 * GIB, multiple_of=8) == 40
    assert auto_rollout_batch_size(sample_bytes=GIB, free_bytes=80 * GIB, multiple_of=8) == 48
    assert auto_rollout_batch_size(sample_bytes=GIB, free_bytes=80 * GIB, maximum=16) == 16
    assert auto_rollout_batch_size(sample_bytes=100 * GIB, free_bytes=GIB, multiple_of=4) == 4


def test_cpu_gets_the_documented_default():
    assert auto_rollout_batch_size(sample_bytes=1000, device="cpu") == CPU_DEFAULT_BATCH_SIZE
    assert auto_rollout_batch_size(sample_bytes=1000, device="cpu", multiple_of=6) == 12
    assert auto_rollout_batch_size(device="cpu", n=4) == CPU_DEFAULT_BATCH_SIZE // 4


def test_prompts_from_a_saved_config_and_samples_per_prompt(tmp_path):
    config = tiny_config("qwen2")
    config.save_pretrained(tmp_path)
    per_sample = estimate_sample_bytes(config, 96)
    free = 1000 * per_sample
    assert auto_rollout_batch_size(model_path=str(tmp_path), max_len=96, free_bytes=free, n=4) == 150
    assert auto_rollout_batch_size(config=config, max_len=96, free_bytes=free) == 600
    with pytest.raises(ValueError, match="max_len"):
        auto_rollout_batch_size(config=config, free_bytes=free)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="sample_bytes"):
        auto_rollout_batch_size(sample_bytes=0, free_bytes=GIB)
    with pytest.raises(ValueError, match="fraction"):
        auto_rollout_batch_size(sample_bytes=1, free_bytes=GIB, fraction=1.5)


def test_estimate_grows_with_length_and_counts_the_kv_cache():
    config = tiny_config("qwen2")
    short, long = estimate_sample_bytes(config, 64), estimate_sample_bytes(config, 128)
    kv_per_token = 2 * 2 * 2 * 16 * 2  # k/v x layers x kv heads x head dim x bf16
    assert long - short >= 64 * kv_per_token


def _fake_generate(limit: int, calls: list):
    def generate(prompts, params):
        calls.append((len(prompts), params.seed))
        if len(prompts) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        ids, mask = left_pad(prompts, params.pad_token_id)
        resp = torch.tensor([[p[0]] for p in prompts])
        return RolloutBatch(ids, mask, resp, torch.ones_like(resp), torch.zeros(len(prompts), 1))
    return generate


class _Backend:
    def __init__(self, generate):
        self.generate = generate

    def sync_weights(self):
        pass


def _generation(generate, micro_batch: int, **kw):
    from rlcore.trainer.generation import ActorGeneration

    return ActorGeneration(torch.nn.Linear(1, 1), FSDPReshardPolicy(FSDPConfig(), DistInfo()),
                           lambda module, tp: _Backend(generate), micro_batch, **kw)


def test_oom_halves_the_micro_batch_and_loses_no_sample():
    calls: list = []
    runner = _generation(_fake_generate(3, calls), 8)
    prompts = [[i, i] for i in range(11)] + [[99]]
    batch = runner.generate(prompts, SamplingParams(seed=10))
    assert batch.response_ids[:, 0].tolist() == [p[0] for p in prompts]
    assert runner.micro_batch == 2 and runner.retries == 2
    assert calls[:3] == [(8, 10), (4, 10), (2, 10)] and calls[3] == (2, 12)
    assert batch.prompt_ids.shape == (12, 2) and batch.prompt_mask[-1].tolist() == [0, 1]


def test_oom_at_the_minimum_is_raised():
    with pytest.raises(torch.OutOfMemoryError):
        _generation(_fake_generate(1, []), 2, minimum=2).generate([[1], [2]], SamplingParams())
    with pytest.raises(RuntimeError, match="boom"):
        _generation(lambda p, s: (_ for _ in ()).throw(RuntimeError("boom")), 4).generate([[1]], SamplingParams())


@pytest.mark.parametrize("continuous", [True, False])
def test_a_whole_rollout_goes_to_a_continuous_batching_backend_in_one_call(continuous):
    """``whole=True``: a backend that queues prompts beyond its slots (``continuous_batching``) gets them
    all in one call; another backend still gets micro-batches."""
    calls: list = []
    runner = _generation(_fake_generate(100, calls), 4)
    backend = runner.backend(runner.actor)
    backend.continuous_batching = continuous
    prompts = [[i] for i in range(10)]
    batch = runner.generate(prompts, SamplingParams(seed=1), whole=True)
    assert batch.response_ids[:, 0].tolist() == list(range(10))
    assert [n for n, _ in calls] == ([10] if continuous else [4, 4, 2])


def test_a_whole_call_out_of_memory_falls_back_to_micro_batches():
    calls: list = []
    runner = _generation(_fake_generate(4, calls), 4)
    runner.backend(runner.actor).continuous_batching = True
    batch = runner.generate([[i] for i in range(10)], SamplingParams(seed=1), whole=True)
    assert batch.response_ids[:, 0].tolist() == list(range(10))
    assert [n for n, _ in calls] == [10, 4, 4, 2] and runner.micro_batch == 4
