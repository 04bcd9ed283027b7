"""``split_k_few_rows``: batch buckets of at most ``FEW_ROWS`` rows decode with their own split-K of the
products (the tail of a long rollout), the others with ``split_k``; the tokens are the same."""

import pytest
import torch

from rlcore.config.loader import load_config
from rlcore.errors import ConfigError
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine, decode
from rlcore.rollout.engine import core as engine_core
from rlcore.rollout.tiny import tiny_causal_lm

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7], [100, 101, 102, 103], [50],
           [20, 21], [30, 31, 32], [40], [41, 42, 43, 44], [60, 61]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
LIMITS = [1 + i for i in range(len(PROMPTS))]  # rows end one after another: the batch shrinks through the buckets
FEW = {"o": 2, "gate_up": 2, "down": 2, "qkv": 2}


def test_few_row_buckets_take_their_own_split(monkeypatch):
    model = tiny_causal_lm("qwen2")
    plain = RolloutEngine(model, max_batch_size=16, max_seq_len=32, split_k=None).generate(PROMPTS, GREEDY,
                                                                                            max_new_tokens=LIMITS)
    engine = RolloutEngine(model, max_batch_size=16, max_seq_len=32, split_k=None, split_k_few_rows=FEW)
    assert engine.split_k == (1, 1, 1, 1) and engine.split_k_few_rows == (2, 2, 2, 2)
    used = []
    step = decode.decode

    def spy(weights, cache, state, n, length, cos, sin, fns, *args, **kwargs):
        used.append((n, fns is engine._fns_few))
        return step(weights, cache, state, n, length, cos, sin, fns, *args, **kwargs)

    monkeypatch.setattr(decode, "decode", spy)
    got = engine.generate(PROMPTS, GREEDY, max_new_tokens=LIMITS)
    assert {few for n, few in used if n <= engine_core.FEW_ROWS} == {True}
    assert {few for n, few in used if n > engine_core.FEW_ROWS} == {False}
    assert any(n > engine_core.FEW_ROWS for n, _ in used) and any(n <= engine_core.FEW_ROWS for n, _ in used)
    assert torch.equal(got.response_ids, plain.response_ids)
    torch.testing.assert_close(got.logprobs, plain.logprobs, atol=1e-5, rtol=0)


def test_the_same_split_builds_no_second_set():
    engine = RolloutEngine(tiny_causal_lm("qwen2"), max_batch_size=4, max_seq_len=16, split_k=FEW,
                           split_k_few_rows=FEW)
    assert engine._fns_few is None and engine.split_k_few_rows == engine.split_k
    assert RolloutEngine(tiny_causal_lm("qwen2"), max_batch_size=4, max_seq_len=16)._fns_few is None


def test_the_config_section_reaches_the_engine_and_is_checked():
    cfg = load_config([], ["actor.rollout_engine.split_k_few_rows.qkv=4", "actor.rollout_engine.split_k_few_rows.o=4"])
    from rlcore.config.schema import RolloutEngineConfig, SplitKConfig

    engine_cfg = RolloutEngineConfig(split_k_few_rows=SplitKConfig(**cfg.actor.rollout_engine.split_k_few_rows))
    assert engine_cfg.engine_kwargs()["split_k_few_rows"] == {"o": 4, "qkv": 4}
    assert RolloutEngineConfig().engine_kwargs()["split_k_few_rows"] is None
    with pytest.raises(ConfigError, match="split_k_few_rows"):
        load_config([], ["actor.rollout_engine.split_k_few_rows.down=0"])
