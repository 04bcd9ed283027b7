"""The Triton decode-attention kernel against the PyTorch attention of the decode step, and the
engine's ``attention="triton"`` option (run through Triton's interpreter on CPU when installed)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from rlcore.rollout.engine import decode
from rlcore.kernels import decode_attention
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.rollout.tiny import tiny_causal_lm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    decode_attention.triton is None or not decode_attention.available(DEVICE),
    reason="needs Triton and CUDA or TRITON_INTERPRET=1")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def make_case(group: int, dim: int, dtype=torch.float32, n: int = 3, slots: int = 5, kv_heads: int = 2,
              columns: int = 160, length: int = 136, seed: int = 0):
    """Random q (non-contiguous), a layer cache with more slots than ``n``, ragged key masks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, group, kv_heads, dim, generator=gen).transpose(1, 2)  # [n, KVH, G, D], strided
    layer = torch.randn(2, slots, kv_heads, columns, dim, generator=gen)
    bias = torch.zeros(n, columns)
    bias[0, 10:90] = float("-inf")  # a hole in the middle, across a block boundary
    if n > 1:
        bias[1, length - 50:] = float("-inf")  # the tail cut off
    if n > 2:
        bias[2, 1:] = float("-inf")  # one visible key
    return q.to(DEVICE, dtype), layer.to(DEVICE, dtype), bias.to(DEVICE, dtype), length


def test_plan_splits_only_small_batches():
    """The rule without the cap on one program's columns (``max_chunk=0``)."""
    assert decode_attention.plan(512, 320, sms=132) == (1, 320)
    assert decode_attention.plan(128, 320, sms=132) == (1, 320)  # 128 programs on 132 SMs: no split
    splits, chunk = decode_attention.plan(32, 320, sms=132)
    assert splits == 3 and chunk % decode_attention.BLOCK_N == 0 and (splits - 1) * chunk < 320 <= splits * chunk
    assert decode_attention.plan(2, 100, sms=132) == (2, 64)  # never more chunks than blocks
    assert decode_attention.plan(2, 1024, sms=132)[0] == decode_attention.SHORT_MAX_SPLITS
    assert decode_attention.plan(4, 136, sms=8, splits=3) == (3, 64)


def test_plan_cuts_long_contexts_of_few_rows_finer():
    """The tail of a long rollout: few rows, thousands of columns. The columns are cut until there
    are two programs per multiprocessor, in chunks of at least 256 columns, up to 64 chunks."""
    assert decode_attention.plan(2, 4096, sms=132) == (16, 256)  # chunks of the least width
    assert decode_attention.plan(2, 16384, sms=132)[0] == decode_attention.MAX_SPLITS == 64
    splits, chunk = decode_attention.plan(32, 8192, sms=132)  # 32 pairs x 9 chunks >= 264 programs
    assert splits == 9 and chunk >= decode_attention.LONG_MIN_CHUNK and (splits - 1) * chunk < 8192 <= splits * chunk
    assert decode_attention.plan(1024, 8192, sms=132, max_chunk=0) == (1, 8192)  # a full batch needs no cutting...
    assert decode_attention.plan(1024, 8192, sms=132) == (8, 1024)  # ...but for the default cap (MAX_CHUNK)
    assert decode_attention.plan(32, 1024, sms=132)[0] == 3  # up to LONG_LENGTH the short rule holds


def test_plan_caps_the_columns_of_one_program(monkeypatch):
    """With a cap, a full batch of long rows (no split by the default rule) is cut into chunks no wider
    than it (1,024 columns by default); with 0 (or None as the module's value) no cap; an explicit ``splits``
    still wins."""
    assert decode_attention.MAX_CHUNK == 1024
    assert decode_attention.plan(512, 8192, sms=132) == (8, 1024)
    assert decode_attention.plan(512, 8192, sms=132, max_chunk=0) == (1, 8192)
    assert decode_attention.plan(512, 1024, sms=132) == (1, 1024)  # up to the cap: one chunk
    assert decode_attention.plan(512, 8192, sms=132, max_chunk=1024) == (8, 1024)
    assert decode_attention.plan(512, 8000, sms=132, block_n=32, max_chunk=1000) == (8, 1024)  # whole blocks
    assert decode_attention.plan(512, 300, sms=132, max_chunk=1024) == (1, 320)
    assert decode_attention.plan(512, 8192, sms=132, splits=2, max_chunk=1024) == (2, 4096)
    assert decode_attention.plan(2, 16384, sms=132, max_chunk=64)[0] == decode_attention.MAX_SPLITS
    monkeypatch.setattr(decode_attention, "MAX_CHUNK", 2048)
    assert decode_attention.plan(512, 8192, sms=132) == (4, 2048)
    monkeypatch.setattr(decode_attention, "MAX_CHUNK", None)
    assert decode_attention.plan(512, 8192, sms=132) == (1, 8192)


@needs_kernel
def test_capped_chunks_give_the_same_attention(monkeypatch):
    """Rows of very different lengths (one long, the others short) cut by the cap: the same attention."""
    q, layer, bias, length = make_case(2, 16, n=3, slots=5, columns=160, length=136)
    want = decode_attention.attend(q, layer, bias, length)
    monkeypatch.setattr(decode_attention, "MAX_CHUNK", 32)  # one block (64 columns) a chunk
    assert decode_attention.plan(3 * 2, length, decode_attention.DEFAULT_SMS)[0] == 3
    got = decode_attention.attend(q, layer, bias, length, counters=torch.zeros(6, dtype=torch.int32, device=DEVICE))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got, decode_attention.reference(q, layer, bias, length), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_max_chunk_per_call_reaches_the_plan(monkeypatch):
    """``attend(max_chunk=)`` (and ``attend_new``'s, through the engine's ``attention_tuning``) overrides the
    module's cap for that call only; 0 turns it off; a negative or non-integer cap is refused."""
    seen = []
    plan = decode_attention.plan
    monkeypatch.setattr(decode_attention, "plan", lambda *a, **k: seen.append(a[5]) or plan(*a, **k))
    q, layer, bias, length = make_case(2, 16, n=3, slots=5, columns=160, length=136)
    capped = decode_attention.attend(q, layer, bias, length, max_chunk=64,
                                     counters=torch.zeros(6, dtype=torch.int32, device=DEVICE))
    whole = decode_attention.attend(q, layer, bias, length, max_chunk=0)
    default = decode_attention.attend(q, layer, bias, length)
    assert seen == [64, 0, None]
    assert plan(3 * 2, length, decode_attention.DEFAULT_SMS, None, 64, 64)[0] == 3
    for got in (capped, whole, default):
        assert torch.allclose(got, decode_attention.reference(q, layer, bias, length), atol=1e-5, rtol=1e-5)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_chunk must be a non-negative integer"):
            decode_attention.attend(q, layer, bias, length, max_chunk=bad)


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matches_the_pytorch_attention(group, dim, splits):
    q, layer, bias, length = make_case(group, dim)
    got = decode_attention.attend(q, layer, bias, length, splits=splits)
    assert got.shape == (3, 2 * group * dim) and got.dtype == torch.float32
    for expected in (decode_attention.reference(q, layer, bias, length), decode.attend(q, layer, bias, length, "sdpa")):
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_in_half_precision(dtype):
    q, layer, bias, length = make_case(7, 64, dtype, length=100)
    expected = decode_attention.reference(q, layer, bias, length)
    for splits in (1, 2):
        got = decode_attention.attend(q, layer, bias, length, splits=splits)
        assert got.dtype == dtype
        assert torch.allclose(got.float(), expected, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("splits", [2, 3])
def test_chunks_merged_in_the_kernel_equal_one_chunk(splits):
    q, layer, bias, length = make_case(7, 64, n=6, slots=6, length=150)
    counters = decode_attention._counters(q.device, 1)
    merged_by_kernel = decode_attention.attend(q, layer, bias, length, splits=1)
    for _ in range(3):  # repeated calls: every pair's counter must be back at zero each time
        folded = decode_attention.attend(q, layer, bias, length, splits=splits)
        assert torch.allclose(folded, merged_by_kernel, atol=1e-5, rtol=1e-5)
        assert int(decode_attention._counters(q.device, 1).abs().sum()) == 0
    assert decode_attention._counters(q.device, 1) is counters  # the buffer is kept, not reallocated
    assert torch.allclose(folded, decode_attention.reference(q, layer, bias, length), atol=1e-5, rtol=1e-5)
    own = torch.zeros(12, dtype=torch.int32, device=q.device)  # a caller's own buffer (6 slots x 2 heads)
    mine = decode_attention.attend(q, layer, bias, length, splits=splits, counters=own)
    assert torch.allclose(mine, folded, atol=1e-6, rtol=1e-6) and int(own.abs().sum()) == 0
    with pytest.raises(ValueError, match="counters must be >= 12 int32"):
        decode_attention.attend(q, layer, bias, length, splits=splits, counters=own[:11])


@needs_kernel
def test_default_split_rule_and_a_single_slot():
    q, layer, bias, length = make_case(2, 16, n=1, columns=208, length=200)
    assert decode_attention.plan(2, 200, decode_attention._sm_count(q.device.type, q.device.index))[0] > 1
    got = decode_attention.attend(q, layer, bias, length)
    assert torch.allclose(got, decode_attention.reference(q, layer, bias, length), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or decode_attention.triton is None, reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_replays_in_a_cuda_graph(splits):
    q, layer, bias, length = make_case(7, 64, torch.bfloat16, n=4, slots=8)
    decode_attention.attend(q, layer, bias, length, splits=splits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention.attend(q, layer, bias, length, splits=splits)
    for _ in range(2):
        q.normal_()
        graph.replay()
        expected = decode_attention.reference(q, layer, bias, length)
        assert torch.allclose(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def qwen2():
    return tiny_causal_lm("qwen2")


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("tuning", [None, {"rope_rows": False, "num_warps": 4, "block_n": 16},
                                    {"num_warps": 2, "block_n": 32, "subblocks": 2},
                                    {"block_n": 16, "max_chunk": 16}])
def test_engine_with_triton_attention_matches_sdpa(qwen2, tuning, monkeypatch):
    expected = RolloutEngine(qwen2, max_batch_size=3, max_seq_len=24, attention_length_step=8,
                             admit_fraction=0.0, device=DEVICE, attention="sdpa").generate(PROMPTS, GREEDY)
    engine = RolloutEngine(qwen2, max_batch_size=3, max_seq_len=24, attention_length_step=8, admit_fraction=0.0,
                           attention="triton", device=DEVICE, attention_tuning=tuning)
    assert engine.attention == "triton"
    # one slot: few (slot, head) programs, so the kernel cuts the columns into chunks merged in the kernel
    single = RolloutEngine(qwen2, max_batch_size=1, max_seq_len=40, attention_length_step=32, admit_fraction=0.0,
                           attention="triton", device=DEVICE,
                           attention_tuning={**(tuning or {}), "block_n": 16, "subblocks": 1})  # 16: no sub-blocks
    sms = decode_attention._sm_count(single.device.type, None)
    assert decode_attention.plan(single.spec.num_kv_heads, 32, sms, block_n=16)[0] > 1
    monkeypatch.setattr(decode_attention, "_counters", None)  # the engine brings its own buffer
    alone = single.generate(PROMPTS[:2], GREEDY)
    assert torch.equal(alone.response_ids, expected.response_ids[:2])
    assert int(single.state.attention_counters.abs().sum()) == 0
    got = engine.generate(PROMPTS, GREEDY)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs.cpu(), expected.logprobs.cpu(), atol=1e-4)


def test_engine_falls_back_to_sdpa_where_the_kernel_cannot_run(qwen2, monkeypatch, caplog):
    monkeypatch.setattr(decode_attention, "available", lambda device: False)
    with caplog.at_level(logging.WARNING, logger="rlcore.rollout.engine"):
        engine = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=16, attention="triton")
    assert engine.attention == "sdpa"
    assert len([r for r in caplog.records if "attention 'triton' unavailable" in r.getMessage()]) == 1
    expected = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=16).generate(PROMPTS[:3], GREEDY)
    got = engine.generate(PROMPTS[:3], GREEDY)
    assert torch.equal(got.response_ids, expected.response_ids)


@needs_kernel
def test_engine_falls_back_when_the_self_check_disagrees(qwen2, monkeypatch, caplog):
    monkeypatch.setattr(decode_attention, "_CHECKED", {})
    monkeypatch.setattr(decode_attention, "attend", lambda q, layer, bias, length, **kw: torch.zeros_like(
        decode_attention.reference(q, layer, bias, length)))
    with caplog.at_level(logging.WARNING, logger="rlcore.rollout.engine"):
        engine = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16, attention="triton", device=DEVICE)
    assert engine.attention == "sdpa"
    assert any("disagrees" in r.getMessage() for r in caplog.records)


@needs_kernel
def test_the_self_check_runs_with_the_engines_kernel_settings(qwen2, monkeypatch):
    monkeypatch.setattr(decode_attention, "_CHECKED", {})
    assert decode_attention.usable(DEVICE, torch.float32, 2, 3, 16, {"subblocks": 2, "block_n": 32}) == (True, "ok")
    ok, reason = decode_attention.usable(DEVICE, torch.float32, 2, 3, 16, {"subblocks": 4, "block_n": 32})
    assert not ok and "subblocks" in reason  # sub-blocks of 8 columns: this setting was what got checked
    assert len(decode_attention._CHECKED) == 2
    with pytest.raises(ValueError, match=r"attention_tuning\['subblocks'\].*block's 64 columns.*got 8"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16, attention="triton", device=DEVICE,
                      attention_tuning={"subblocks": 8})


def test_unknown_attention_kind_is_refused(qwen2):
    with pytest.raises(ValueError, match="attention"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16, attention="flash")


def test_unknown_attention_tuning_key_is_refused(qwen2):
    with pytest.raises(ValueError, match=r"attention_tuning keys \['warps'\]"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16, attention_tuning={"warps": 2})
    with pytest.raises(ValueError, match="mapping"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16, attention_tuning=[("num_warps", 2)])
    for key, value in (("block_n", 24), ("block_n", 8), ("num_warps", 3), ("num_warps", 64), ("num_stages", 0),
                       ("rope_rows", 1), ("num_warps", True), ("subblocks", 3), ("max_chunk", -1),
                       ("max_chunk", True)):
        with pytest.raises(ValueError, match=rf"attention_tuning\['{key}'\]"):
            RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16, attention_tuning={key: value})
    engine = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=16,
                           attention_tuning={"block_n": 32, "num_warps": 8, "num_stages": 2, "rope_rows": False})
    assert engine.attention_tuning == {"block_n": 32, "num_warps": 8, "num_stages": 2, "rope_rows": False}



@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("rope_rows", [False, True])
def test_attend_new_rotates_writes_and_attends_like_pytorch(dtype, splits, rope_rows):
    gen = torch.Generator().manual_seed(3)
    n, kv_heads, group, dim, columns, length = 5, 2, 3, 16, 80, 70
    heads = kv_heads * group
    layer = torch.randn(2, n + 1, kv_heads, columns, dim, generator=gen).to(DEVICE, dtype)
    proj = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    cos, sin = torch.randn(2, columns, dim, generator=gen).to(DEVICE)
    positions = torch.randint(0, columns, (n,), generator=gen).to(DEVICE)
    at = torch.tensor([1, 69, 30, 64, 5], device=DEVICE)  # the new column, anywhere below length
    bias = torch.zeros(n, columns, dtype=dtype, device=DEVICE)
    bias[0, 20:] = float("-inf")
    bias[3, :10] = float("-inf")
    bias[torch.arange(n), at] = 0.0  # columns after ``at`` stay unmasked here: the kernel must not read them
    stale = layer.clone()
    expected_layer = layer.clone()
    expected = decode_attention.reference_new(proj, expected_layer, bias, length, cos, sin, positions, at, heads,
                                              kv_heads)
    if rope_rows:  # each slot's RoPE rows gathered beforehand
        got = decode_attention.attend_new(proj, layer, bias, length, cos[positions], sin[positions], None, at, heads,
                                          kv_heads, splits=splits)
    else:
        got = decode_attention.attend_new(proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads,
                                          splits=splits)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), expected, atol=tol, rtol=tol)
    assert torch.allclose(layer.float(), expected_layer.float(), atol=tol * 4, rtol=tol)
    changed = (layer != stale).any(-1)  # [2, B, KVH, S]: only each slot's new column was written
    cols = changed.nonzero()[:, 3]
    rows = changed.nonzero()[:, 1]
    assert torch.equal(cols.cpu(), at[rows].cpu())


@needs_kernel
@pytest.mark.parametrize("dtype", [
    torch.float32, torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (Triton's interpreter truncates when it casts to bf16)"))])
@pytest.mark.parametrize("splits, subblocks", [(1, 1), (3, 1), (1, 2), (3, 2)])
def test_attend_new_folds_the_new_column_as_the_cached_path_does(dtype, splits, subblocks):
    """Rotating inside the kernel gives, bit for bit, the attention of rotating apart, writing the cache
    and attending over it: the new column (from registers) is folded within its block, with the running
    maximum of its neighbours, as the cached path and the trainer's attention fold it. Folded apart,
    after the other columns, its probability and theirs were rounded for the value product against
    other maxima, and the engine's log-probs moved further from the trainer's than HF ``generate``'s."""
    from rlcore.rollout.engine.llama import rotate, signed_sin

    gen = torch.Generator().manual_seed(21)
    n, kv_heads, group, dim, columns, length = 4, 2, 3, 32, 160, 150
    heads = kv_heads * group
    layer = (2 * torch.randn(2, n, kv_heads, columns, dim, generator=gen)).to(DEVICE, dtype)
    proj = (2 * torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)).to(DEVICE, dtype)
    # each new key is the first query of its group (rotated alike): the query attends most to its own
    # column, as a model's often does, so the new column sets the row's maximum
    for g in range(kv_heads):
        proj[:, (heads + g) * dim:(heads + g + 1) * dim] = proj[:, g * group * dim:(g * group + 1) * dim]
    angles = torch.rand(columns, dim // 2, generator=gen) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), signed_sin(torch.cat([angles.sin()] * 2, -1))
    positions = torch.tensor([40, 7, 149, 90])
    at = torch.tensor([40, 7, 149, 90])  # the new column: early, in a first block, the last, mid-block
    bias = torch.zeros(n, columns, dtype=dtype)
    bias[3, 20:30] = float("-inf")
    got_layer, expected_layer = layer.clone(), layer.clone()
    got = decode_attention.attend_new(proj, got_layer, bias.to(DEVICE), length, cos.to(DEVICE), sin.to(DEVICE),
                                      positions.to(DEVICE), at.to(DEVICE), heads, kv_heads, splits=splits,
                                      subblocks=subblocks)
    # apart: rotate as the model does, write the new key/value, attend with the later columns masked
    c, s = cos[positions].to(DEVICE, dtype)[:, None], sin[positions].to(DEVICE, dtype)[:, None]
    q = rotate(proj[:, :heads * dim].view(n, heads, dim), c, s)
    key = rotate(proj[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim), c, s)
    rows = torch.arange(n, device=DEVICE)
    expected_layer[0, rows, :, at.to(DEVICE)] = key
    expected_layer[1, rows, :, at.to(DEVICE)] = proj[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
    later = torch.arange(columns)[None, :] > at[:, None]
    masked = bias.masked_fill(later, float("-inf")).to(DEVICE)
    expected = decode_attention.attend(q.view(n, kv_heads, group, dim), expected_layer, masked, length,
                                       splits=splits, subblocks=subblocks)
    assert torch.equal(got_layer, expected_layer)
    assert torch.equal(got, expected.reshape(got.shape))


@pytest.mark.skipif(not torch.cuda.is_available() or decode_attention.triton is None,
                    reason="needs CUDA (Triton's interpreter truncates when it casts to bf16)")
@pytest.mark.parametrize("parts", [1, 2])
def test_the_kernel_rounds_rope_as_the_model_does_in_bf16(parts):
    """The new key the kernel writes is, bit for bit, the model's: the projection (partial products
    summed with the bias) rounded to bf16, then each RoPE product rounded before their sum
    (rotating in float32 and rounding once changes about a quarter of the values)."""
    from rlcore.rollout.engine.llama import rotate

    gen = torch.Generator().manual_seed(5)
    n, heads, kv_heads, dim, columns, length = 3, 4, 2, 32, 40, 24
    width = (heads + 2 * kv_heads) * dim
    pieces = torch.randn(parts, n, width, generator=gen).to(torch.bfloat16)
    proj_bias = torch.randn(width, generator=gen).to(torch.bfloat16) if parts > 1 else None
    cos, sin = torch.randn(2, columns, dim, generator=gen)
    positions, at = torch.tensor([3, 11, 20]), torch.tensor([length - 1, 9, 15])
    layer = torch.zeros(2, n, kv_heads, columns, dim, dtype=torch.bfloat16, device=DEVICE)
    bias = torch.zeros(n, columns, dtype=torch.bfloat16, device=DEVICE)
    proj = pieces.to(DEVICE) if parts > 1 else pieces[0].to(DEVICE)
    decode_attention.attend_new(proj, layer, bias, length, cos.to(DEVICE), sin.to(DEVICE), positions.to(DEVICE),
                                at.to(DEVICE), heads, kv_heads,
                                proj_bias=None if proj_bias is None else proj_bias.to(DEVICE))
    summed = pieces.float().sum(0) + (0 if proj_bias is None else proj_bias.float())
    keys = summed.to(torch.bfloat16)[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
    c, s = cos[positions].to(torch.bfloat16)[:, None], sin[positions].to(torch.bfloat16)[:, None]
    expected = rotate(keys, c, s)
    got = layer[0, torch.arange(n), :, at.to(DEVICE)].cpu()
    assert torch.equal(got, expected)
    once = (keys.float() * c.float() + keys.float().roll(dim // 2, dims=-1) * s.float()).to(torch.bfloat16)
    assert not torch.equal(once, expected)  # the test tells the two roundings apart


@pytest.mark.skipif(not torch.cuda.is_available() or decode_attention.triton is None,
                    reason="needs CUDA (Triton's interpreter truncates when it casts to bf16)")
def test_float32_parts_of_a_bf16_model_are_rounded_once_to_the_cache_dtype():
    """Partial products kept in float32 (the decode step's split-K on CUDA) are summed with the bias
    and rounded once to the cache's bf16, as the model rounds its one product; the output is bf16."""
    from rlcore.rollout.engine.llama import rotate

    gen = torch.Generator().manual_seed(9)
    n, heads, kv_heads, dim, columns, length = 3, 4, 2, 32, 40, 24
    width = (heads + 2 * kv_heads) * dim
    pieces = torch.randn(2, n, width, generator=gen)  # float32, unrounded
    proj_bias = torch.randn(width, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(2, columns, dim, generator=gen)
    positions, at = torch.tensor([3, 11, 20]), torch.tensor([length - 1, 9, 15])
    layer = torch.zeros(2, n, kv_heads, columns, dim, dtype=torch.bfloat16, device=DEVICE)
    bias = torch.zeros(n, columns, dtype=torch.bfloat16, device=DEVICE)
    out = decode_attention.attend_new(pieces.to(DEVICE), layer, bias, length, cos.to(DEVICE), sin.to(DEVICE),
                                      positions.to(DEVICE), at.to(DEVICE), heads, kv_heads,
                                      proj_bias=proj_bias.to(DEVICE))
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads * dim)
    summed = (pieces.sum(0) + proj_bias.float()).to(torch.bfloat16)
    keys = summed[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
    c, s = cos[positions].to(torch.bfloat16)[:, None], sin[positions].to(torch.bfloat16)[:, None]
    assert torch.equal(layer[0, torch.arange(n), :, at.to(DEVICE)].cpu(), rotate(keys, c, s))
    values = summed[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
    assert torch.equal(layer[1, torch.arange(n), :, at.to(DEVICE)].cpu(), values)
    rounded_parts = (pieces.to(torch.bfloat16).float().sum(0) + proj_bias.float()).to(torch.bfloat16)
    assert not torch.equal(rounded_parts, summed)  # rounding each part first would differ


@needs_kernel
def test_float32_parts_give_an_output_in_the_cache_dtype():
    """The kernel's output and the values it writes are in the cache's dtype, whatever the parts' dtype."""
    gen = torch.Generator().manual_seed(4)
    n, heads, kv_heads, dim, columns, length = 2, 4, 2, 16, 32, 20
    pieces = torch.randn(2, n, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = torch.randn(2, columns, dim, generator=gen)
    positions, at = torch.tensor([3, 11]), torch.tensor([length - 1, 9])
    layer = torch.zeros(2, n, kv_heads, columns, dim, dtype=torch.bfloat16, device=DEVICE)
    out = decode_attention.attend_new(pieces.to(DEVICE), layer, torch.zeros(n, columns, device=DEVICE), length,
                                      cos.to(DEVICE), sin.to(DEVICE), positions.to(DEVICE), at.to(DEVICE),
                                      heads, kv_heads)
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads * dim) and bool(torch.isfinite(out).all())
    values = pieces.sum(0)[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
    written = layer[1, torch.arange(n), :, at.to(DEVICE)].cpu().float()
    assert torch.allclose(written, values, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (Triton's interpreter truncates when it casts to bf16)"))])
def test_float32_parts_attend_as_the_rounded_projection(dtype):
    """Float32 partial products and a bias (the decode step's split-K) give the output and cache of the
    projection rounded once to the cache's dtype: the new column's value enters the softmax rounded,
    as the model's v projection is, not as the float32 sum."""
    gen = torch.Generator().manual_seed(12)
    n, heads, kv_heads, dim, columns, length = 3, 4, 2, 32, 40, 24
    width = (heads + 2 * kv_heads) * dim
    pieces = torch.randn(2, n, width, generator=gen)
    proj_bias = torch.randn(width, generator=gen).to(dtype)
    layer = torch.randn(2, n, kv_heads, columns, dim, generator=gen).to(dtype)
    bias = torch.zeros(n, columns, dtype=dtype)
    bias[1, :5] = float("-inf")
    cos, sin = torch.randn(2, columns, dim, generator=gen)
    positions, at = torch.tensor([3, 11, 20]), torch.tensor([length - 1, 9, 15])
    to = dict(device=DEVICE)
    args = (bias.to(**to), length, cos.to(**to), sin.to(**to), positions.to(**to), at.to(**to), heads, kv_heads)
    summed = (pieces.sum(0) + proj_bias.float()).to(dtype)
    assert not torch.equal(summed.float(), pieces.sum(0) + proj_bias.float())  # the rounding is there to see
    expected_layer, got_layer = layer.clone().to(**to), layer.clone().to(**to)
    expected = decode_attention.attend_new(summed.to(**to), expected_layer, *args)
    got = decode_attention.attend_new(pieces.to(**to), got_layer, *args, proj_bias=proj_bias.to(**to))
    assert torch.equal(got_layer, expected_layer)
    assert torch.equal(got, expected)


@needs_kernel
def test_projection_slices_and_bias_are_added_before_rope():
    """``attend_new`` given the q/k/v projection as 2 partial products and the bias equals
    ``attend_new`` of the finished projection ``sum + bias`` (output and cache)."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim, columns, length = 3, 4, 2, 16, 40, 24
    parts = torch.randn(2, n, (heads + 2 * kv_heads) * dim, generator=gen)
    proj_bias = torch.randn(parts.shape[-1], generator=gen)
    layer = torch.randn(2, 4, kv_heads, columns, dim, generator=gen)
    bias = torch.zeros(n, columns)
    bias[1, :3] = float("-inf")
    cos, sin = torch.randn(2, columns, dim, generator=gen)
    positions, at = torch.tensor([3, 11, 20]), torch.tensor([length - 1, 9, 15])
    to = dict(device=DEVICE)
    args = (bias.to(**to), length, cos.to(**to), sin.to(**to), positions.to(**to), at.to(**to), heads, kv_heads)
    expected_layer, got_layer = layer.clone().to(**to), layer.clone().to(**to)
    expected = decode_attention.attend_new((parts.sum(0) + proj_bias).to(**to), expected_layer, *args)
    got = decode_attention.attend_new(parts.to(**to), got_layer, *args, proj_bias=proj_bias.to(**to))
    assert torch.allclose(got, expected, atol=1e-5) and torch.allclose(got_layer, expected_layer, atol=1e-5)
    without = decode_attention.attend_new(parts.to(**to), layer.clone().to(**to), *args)
    assert not torch.allclose(without, expected, atol=1e-3)  # the bias matters
    with pytest.raises(ValueError, match="proj_bias"):
        decode_attention.attend_new(parts.to(**to), got_layer, *args, proj_bias=proj_bias[:5].to(**to))


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("split_k", [{"qkv": 2}, {"qkv": 2, "o": 2, "down": 4}])
def test_engine_qkv_slices_and_transposed_mlp_match_sdpa(qwen2, split_k):
    """The q/k/v product in slices summed by the attention kernel (Qwen2: with its bias added there)
    and the transposed gate/up product give the unsplit engine's greedy tokens and log-probs."""
    kwargs = dict(max_batch_size=3, max_seq_len=24, attention_length_step=8, admit_fraction=0.0, device=DEVICE)
    expected = RolloutEngine(qwen2, attention="sdpa", **kwargs).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(qwen2, attention="triton", split_k=split_k, mlp_transposed=True, **kwargs)
    assert engine._fns.qkv_parts and engine.mlp_transposed
    got = engine.generate(PROMPTS, GREEDY)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs.cpu(), expected.logprobs.cpu(), atol=1e-4)


@needs_kernel
@pytest.mark.slow
def test_engine_rope_in_attention_matches_the_separate_steps(qwen2):
    kwargs = dict(max_batch_size=3, max_seq_len=24, attention_length_step=8, admit_fraction=0.0,
                  attention="triton", device=DEVICE)
    separate = RolloutEngine(qwen2, rope_in_attention=False, **kwargs)
    fused = RolloutEngine(qwen2, **kwargs)
    assert fused.rope_in_attention and not separate.rope_in_attention
    expected, got = separate.generate(PROMPTS, GREEDY), fused.generate(PROMPTS, GREEDY)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs.cpu(), expected.logprobs.cpu(), atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("family, split_k", [("qwen3", {"qkv": 2}), ("llama3", None)])
def test_engine_with_triton_attention_matches_hf_for_qwen3_and_llama3(family, split_k):
    """Qwen3's per-head q/k norms (head dim 32, not hidden / heads) enter before the kernel's RoPE,
    the q/k/v product's slices summed before them; Llama-3's scaled RoPE table reaches the kernel."""
    model = tiny_causal_lm(family)
    expected = HFGenerateBackend(model).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(model, max_batch_size=3, max_seq_len=24, attention_length_step=8, admit_fraction=0.0,
                           attention="triton", device=DEVICE, split_k=split_k, share_weights=False)
    assert engine.attention == "triton" and engine.rope_in_attention
    assert not engine._fns.qkv_parts  # Qwen3: the norms need the summed projection
    got = engine.generate(PROMPTS, GREEDY)
    assert torch.equal(got.response_ids.cpu(), expected.response_ids)
    assert torch.allclose(got.logprobs.cpu(), expected.logprobs, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("new", [False, True])
def test_shared_prompt_columns_are_read_from_the_source_row(splits, new):
    """Rows 1 and 2 read their first columns from row 0; their own copies there hold other numbers,
    so reading them would change the result."""
    gen = torch.Generator().manual_seed(5)
    n, kv_heads, group, dim, columns, length = 4, 2, 3, 16, 140, 130
    heads = kv_heads * group
    layer = torch.randn(2, n, kv_heads, columns, dim, generator=gen).to(DEVICE)
    bias = torch.zeros(n, columns, device=DEVICE)
    bias[:3, :7] = float("-inf")  # the prompt's left padding, the same in its three samples
    source = torch.tensor([0, 0, 0, 3], dtype=torch.int32, device=DEVICE)
    end = torch.tensor([0, 70, 70, 0], dtype=torch.int32, device=DEVICE)  # 70: not a block boundary
    whole = decode_attention.gather_shared(layer, n, source, end)
    assert torch.equal(whole[:, 1, :, :70], layer[:, 0, :, :70]) and torch.equal(whole[:, 1, :, 70:], layer[:, 1, :, 70:])
    if new:
        proj = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE)
        cos, sin = torch.randn(2, columns, dim, generator=gen).to(DEVICE)
        positions = torch.tensor([80, 90, 100, 5], device=DEVICE)
        at = torch.tensor([120, 100, 71, 129], device=DEVICE)  # at or after each slot's shared end
        expected_layer, plain_layer = layer.clone(), layer.clone()
        expected = decode_attention.reference_new(proj, expected_layer, bias, length, cos, sin, positions, at, heads,
                                                  kv_heads, (source, end))
        got = decode_attention.attend_new(proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads,
                                          splits=splits, shared=(source, end))
        unshared = decode_attention.attend_new(proj, plain_layer, bias, length, cos, sin, positions, at, heads,
                                               kv_heads, splits=splits)
        assert torch.equal(layer, plain_layer)  # the new key/value go to each slot's own row
        assert torch.allclose(layer, expected_layer, atol=1e-5, rtol=1e-5)
    else:
        q = torch.randn(n, kv_heads, group, dim, generator=gen).to(DEVICE)
        expected = decode_attention.reference(q, layer, bias, length, (source, end))
        got = decode_attention.attend(q, layer, bias, length, splits=splits, shared=(source, end))
        unshared = decode_attention.attend(q, layer, bias, length, splits=splits)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[[0, 3]], unshared[[0, 3]])  # rows that share nothing are untouched
    assert not torch.allclose(got[1:3], unshared[1:3], atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("subblocks", [2, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_subblocks_give_the_same_attention(subblocks, splits):
    """Each block's columns in sub-blocks with softmax states of their own, merged after the loop:
    the same attention, also where a sub-block sees no valid column at all (row 2 has one visible key)
    or a slot's columns end inside a sub-block."""
    q, layer, bias, length = make_case(7, 16, n=4, slots=5, length=150)
    expected = decode_attention.reference(q, layer, bias, length)
    got = decode_attention.attend(q, layer, bias, length, splits=splits, subblocks=subblocks, block_n=64)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, columns = 6, 2, 16, 140
    proj = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE)
    cos, sin = torch.randn(2, columns, dim, generator=gen).to(DEVICE)
    rows_layer = torch.randn(2, 4, kv_heads, columns, dim, generator=gen).to(DEVICE)
    shared = (torch.tensor([0, 0, 0, 3], dtype=torch.int32, device=DEVICE),
              torch.tensor([0, 70, 70, 0], dtype=torch.int32, device=DEVICE))
    at = torch.tensor([120, 100, 71, 3], device=DEVICE)
    new_bias = torch.zeros(4, columns, device=DEVICE)
    new_bias[:3, :7] = float("-inf")
    args = (new_bias, 130, cos, sin, at, at, heads, kv_heads)
    expected_layer, got_layer = rows_layer.clone(), rows_layer.clone()
    expected = decode_attention.reference_new(proj, expected_layer, *args, shared)
    got = decode_attention.attend_new(proj, got_layer, *args, splits=splits, shared=shared, subblocks=subblocks)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_layer, expected_layer, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_subblocks_are_checked():
    q, layer, bias, length = make_case(2, 16)
    for subblocks, block_n in ((3, 64), (0, 64), (4, 32)):  # 32 columns in 4: sub-blocks of 8 are too narrow
        with pytest.raises(ValueError, match=f"subblocks must be a power of two .* got {subblocks}"):
            decode_attention.attend(q, layer, bias, length, subblocks=subblocks, block_n=block_n)


@needs_kernel
def test_shared_prompt_arguments_are_checked():
    q, layer, bias, length = make_case(2, 16)
    with pytest.raises(ValueError, match="shared"):
        decode_attention.attend(q, layer, bias, length, shared=(torch.zeros(2, dtype=torch.int32, device=DEVICE),
                                                                torch.zeros(3, dtype=torch.int32, device=DEVICE)))
    with pytest.raises(ValueError, match="shared"):
        decode_attention.attend(q, layer, bias, length, shared=(torch.zeros(3, device=DEVICE),) * 2)


@needs_kernel
@pytest.mark.slow
def test_engine_prompt_sharing_gives_the_same_samples(qwen2):
    """Three samples of each of four prompts through three slots: groups are cut across prefills,
    sources are refilled while their samples run (random lengths through several EOS tokens) and
    live slots are compacted at the end; with and without sharing the samples are identical."""
    prompts = [p for p in PROMPTS[:4] for _ in range(3)]
    params = SamplingParams(max_new_tokens=7, temperature=1.0, seed=11, eos_token_ids=(3, 5, 8, 13, 21, 34))
    kwargs = dict(max_batch_size=3, max_seq_len=24, attention_length_step=8, admit_fraction=0.0,
                  attention="triton", device=DEVICE, kv_cache="static")
    plain = RolloutEngine(qwen2, prompt_sharing=False, **kwargs)
    shared = RolloutEngine(qwen2, **kwargs)
    assert shared.prompt_sharing and not plain.prompt_sharing and plain.state.share_source is None
    seen = []
    prefill = shared._prefill

    def watch(slots, prompts_, pad_id):
        out = prefill(slots, prompts_, pad_id)
        seen.append((shared.state.share_source.tolist(), shared.state.share_end.tolist()))
        return out

    shared._prefill = watch
    expected, got = plain.generate(prompts, params), shared.generate(prompts, params)
    assert torch.equal(got.response_ids, expected.response_ids)
    # the same numbers in other blocks of columns: equal up to float32 rounding
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-5)
    lengths = got.response_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1  # sequences really ended at different steps
    assert any(any(end) for _, end in seen)  # some slots did read another row
    assert shared.state.share_active and not plain.state.share_active
    shared.generate(PROMPTS, params)  # no prompt repeats: the plain kernel
    assert not shared.state.share_active
    for source, end in seen:  # a slot that shares reads a row holding the same prompt's columns
        for slot, (src, stop) in enumerate(zip(source, end)):
            assert stop == 0 or src != slot


def test_engine_sharing_state_follows_refills_and_compaction(qwen2, monkeypatch):
    """The bookkeeping alone (no kernel needed): a refilled source sends its samples back to
    their own copies, and compaction follows moved sources."""
    monkeypatch.setattr(decode_attention, "usable", lambda *args: (True, "ok"))
    engine = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=24, attention="triton", compile=False,
                           kv_cache="static")
    assert engine.prompt_sharing
    st = engine.state
    engine._prefill([0, 1, 2, 3], [[1, 2, 3], [1, 2, 3], [4, 5], [1, 2, 3]], 0)
    assert st.share_source.tolist() == [0, 0, 2, 0] and st.share_end.tolist() == [0, 3, 0, 3]
    assert torch.equal(engine.cache[:, :, 3, :, :3], engine.cache[:, :, 0, :, :3])  # own copies kept
    engine._prefill([0], [[9, 9]], 0)  # the source row is refilled: its samples use their copies
    assert st.share_source.tolist()[0] == 0 and st.share_end.tolist() == [0, 0, 0, 0]
    engine._prefill([1, 2], [[7, 8], [7, 8]], 0)
    assert st.share_source.tolist()[1:3] == [1, 1] and st.share_end.tolist()[1:3] == [0, 2]
    engine._compact([2, 3])  # row 2 (reading row 1, not live) -> row 0 on its own copy
    assert st.share_source.tolist() == [0, 1, 2, 3] and st.share_end.tolist() == [0, 0, 0, 0]
    engine._prefill([0, 1, 2], [[6], [6], [6]], 0)
    engine._compact([1, 2])  # both follow: row 1 -> 0, row 2 (source 0, not live) -> 1 on its own copy
    assert st.share_source.tolist()[:2] == [0, 1] and st.share_end.tolist()[:2] == [0, 0]
    engine._prefill([0, 1, 2], [[5, 4], [3], [5, 4]], 0)
    engine._compact([1, 2])  # row 2 reads row 0, which is not live
    assert st.share_end.tolist()[:2] == [0, 0]
    engine._prefill([0, 1, 2, 3], [[3], [5, 4], [6], [5, 4]], 0)
    engine._compact([1, 3])  # row 3 reads row 1: both live, the source moves to row 0
    assert st.share_source.tolist()[:2] == [0, 0] and st.share_end.tolist()[:2] == [0, 2]


def op_case(paged: bool, seed: int = 6):
    """``attend_new``'s arguments with every option of one cache layout: 2 partial products and a
    projection bias, RoPE rows per slot, 2 chunks, own counters, 2 sub-blocks; shared prompt rows
    (static cache) or a block table (paged). Returns ``(proj, layer, bias, length, cos, sin, positions,
    columns, heads, kv_heads, options, q)``, ``q`` queries for ``attend`` over the same cache."""
    gen = torch.Generator().manual_seed(seed)
    n, kv_heads, group, dim, columns = 3, 2, 3, 16, 128
    heads = kv_heads * group
    layer = torch.randn(2, 4, kv_heads, columns, dim, generator=gen)
    bias = torch.zeros(n, columns)
    bias[:2, :5] = float("-inf")
    options = dict(splits=2, subblocks=2, block_n=64, counters=torch.zeros(16, dtype=torch.int32, device=DEVICE),
                   proj_bias=torch.randn((heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE))
    if paged:
        layer, table = decode_attention.paginate(layer, 64, gen)
        options["pages"] = (table.to(DEVICE), 64)
    else:
        options["shared"] = (torch.tensor([0, 0, 2], dtype=torch.int32, device=DEVICE),
                             torch.tensor([0, 40, 0], dtype=torch.int32, device=DEVICE))
    proj = torch.randn(2, n, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = torch.randn(2, n, dim, generator=gen)
    q = torch.randn(n, kv_heads, group, dim, generator=gen)
    at = torch.tensor([100, 70, 41])
    return (proj.to(DEVICE), layer.to(DEVICE), bias.to(DEVICE), 110, cos.to(DEVICE), sin.to(DEVICE), None,
            at.to(DEVICE), heads, kv_heads, options, q.to(DEVICE))


def test_attention_kernels_are_custom_ops_with_fake_implementations():
    """``attend`` and ``attend_new`` under fake tensors (what the compiler traces with), with every
    option, go through ``rlcore::attend`` / ``rlcore::attend_new``: shapes and dtypes of the results,
    no kernel launched (a launch on fake tensors fails)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = [op_case(paged) for paged in (False, True)]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads, options, q in cases:
            proj, layer, q = (mode.from_tensor(t.to(torch.bfloat16)) for t in (proj, layer, q))
            new = decode_attention.attend_new(proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads,
                                              **options)
            options = {key: value for key, value in options.items() if key != "proj_bias"}
            plain = decode_attention.attend(q, layer, bias, length, **options)
            assert new.shape == (3, heads * 16) and new.dtype == torch.bfloat16
            assert plain.shape == (3, heads * 16) and plain.dtype == torch.bfloat16
            assert type(new) is not torch.Tensor  # a fake result: nothing ran
    assert torch.ops.rlcore.attend_new.default._schema.arguments[1].alias_info.is_write  # the cache is written


@needs_kernel
@pytest.mark.parametrize("paged", [False, True])
def test_attention_ops_compile_into_one_graph(paged, monkeypatch):
    """A function calling ``attend_new`` and ``attend`` (every option) on one layer of a cache compiles
    with ``fullgraph=True`` into one graph that holds both operators, and gives the eager results and
    cache writes: eager graph, AOT autograd's functionalised graph, and Inductor, which calls the
    operators on the cache itself (no copy of it). Called eagerly, they launch the kernels directly,
    without the operators' dispatch."""
    from torch._inductor.utils import run_and_get_code

    proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads, options, q = op_case(paged)
    plain_options = {key: value for key, value in options.items() if key != "proj_bias"}
    cache = torch.stack((torch.zeros_like(layer), layer))  # [L, ...]: the engine passes cache[index]

    def step(proj, cache, q):
        new = decode_attention.attend_new(proj, cache[1], bias, length, cos, sin, positions, at, heads, kv_heads,
                                          **options)
        return new, decode_attention.attend(q, cache[1], bias, length, **plain_options)

    expected_cache = cache.clone()
    with monkeypatch.context() as patch:
        for name in ("attend_op", "attend_new_op"):
            patch.setattr(decode_attention, name, None)
        expected = step(proj, expected_cache, q)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for backend in (recording, "aot_eager", "inductor"):
        torch._dynamo.reset()
        got_cache = cache.clone()
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        got, code = run_and_get_code(compiled, proj, got_cache, q) if backend == "inductor" else (
            compiled(proj, got_cache, q), None)
        for a, b in zip(got, expected):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_cache, expected_cache) and not torch.equal(got_cache, cache)
    targets = {node.target for node in graphs[0].graph.nodes}
    assert {torch.ops.rlcore.attend_new.default, torch.ops.rlcore.attend.default} <= targets
    code = "\n".join(code)
    assert re.search(r"rlcore\.attend_new\.default\(\w+, reinterpret_tensor\(", code)  # in place, on the cache
    assert "copy_" not in code and "clone" not in code
    assert int(options["counters"].abs().sum()) == 0  # the chunks' counters are left at zero


@needs_kernel
@pytest.mark.parametrize("paged", [False, True])
def test_attention_ops_pass_opcheck(paged):
    """``torch.library.opcheck``: the declared mutations are the real ones (the cache written by
    ``attend_new``), the fake implementations match the kernels' results, and AOT autograd traces both."""
    proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads, options, q = op_case(paged)
    flat = decode_attention._flat(options.get("shared"), options.get("pages"))
    tuning = (options["splits"], options["block_n"], None, None, options["counters"])
    torch.library.opcheck(torch.ops.rlcore.attend_new.default,
                          (proj, layer, bias, length, cos, sin, positions, at, heads, kv_heads, *tuning, *flat,
                           options["proj_bias"], options["subblocks"]))
    torch.library.opcheck(torch.ops.rlcore.attend.default,
                          (q, layer, bias, length, *tuning, *flat, options["subblocks"]))


def test_no_queries_give_an_empty_result():
    """No slot to decode: an empty ``[0, KVH·G·D]`` result, no launch (its width is not left to ``view``)."""
    q, layer, bias, length = make_case(3, 16)
    assert decode_attention.attend(q[:0], layer, bias[:0], length).shape == (0, 2 * 3 * 16)
