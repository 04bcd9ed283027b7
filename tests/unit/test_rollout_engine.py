"""The rollout engine against Hugging Face ``generate`` and teacher forcing, on tiny CPU models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.testing import teacher_forced_logprobs

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7], [100, 101, 102, 103], [50]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def qwen2():
    return tiny_causal_lm("qwen2")


def hf_greedy(model, params=GREEDY, prompts=PROMPTS):
    return HFGenerateBackend(model).generate(prompts, params)


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", {}),
    ("llama", {}),
    ("mistral", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "rope_theta": 500000.0, "num_key_value_heads": 4}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ("llama3", {}),
    ("qwen3", {}),
    ("qwen3", {"attention_bias": True, "num_key_value_heads": 1, "tie_word_embeddings": False}),
])
def test_greedy_matches_hf_generate(family, overrides):
    model = tiny_causal_lm(family, **overrides)
    expected = hf_greedy(model)
    assert len(set(expected.response_ids.flatten().tolist())) > 10  # the model does not just repeat
    got = RolloutEngine(model, max_batch_size=8, max_seq_len=24).generate(PROMPTS, GREEDY)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.prompt_ids, expected.prompt_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)


def test_eos_mid_batch_matches_hf(qwen2):
    plain = hf_greedy(qwen2)
    eos = int(plain.response_ids[0, 3])  # a token the greedy path really emits
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_ids=(eos,), pad_token_id=0)
    expected = hf_greedy(qwen2, params)
    assert expected.response_mask[0].sum() < 10 and expected.response_mask.sum(-1).max() == expected.response_ids.shape[1]
    got = RolloutEngine(qwen2, max_batch_size=8, max_seq_len=24).generate(PROMPTS, params)
    assert torch.equal(got.response_mask, expected.response_mask)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.all(got.logprobs[got.response_mask == 0] == 0)


@pytest.mark.parametrize("slots", [3, 1])
def test_continuous_batching_more_prompts_than_slots(qwen2, slots):
    plain = hf_greedy(qwen2)
    eos = int(plain.response_ids[2, 1])
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_ids=(eos,))
    expected = hf_greedy(qwen2, params)
    engine = RolloutEngine(qwen2, max_batch_size=slots, max_seq_len=24, admit_fraction=0.0, eos_check_interval=2)
    got = engine.generate(PROMPTS, params)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.equal(got.response_mask, expected.response_mask)
    assert got.stats["rollout/prefill_calls"] > 1


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sampled_logprobs_match_teacher_forcing(qwen2, family):
    model = qwen2 if family == "qwen2" else tiny_causal_lm(family)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=5)
    batch = RolloutEngine(model, max_batch_size=4, max_seq_len=24).generate(PROMPTS, params)
    reference = teacher_forced_logprobs(model, batch, 0.7)
    mask = batch.response_mask.bool()
    assert torch.allclose(batch.logprobs[mask], reference[mask], atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_bf16_logprobs_are_no_further_from_the_trainer_than_hf_generates(family):
    """In bf16 the engine rounds as the HF model does (projection before the residual add, each RoPE
    product before the sum), so its sampled log-probs are no further from teacher forcing than
    HF ``generate``'s (rounding a fused sum once put them about 4x further)."""
    from rlcore.rlmath import logprob_mismatch
    from rlcore.trainer.experience import batched_logprobs

    model = tiny_causal_lm(family, dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=0)
    gaps = {}
    for name, backend in (("engine", RolloutEngine(model, max_batch_size=len(PROMPTS), max_seq_len=40)),
                          ("hf", HFGenerateBackend(model))):
        batch = backend.generate(PROMPTS, params)
        ids, mask = batch.sequences()
        trainer = batched_logprobs(model, ids, mask, batch.response_ids.shape[1], 1.0, 8, batch.response_mask)
        gaps[name] = float(logprob_mismatch(batch.logprobs.float(), trainer, batch.response_mask)["abs_diff_mean"])
    assert gaps["engine"] <= gaps["hf"], gaps


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy(qwen2):
    engine = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=24)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, seed=11)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, seed=12))
    assert torch.equal(first.response_ids, again.response_ids)
    assert not torch.equal(first.response_ids, other.response_ids)
    top1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1, seed=3))
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert torch.equal(top1.response_ids, greedy.response_ids)


@pytest.mark.parametrize("share", [True, False])
def test_sync_weights_follows_training_updates(share):
    model = tiny_causal_lm("llama")
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=24, share_weights=share)
    before = engine.generate(PROMPTS, GREEDY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    engine.sync_weights()
    after = engine.generate(PROMPTS, GREEDY)
    assert not torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(after.response_ids, hf_greedy(model).response_ids)


def test_qwen3_norms_enter_before_rope():
    """Qwen3 norms each query/key head before RoPE. With its norm weights uneven over the features
    (as a trained model's are), norming after the rotation would give other keys: the engine's
    cache must hold exactly the model's rotated, normed keys, and its tokens follow HF's."""
    model = tiny_causal_lm("qwen3")
    assert RolloutEngine.supports(model) and model.config.head_dim * 4 != model.config.hidden_size
    # the cache read below is the static layout [L, 2, slots, KVH, S, D]
    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=16, kv_cache="static")
    assert engine.spec.qk_norm and engine.spec.head_dim == 32
    prompt = [[5, 9, 14, 2, 77, 3]]
    engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
    with torch.no_grad():
        out = model(input_ids=torch.tensor(prompt), use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    keys = cache.layers[1].keys[0]  # [KVH, P, D], after norm and RoPE
    assert torch.allclose(engine.cache[1, 0, 0, :, :len(prompt[0])], keys, atol=1e-5)


def test_rms_norm_rounds_as_the_hf_module_in_bf16():
    """The engine's RMSNorm gives the HF module's bf16 values bit for bit with weights that are not
    all ones (a single rounding after the weight, as ``F.rms_norm`` fuses it, differs in about a
    quarter of them)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from rlcore.rollout.engine.llama import rms_norm

    torch.manual_seed(0)
    norm = Qwen3RMSNorm(128, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.mul_((1 + 0.5 * (2 * torch.rand(128) - 1)).to(torch.bfloat16))
        x = torch.randn(64, 8, 128).to(torch.bfloat16)
        expected = norm(x)
        assert not torch.equal(torch.nn.functional.rms_norm(x, (128,), norm.weight, 1e-6), expected)
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), expected)


@pytest.mark.slow
def test_the_compiled_step_rounds_as_the_eager_step_in_bf16():
    """The compiled decode step (Inductor) keeps the eager step's bf16 roundings: same tokens, same
    log-probs, for a Qwen3 model whose norms are not all ones (tiny_causal_lm draws them)."""
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen3").to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
    eager = RolloutEngine(model, max_batch_size=8, max_seq_len=40, compile=False).generate(PROMPTS, params)
    compiled = RolloutEngine(model, max_batch_size=8, max_seq_len=40, compile=True)
    got = compiled.generate(PROMPTS, params)
    assert compiled.compile, "the compiled step fell back to eager"
    assert torch.equal(got.response_ids, eager.response_ids)
    # float32 reductions may still be ordered differently (a rare last-bit change); without the
    # kept roundings an eighth of the tokens differ and the log-probs are 0.26 apart on average
    gap = (got.logprobs - eager.logprobs).abs()
    assert gap.mean() < 1e-3 and gap.max() < 2e-2


def test_unsupported_qk_norms_are_refused():
    model = tiny_causal_lm("qwen3")
    for layer in model.model.layers:  # a norm over all key heads together, not per head
        layer.self_attn.k_norm = torch.nn.RMSNorm(2 * model.config.head_dim)
    assert not RolloutEngine.supports(model)
    with pytest.raises(ValueError, match="per-head RMSNorms"):
        RolloutEngine(model, max_batch_size=2, max_seq_len=16)


def test_bfloat16_engine_runs_and_returns_finite_logprobs(qwen2):
    engine = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=24, dtype=torch.bfloat16)
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    assert batch.response_ids.shape == (len(PROMPTS), 6)
    assert torch.isfinite(batch.logprobs).all() and (batch.logprobs <= 0).all()


def test_supports_and_input_errors(qwen2):
    assert RolloutEngine.supports(qwen2)
    assert not RolloutEngine.supports(tiny_causal_lm("gpt2"))
    windowed = tiny_causal_lm("mistral", sliding_window=8)
    assert RolloutEngine.supports(windowed, max_seq_len=8) and not RolloutEngine.supports(windowed, max_seq_len=24)
    with pytest.raises(ValueError, match="sliding_window"):
        RolloutEngine(windowed, max_batch_size=2, max_seq_len=24)
    engine = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=12)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2, top_p=0.0))
    with pytest.raises(ValueError, match="eos_token_ids"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2, eos_token_ids=(10**6,)))


def test_repeated_prompts_prefill_once_and_match_hf(qwen2, monkeypatch):
    """GRPO's n samples of a prompt: each distinct prompt is prefilled once and its keys/values
    copied; greedy outputs still equal HF generate for every copy, also with continuous batching."""
    from rlcore.rollout.engine import llama

    prompts = [p for p in PROMPTS[:4] for _ in range(3)]  # ragged, 3 copies each
    expected = hf_greedy(qwen2, prompts=prompts)
    prefilled = []
    real = llama.prefill

    def counting(weights, spec, cache, slots, ids, *args, **kwargs):
        prefilled.append(len(ids))
        return real(weights, spec, cache, slots, ids, *args, **kwargs)

    monkeypatch.setattr(llama, "prefill", counting)
    for slots in (12, 5):  # all at once, and refilled slot by slot
        prefilled.clear()
        got = RolloutEngine(qwen2, max_batch_size=slots, max_seq_len=24).generate(prompts, GREEDY)
        assert torch.equal(got.response_ids, expected.response_ids)
        assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)
        if slots == 12:
            assert prefilled == [4]
        else:
            assert sum(prefilled) < len(prompts)


def test_repeated_prompts_sample_independently(qwen2):
    prompts = [PROMPTS[0]] * 6
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    got = RolloutEngine(qwen2, max_batch_size=6, max_seq_len=24).generate(prompts, params)
    assert len({tuple(r) for r in got.response_ids.tolist()}) > 1  # one shared prefill, different draws
    want = teacher_forced_logprobs(qwen2, got, 1.0)
    assert torch.allclose(got.logprobs, want, atol=1e-4)


def test_the_decode_loop_reports_its_host_seconds_by_part(qwen2):
    """The batch stats split the call's host time into the loop's parts; together they fit in the call,
    launching decode steps is one of them, and admitting requests happens more than once with few slots."""
    import time

    engine = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=24, admit_fraction=0.0, eos_check_interval=2)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    start = time.perf_counter()
    got = engine.generate(PROMPTS, params)
    wall = time.perf_counter() - start
    parts = {k: got.stats[f"rollout/host_{k}_s"] for k in ("between", "admit", "launch", "finish")}
    assert all(v >= 0 for v in parts.values()) and parts["launch"] > 0 and parts["admit"] > 0
    assert sum(parts.values()) <= wall
    assert got.stats["rollout/graph_captures"] == 0  # no CUDA graphs on CPU


@pytest.mark.parametrize("kv_cache,slots", [("static", 8), ("paged", 8), ("static", 3)])
def test_per_prompt_token_limits_cut_each_response_at_its_own_limit(qwen2, kv_cache, slots):
    """``generate(max_new_tokens=[...])``: each response stops at its own limit (greedy: a prefix of the
    unlimited response), an EOS before it still ends it, and ``on_finished`` sees the cut responses."""
    limits = [1, 3, 10, 7, 2, 5, 4]
    engine = RolloutEngine(qwen2, max_batch_size=slots, max_seq_len=24, kv_cache=kv_cache, admit_fraction=0.0,
                           eos_check_interval=2)
    full = engine.generate(PROMPTS, GREEDY)
    seen = {}
    got = engine.generate(PROMPTS, GREEDY, max_new_tokens=limits,
                          on_finished=lambda idx, rows: seen.update(zip(idx, rows)))
    assert got.response_mask.sum(-1).tolist() == limits
    assert got.response_ids.shape[1] == max(limits)
    for i, k in enumerate(limits):
        assert got.response_ids[i, :k].tolist() == full.response_ids[i, :k].tolist()
        assert torch.all(got.response_ids[i, k:] == GREEDY.pad_token_id) and torch.all(got.logprobs[i, k:] == 0)
        assert seen[i] == full.response_ids[i, :k].tolist()
    eos = int(full.response_ids[2, 1])  # prompt 2 emits it at column 1, before its limit of 10
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_ids=(eos,))
    cut = engine.generate(PROMPTS, params, max_new_tokens=limits)
    assert int(cut.response_mask[2].sum()) == 2
    assert all(int(cut.response_mask[i].sum()) <= k for i, k in enumerate(limits))


def test_per_prompt_token_limits_are_checked(qwen2):
    engine = RolloutEngine(qwen2, max_batch_size=8, max_seq_len=24)
    with pytest.raises(ValueError, match="7 prompts"):
        engine.generate(PROMPTS, GREEDY, max_new_tokens=[3, 4])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] = 11"):
        engine.generate(PROMPTS, GREEDY, max_new_tokens=[3, 11, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\] = 0"):
        engine.generate(PROMPTS, GREEDY, max_new_tokens=[0] * 7)


def test_the_tail_of_a_call_is_counted_once_few_rows_decode(qwen2):
    """Sixteen prompts, half of them stopping after 2 tokens: the batch is compacted to at most 8 rows,
    and the steps after that (only those) count as the tail, with their wall seconds."""
    from rlcore.rollout.engine.scheduler import TAIL_ROWS

    prompts = (PROMPTS * 3)[:16]
    engine = RolloutEngine(qwen2, max_batch_size=16, max_seq_len=24, admit_fraction=0.0)
    limits = [2] * 9 + [10] * 7
    got = engine.generate(prompts, GREEDY, max_new_tokens=limits).stats
    assert TAIL_ROWS == 8 and got["rollout/decode_steps"] == 9  # the prefill samples each one's first token
    assert got["rollout/tail_steps"] == 8  # after the first step 7 rows are left: a bucket of 8 at most
    assert got["rollout/tail_s"] > 0 and got["rollout/tail_step_ms"] > 0
    wide = engine.generate(prompts, GREEDY).stats  # all 16 rows to the end: no tail
    assert wide["rollout/tail_steps"] == 0 and wide["rollout/tail_s"] == 0


@pytest.mark.parametrize("kv_cache,slots", [("static", 8), ("paged", 8), ("paged", 3)])
def test_stop_at_rows_ends_the_call_with_the_last_samples_unfinished(qwen2, kv_cache, slots):
    """``SamplingParams.stop_at_rows=K``: once at most K samples are still decoding and none waits (at an
    EOS check), the call ends; those samples keep the tokens they had (a prefix of their full response,
    short of their limit, no EOS), are marked in ``cut``, and are not reported as finished."""
    limits = [2, 3, 16, 16, 5, 20, 4]
    engine = RolloutEngine(qwen2, max_batch_size=slots, max_seq_len=40, kv_cache=kv_cache, admit_fraction=0.0,
                           eos_check_interval=4)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    full = engine.generate(PROMPTS, params, max_new_tokens=limits)
    assert full.cut is None
    seen = {}
    got = engine.generate(PROMPTS, dataclasses.replace(params, stop_at_rows=1), max_new_tokens=limits,
                          on_finished=lambda idx, rows: seen.update(zip(idx, rows)))
    # the 16-token samples end before the 20-token one, which is then the only one left at a check
    assert got.cut.tolist() == [False] * 5 + [True, False]
    assert got.stats["rollout/cut_samples"] == 1.0
    lengths = got.response_mask.sum(-1).tolist()
    assert lengths[:5] + lengths[6:] == limits[:5] + limits[6:]
    assert 0 < lengths[5] < 20
    for i, k in enumerate(lengths):
        assert got.response_ids[i, :k].tolist() == full.response_ids[i, :k].tolist()
        assert torch.equal(got.logprobs[i, :k], full.logprobs[i, :k])
        assert torch.all(got.response_ids[i, k:] == params.pad_token_id) and torch.all(got.logprobs[i, k:] == 0)
    assert sorted(seen) == [0, 1, 2, 3, 4, 6]  # the cut sample is not reported as finished


def test_stop_at_rows_waits_for_the_queue_and_is_checked(qwen2):
    """No sample is cut while prompts wait for a slot; a negative ``stop_at_rows`` is refused."""
    engine = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=40, admit_fraction=0.0, eos_check_interval=1)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_at_rows=2)
    got = engine.generate(PROMPTS, params)
    # two slots, admitted in pairs: while the last prompt waited, no pair was cut; admitted alone, it was
    assert got.cut.tolist() == [False] * 6 + [True]
    assert (got.response_mask.sum(-1)[:6] == 12).all() and 0 < int(got.response_mask[6].sum()) < 12
    with pytest.raises(ValueError, match="stop_at_rows"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, stop_at_rows=-1))


def test_prompts_of_unlike_lengths_are_prefilled_in_groups():
    """Prompts admitted together are grouped by length (the longest of a group at most twice its shortest,
    or a few hundred tokens longer), each group padded to its own longest prompt: a short prompt does not
    start its decode at a long one's column (every decode step reads a slot's cache from column 0)."""
    from rlcore.rollout.engine.scheduler import width_groups

    assert width_groups([10, 300, 12, 700, 650]) == [[3, 4], [1], [2, 0]]
    assert width_groups([10, 200, 12, 250]) == [[3, 1, 2, 0]]  # within the slack: one group
    assert width_groups([5, 2, 8, 1, 3, 4, 1], ratio=2, slack=0) == [[2, 0, 5], [4, 1], [3, 6]]
    assert width_groups([]) == []


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_grouped_prefill_decodes_as_one_group(qwen2, kv_cache, monkeypatch):
    """Grouped admission (here every length apart: no slack) gives HF's greedy tokens and the same
    sampled tokens as one padded group, with fewer prefill tokens and short slots decoding from their
    own width."""
    from rlcore.rollout.engine import scheduler

    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    runs = {}
    for name, slack in (("one", 10**6), ("grouped", 0)):
        monkeypatch.setattr(scheduler, "WIDTH_SLACK", slack)
        monkeypatch.setattr(scheduler, "WIDTH_RATIO", 2 if slack == 0 else 10**6)
        engine = RolloutEngine(qwen2, max_batch_size=8, max_seq_len=24, kv_cache=kv_cache)
        before = engine.counters["prefill_tokens"]
        greedy = engine.generate(PROMPTS, GREEDY)
        runs[name] = (greedy, engine.counters["prefill_tokens"] - before, engine.generate(PROMPTS, sampled))
    want = hf_greedy(qwen2)
    for greedy, _, _ in runs.values():
        assert greedy.response_ids.tolist() == want.response_ids.tolist()
    # lengths 5, 2, 8, 1, 3, 4, 1 -> groups (8, 5, 4), (3, 2), (1, 1): 3x8 + 2x3 + 2x1 tokens, not 7x8
    assert runs["one"][1] == 7 * 8 and runs["grouped"][1] == 3 * 8 + 2 * 3 + 2 * 1
    assert runs["grouped"][2].response_ids.tolist() == runs["one"][2].response_ids.tolist()
    assert torch.allclose(runs["grouped"][2].logprobs, runs["one"][2].logprobs, atol=1e-5)
