"""Scoring finished samples during the rollout gives the scores (order, values) of scoring after it."""

from __future__ import annotations

import pytest
import torch

from rlcore.rewards.backend import RewardPipeline
from rlcore.rewards.functions import FunctionReward
from rlcore.config.schema import FSDPConfig
from rlcore.distributed.reshard import FSDPReshardPolicy
from rlcore.protocols import DistInfo
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer.generation import ActorGeneration
from rlcore.trainer.scoring import RolloutRequest, StreamingScorer, merge_metrics, rows, score_rollout

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7], [100, 101, 102, 103], [50],
           [20, 21, 22]]


class CharTokenizer:
    """Decodes token ids as letters (enough for a reward function over text)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(97 + t % 26) for t in row) for row in ids]


def _reward(prompts, responses, **_):
    # batched: a score per sample from its text, plus a per-sample metric
    return [{"score": len(r) + 0.01 * sum(map(ord, r)) + 0.001 * len(p), "vowels": sum(c in "aeiou" for c in r)}
            for p, r in zip(prompts, responses)]


def _pipeline():
    return RewardPipeline([(FunctionReward("chars", _reward), 1.0)])


def _rollout(on_finished=None, micro=8):
    model = tiny_causal_lm("qwen2")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, eos_token_ids=(5, 17, 40, 77),
                            pad_token_id=0)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=32, eos_check_interval=1)
    generation = ActorGeneration(model, FSDPReshardPolicy(FSDPConfig(), DistInfo()), lambda module, tp: engine, micro)
    return generation.generate(PROMPTS, params, on_finished=on_finished)


def _request():
    return RolloutRequest([f"p{i}" for i in range(len(PROMPTS))], PROMPTS, {"ground_truth": list(range(len(PROMPTS)))})


@pytest.mark.parametrize("micro", [8, 3])
def test_engine_reports_each_sample_once_with_its_final_tokens(micro):
    calls = []
    batch = _rollout(lambda idx, resp: calls.append((idx, resp)), micro=micro)
    final = rows(batch.response_ids, batch.response_mask)
    lengths = {len(r) for r in final}
    assert len(lengths) > 2 and len(calls) > 2  # samples finish at different steps, reported as they do
    seen = [i for idx, _ in calls for i in idx]
    assert sorted(seen) == list(range(len(PROMPTS)))
    for idx, resp in calls:
        assert [final[i] for i in idx] == resp


def test_streamed_scores_equal_scores_after_the_rollout():
    tok, reward = CharTokenizer(), _pipeline()
    after = score_rollout(reward, tok, _request(), _rollout())
    scorer = StreamingScorer(reward, tok, _request())
    try:
        batch = _rollout(scorer)
        # a chunk retried after an out-of-memory error may have reported samples with other tokens first
        scorer([1, 2], [[9, 9, 9], rows(batch.response_ids, batch.response_mask)[2]])
        streamed = scorer.finish(batch)
    finally:
        scorer.close()
    assert torch.equal(streamed[0], after[0]) and after[0].std() > 0
    assert streamed[1].keys() == after[1].keys()
    for key in after[1]:
        assert streamed[1][key] == pytest.approx(after[1][key], rel=1e-6), key
    assert scorer.streamed_frac == 1.0


def test_a_failing_reward_raises_at_the_end_of_the_rollout():
    def broken(prompts, responses, **_):
        raise RuntimeError("reward down")

    scorer = StreamingScorer(RewardPipeline([(FunctionReward("broken", broken), 1.0)]), CharTokenizer(), _request())
    try:
        batch = _rollout(scorer)
        with pytest.raises(Exception, match="reward down"):
            scorer.finish(batch)
    finally:
        scorer.close()


def test_merge_metrics():
    parts = [(3, {"reward/x": 1.0, "reward/errors": 1.0, "time/reward_model_s": 0.5}),
             (1, {"reward/x": 5.0, "reward/errors": 2.0, "time/reward_model_s": 0.25})]
    assert merge_metrics(parts) == {"reward/x": 2.0, "reward/errors": 3.0, "time/reward_model_s": 0.75}


def _failing_reward(fail):
    def score(prompt, response, **_):
        if fail(response):
            raise ValueError("bad sample")
        return float(len(response))
    return score


@pytest.mark.parametrize("most_fail", [False, True])
def test_fallback_share_is_judged_on_the_whole_streamed_step(most_fail):
    from collections import Counter

    from rlcore.errors import RewardError

    lengths = [len(r) for r in rows(*(lambda b: (b.response_ids, b.response_mask))(_rollout()))]
    rare = min(Counter(lengths).items(), key=lambda kv: kv[1])[0]  # a length few samples have
    assert lengths.count(rare) < len(lengths) / 2
    fails = (lambda r: True) if most_fail else (lambda r: len(r) == rare)
    pipeline = RewardPipeline([(FunctionReward("f", _failing_reward(fails), fallback=0.0), 1.0)],
                              count_errors=True, max_fallback_share=0.5)
    scorer = StreamingScorer(pipeline, CharTokenizer(), _request())
    try:
        batch = _rollout(scorer)
        if most_fail:
            with pytest.raises(RewardError, match="max_fallback_share"):
                scorer.finish(batch)
        else:  # a group in which every sample failed is not a step in which most did
            _, metrics = scorer.finish(batch)
            assert metrics["reward/errors"] == lengths.count(rare) and scorer.streamed_frac == 1.0
    finally:
        scorer.close()
    assert pipeline.defer_share_check is False
