"""The engine's decode-step options on tiny CPU models: attention kinds, attention-length buckets,
unpadded prefill, compilation and its fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from rlcore.rollout.engine import decode
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine, length_step
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.rollout.tiny import tiny_causal_lm

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7], [100, 101, 102, 103], [50]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def qwen2():
    return tiny_causal_lm("qwen2")


@pytest.fixture(scope="module")
def eos_case(qwen2):
    """Greedy with an EOS that ends some rows early, and HF's answer."""
    eos = int(HFGenerateBackend(qwen2).generate(PROMPTS, GREEDY).response_ids[2, 1])
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_ids=(eos,))
    return params, HFGenerateBackend(qwen2).generate(PROMPTS, params)


@pytest.mark.parametrize("attention", ["sdpa"])
def test_short_attention_lengths_with_slot_reuse_match_hf(qwen2, eos_case, attention):
    params, expected = eos_case
    assert expected.response_mask.sum(-1).min() < 10  # some rows stop early and free their slot
    engine = RolloutEngine(qwen2, max_batch_size=3, max_seq_len=24, admit_fraction=0.0, eos_check_interval=1,
                           attention=attention, attention_length_step=4)
    assert engine.length_buckets == [4, 8, 12, 16, 20, 24]
    got = engine.generate(PROMPTS, params)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.response_mask, expected.response_mask)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)


def test_freed_slots_keep_a_visible_key(qwen2, eos_case):
    """Freed slots still run (their output is dropped) until reused; with attention cut to a short
    length a row with no visible key would turn to NaN and poison its cache row for the next prompt."""
    params, _ = eos_case
    engine = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=24, admit_fraction=0.5, eos_check_interval=1,
                           attention_length_step=4)
    engine.generate(PROMPTS, params)
    assert (engine.state.bias[:, 0] == 0).all()


def test_prompts_of_one_length_take_the_causal_prefill(qwen2):
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5, 5]]
    expected = HFGenerateBackend(qwen2).generate(prompts, GREEDY)
    got = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=16).generate(prompts, GREEDY)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_wide_padded_prompts_attend_row_by_row_as_under_the_mask(qwen2, kv_cache, monkeypatch):
    """Left-padded prompts at least ``ROW_ATTENTION_WIDTH`` wide are prefilled with each row attending over
    its own tokens (no mask): the same tokens and log-probs as under the mask, and as HF's."""
    from rlcore.rollout.engine import llama

    calls = []
    row_attention = llama._row_attention
    monkeypatch.setattr(llama, "_row_attention", lambda *a: calls.append(a[3]) or row_attention(*a))
    kwargs = dict(max_batch_size=8, max_seq_len=32, kv_cache=kv_cache, page_size=16)
    masked = RolloutEngine(qwen2, **kwargs).generate(PROMPTS, GREEDY)
    assert calls == []  # the prompts are narrower than the default width
    monkeypatch.setattr(llama, "ROW_ATTENTION_WIDTH", 4)
    by_row = RolloutEngine(qwen2, **kwargs).generate(PROMPTS, GREEDY)
    assert calls and sorted(set(calls[0])) == sorted({8 - len(p) for p in PROMPTS})  # each row's own padding
    expected = HFGenerateBackend(qwen2).generate(PROMPTS, GREEDY)
    for got in (masked, by_row):
        assert torch.equal(got.response_ids, expected.response_ids)
        assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)
    assert torch.allclose(by_row.logprobs, masked.logprobs, atol=1e-5)


def test_length_buckets_are_coarser_for_long_caches():
    assert length_step(384) == 64 and length_step(1024) == 64
    assert length_step(4096) == 256 and length_step(10**6) == 4096


def test_a_failing_compiled_step_falls_back_to_the_plain_one(qwen2, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    real = decode.step_functions

    def fake(spec, compile_mode=None, rope_in_attention=False, split_k=(1, 1, 1, 1), mlp_transposed=False):
        plain = real(spec, rope_in_attention=rope_in_attention, split_k=split_k, mlp_transposed=mlp_transposed)
        return plain if compile_mode is None else decode.StepFunctions(broken, broken, broken, compiled=True,
                                                                        spec=spec)

    monkeypatch.setattr(decode, "step_functions", fake)
    engine = RolloutEngine(qwen2, max_batch_size=8, max_seq_len=24, compile=True)
    assert engine.compile
    with caplog.at_level(logging.WARNING, logger="rlcore.rollout.engine"):
        got = engine.generate(PROMPTS, GREEDY)
    assert not engine.compile and "inductor exploded" in caplog.text
    assert torch.equal(got.response_ids, HFGenerateBackend(qwen2).generate(PROMPTS, GREEDY).response_ids)


def test_engine_option_errors(qwen2):
    with pytest.raises(ValueError, match="attention"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12, attention="flash9")
    with pytest.raises(ValueError, match="compile_mode"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12, compile_mode="reduce-overhead")
    assert not RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12).compile  # off by default on CPU
    with pytest.raises(ValueError, match="split_k keys \\['v'\\]"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12, split_k={"v": 2})
    with pytest.raises(ValueError, match="mlp_transposed must be"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12, mlp_transposed="yes")
    with pytest.raises(ValueError, match="split_k\\['down'\\] must be a positive integer"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12, split_k={"down": 0})
    with pytest.raises(ValueError, match="split_k must be 'auto', None or a mapping"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12, split_k="fast")
    default = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12)  # "auto": off uncompiled
    assert default.split_k == (1, 1, 1, 1) and not default.mlp_transposed


def test_split_products_sum_to_the_plain_product():
    x, weight, bias = torch.randn(5, 24, dtype=torch.float64), torch.randn(7, 24, dtype=torch.float64), torch.randn(7)
    for splits in (1, 2, 3, 4, 5):
        parts = decode._partials(x, weight, bias.double(), splits)
        assert parts.shape == (splits if 24 % splits == 0 else 1, 5, 7)
        assert torch.allclose(parts.sum(0), torch.nn.functional.linear(x, weight, bias.double()))
        # the input stored transposed ([24, 5] seen as [5, 24]): the same slices
        stored = decode._partials(x.t().contiguous().t(), weight, bias.double(), splits)
        assert torch.allclose(stored, parts)


@pytest.mark.parametrize("split_k, transposed", [({"down": 4}, False), ({"o": 2, "gate_up": 2, "down": 2}, False),
                                                 ({"qkv": 2, "down": 4}, True)])
def test_split_k_step_matches_hf(qwen2, eos_case, split_k, transposed):
    """Split-K products (the partial sums added by the next kernel) and the transposed gate/up
    product give HF's greedy tokens and log-probs."""
    params, expected = eos_case
    engine = RolloutEngine(qwen2, max_batch_size=3, max_seq_len=24, admit_fraction=0.0, eos_check_interval=1,
                           split_k=split_k, mlp_transposed=transposed, share_weights=False)
    assert engine.split_k == tuple(split_k.get(k, 1) for k in decode.SPLIT_K_KEYS)
    got = engine.generate(PROMPTS, params)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("split_k", [None, decode.AUTO_SPLIT_K])
def test_compiled_step_matches_hf_on_cpu(qwen2, eos_case, split_k):
    """torch.compile (Inductor's C++ backend here) gives the same greedy tokens, also while slots
    are freed, refilled and compacted (several batch buckets, several compiled shapes), with and
    without split-K products (their partial sums compiled into the next kernel)."""
    params, expected = eos_case
    engine = RolloutEngine(qwen2, max_batch_size=3, max_seq_len=24, admit_fraction=0.0, eos_check_interval=1,
                           compile=True, split_k=split_k)
    assert engine.split_k == decode.split_k_tuple(split_k)
    got = engine.generate(PROMPTS, params)
    assert engine.compile, "compilation fell back to the plain step"
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)


@pytest.mark.slow
def test_compiled_qwen3_step_matches_hf_on_cpu():
    """The compiled step with Qwen3's per-head q/k norms (and the q/k/v product in slices summed
    before them) gives HF's greedy tokens."""
    model = tiny_causal_lm("qwen3")
    expected = HFGenerateBackend(model).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=24, compile=True, split_k={"qkv": 2},
                           share_weights=False)
    got = engine.generate(PROMPTS, GREEDY)
    assert engine.compile, "compilation fell back to the plain step"
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)
