"""The paged KV cache of the rollout engine: the same samples as the static cache, prompt pages
shared by reference, memory taken by use, preemption when the pool runs dry, and the Triton
kernel's paged reads (through Triton's interpreter on CPU when installed)."""

from __future__ import annotations

import pytest
import torch

from rlcore.kernels import decode_attention
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine, pages
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.testing import teacher_forced_logprobs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    decode_attention.triton is None or not decode_attention.available(DEVICE),
    reason="needs Triton and CUDA or TRITON_INTERPRET=1")
#: mixed lengths, one prompt longer than a page of 16
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26], [3],
           [100, 101, 102, 103]]
GROUPS = [p for p in PROMPTS for _ in range(3)]  # GRPO: 3 samples of each prompt


@pytest.fixture(scope="module")
def qwen2():
    return tiny_causal_lm("qwen2")


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=36, temperature=1.0, seed=5, eos_token_ids=(7, 11, 13, 17), pad_token_id=0),
    pytest.param(SamplingParams(max_new_tokens=36, temperature=0.0, eos_token_ids=(7, 11, 13), pad_token_id=0),
                 marks=pytest.mark.slow),
], ids=["sampled", "greedy"])
def test_paged_cache_gives_the_static_caches_samples(qwen2, params):
    """Same seed, same prompts: the same tokens and log-probs as the static cache, with GRPO groups,
    mixed prompt lengths, EOS, slots refilled (15 samples through 6 slots) and responses over
    several pages of 16 columns; the pages in use peak below the static cache's share."""
    kwargs = dict(max_batch_size=6, max_seq_len=64)
    static = RolloutEngine(qwen2, kv_cache="static", **kwargs).generate(GROUPS, params)
    engine = RolloutEngine(qwen2, page_size=16, **kwargs)
    assert engine.paged and engine.cache.shape[4] == 16
    paged = engine.generate(GROUPS, params)
    assert torch.equal(paged.response_ids, static.response_ids)
    assert torch.equal(paged.response_mask, static.response_mask)
    assert torch.allclose(paged.logprobs, static.logprobs, atol=1e-5)
    if params.eos_token_ids:
        assert len(set(paged.response_mask.sum(-1).tolist())) > 2  # sequences ended at different steps
    assert paged.response_mask.sum(-1).max() > 16  # some responses span several pages
    stats = paged.stats
    assert stats["rollout/preemptions"] == 0
    static_pages = 6 * (64 // 16)  # the static layout's pages: every slot at max_seq_len
    assert 0 < stats["rollout/kv_pages_peak"] < static_pages
    assert engine.pool.used == 0  # every page back in the pool after the call


def test_prompt_pages_are_shared_by_reference(qwen2):
    """The samples of a prompt point at its full pages (one reference each); only the page the
    prompt ends in, where each sample goes on writing, is copied; pages wholly in the left padding
    are the null page; releasing every slot frees every page."""
    engine = RolloutEngine(qwen2, max_batch_size=6, max_seq_len=64, page_size=16)
    long, short = list(range(1, 21)), [5, 6, 7]  # 20 tokens: a full page and 4 columns of the next
    engine._prefill([0, 1, 2, 3, 4], [long, long, long, short, short], 0)
    owned = engine.slot_pages
    assert owned[0][0] == owned[1][0] == owned[2][0] != 0  # the full prompt page, shared
    assert len({owned[0][1], owned[1][1], owned[2][1]}) == 3  # the partial page: each its own
    assert engine.pool.refs[owned[0][0]] == 3 and engine.pool.refs[owned[1][1]] == 1
    assert owned[3][0] == owned[4][0] == 0  # the short prompt's first page is padding only
    assert owned[3][1] != owned[4][1]  # it ends inside its second page: copied
    assert engine.pool.used == 1 + 3 + 2
    layer = engine.cache[0, 0]  # the copies hold the prompt's keys
    assert torch.equal(layer[owned[1][1], :, :4], layer[owned[0][1], :, :4])
    assert engine.state.table[1, :2].tolist() == owned[1][:2]
    engine._release([0, 1, 2, 3, 4])
    assert engine.pool.used == 0 and engine.state.table.abs().sum() == 0
    copies = RolloutEngine(qwen2, max_batch_size=6, max_seq_len=64, page_size=16, prompt_sharing=False)
    copies._prefill([0, 1], [long, long], 0)
    assert not set(copies.slot_pages[0]) & set(copies.slot_pages[1]) and copies.pool.used == 4


@pytest.mark.slow
def test_a_small_pool_preempts_instead_of_failing(qwen2):
    """A pool of 8 pages of 16 columns (a third of what 6 slots may need): samples are preempted
    and sampled again, the call completes with every sample, greedy tokens equal the static cache's
    and sampled log-probs equal the teacher-forced ones."""
    kwargs = dict(max_batch_size=6, max_seq_len=48)
    prompts = [p for p in PROMPTS[:2] + PROMPTS[3:] for _ in range(2)]
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    small = RolloutEngine(qwen2, page_size=16, kv_pages=8, **kwargs)
    got = small.generate(prompts, greedy)
    expected = RolloutEngine(qwen2, kv_cache="static", **kwargs).generate(prompts, greedy)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert got.stats["rollout/preemptions"] > 0 and got.stats["rollout/kv_pages_peak"] <= 7
    sampled = small.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0.8, seed=1))
    assert sampled.response_mask.all()
    assert torch.allclose(sampled.logprobs, teacher_forced_logprobs(qwen2, sampled, 0.8) * sampled.response_mask, atol=1e-4)
    assert small.pool.used == 0


def test_pool_size_follows_free_memory_and_settings_are_checked(qwen2):
    per_page = pages.page_bytes(28, 4, 64, 128, torch.bfloat16)
    assert per_page == 28 * 2 * 4 * 64 * 128 * 2
    cuda = torch.device("cuda")
    # a 7B shape, 256 slots x 8704 columns: the worst case would be 256 x 137 + 1 pages (120 GiB)
    sized = pages.pool_pages(slots=256, max_seq_len=8704, page_size=64, bytes_per_page=per_page, device=cuda,
                             kv_pages=None, fraction=0.5, free_bytes=100 * 2**30)
    assert sized == int(50 * 2**30) // per_page
    assert pages.pool_pages(slots=2, max_seq_len=128, page_size=64, bytes_per_page=per_page, device=cuda,
                            kv_pages=None, fraction=0.5, free_bytes=100 * 2**30) == 2 * 3 + 1  # the worst case
    with pytest.raises(ValueError, match="kv_memory_fraction 0.5 of the free"):
        pages.pool_pages(slots=256, max_seq_len=8704, page_size=64, bytes_per_page=per_page, device=cuda,
                         kv_pages=None, fraction=0.5, free_bytes=2**28)
    with pytest.raises(ValueError, match="kv_pages 3 cannot hold one sequence"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=64, page_size=16, kv_pages=3)
    with pytest.raises(ValueError, match="kv_cache 'pages' is not one of"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=64, kv_cache="pages")
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=64, page_size=24)
    with pytest.raises(ValueError, match="kv_memory_fraction must be in"):
        RolloutEngine(qwen2, max_batch_size=2, max_seq_len=64, kv_memory_fraction=1.5)


# ----------------------------------------------------------------------------- the kernel's paged reads

def paged_case(n: int, columns: int, page_size: int, dim: int = 16, group: int = 3, kv_heads: int = 2,
               seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layer = torch.randn(2, n, kv_heads, columns, dim, generator=gen)
    pool, table = decode_attention.paginate(layer, page_size, gen)
    q = torch.randn(n, kv_heads, group, dim, generator=gen)
    bias = torch.zeros(n, table.shape[1] * page_size)
    bias[0, 10:90] = float("-inf")
    return layer.to(DEVICE), pool.to(DEVICE), table.to(DEVICE), q.to(DEVICE), bias.to(DEVICE)


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [64, 128])
def test_kernel_reads_through_the_block_table(splits, page_size):
    """Pages scattered over the pool in a shuffled order give the attention of the contiguous cache."""
    layer, pool, table, q, bias = paged_case(3, 300, page_size)
    length = 290
    got = decode_attention.attend(q, pool, bias, length, splits=splits, pages=(table, page_size))
    expected = decode_attention.reference(q, layer, bias[:, :300], length)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_writes_the_new_key_into_its_page_and_shared_prompt_pages():
    """RoPE, cache write and attention in one kernel over pages; two slots whose tables point at
    the same first pages (the samples of one prompt) read them in place."""
    layer, pool, table, _q, bias = paged_case(3, 256, 64, seed=1)
    table[1, :2] = table[0, :2]  # slot 1 shares slot 0's first 128 columns
    heads, kv_heads, dim = 6, 2, 16
    gen = torch.Generator().manual_seed(2)
    proj = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE)
    cos, sin = torch.randn(2, 256, dim, generator=gen).to(DEVICE)
    positions = torch.tensor([3, 200, 11], device=DEVICE)
    at = torch.tensor([250, 130, 64], device=DEVICE)
    for splits in (1, 2):
        expected_pool, got_pool = pool.clone(), pool.clone()
        expected = decode_attention.reference_new(proj, expected_pool, bias, 256, cos, sin, positions, at, heads,
                                                  kv_heads, pages=(table, 64))
        got = decode_attention.attend_new(proj, got_pool, bias, 256, cos, sin, positions, at, heads, kv_heads,
                                          splits=splits, pages=(table, 64))
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
        # close, not equal: on a GPU the kernel's RoPE contracts into fused multiply-adds (last bits)
        assert torch.allclose(got_pool, expected_pool, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got_pool, pool)  # the new keys were written


@needs_kernel
def test_split_kv_over_a_long_paged_context():
    """The long tail: one slot, 2,100 columns over 33 pages, cut by the long-context rule into
    chunks merged in the kernel; the same as the uncut attention."""
    splits, chunk = decode_attention.plan(2, 2100, sms=decode_attention.DEFAULT_SMS * 16)
    assert splits > 4 and chunk >= decode_attention.LONG_MIN_CHUNK
    layer, pool, table, q, bias = paged_case(1, 2112, 64, group=2, seed=3)
    bias[0, 1000:1500] = float("-inf")
    expected = decode_attention.reference(q, layer, bias[:, :2112], 2100)
    got = decode_attention.attend(q, pool, bias, 2100, splits=splits, pages=(table, 64))
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_paged_arguments_are_checked():
    layer, pool, table, q, bias = paged_case(2, 128, 64)
    with pytest.raises(ValueError, match="int32 table"):
        decode_attention.attend(q, pool, bias, 100, pages=(table.long(), 64))
    with pytest.raises(ValueError, match="not a multiple of the block"):
        decode_attention.attend(q, pool[:, :, :, :32], bias, 60, pages=(table, 32), block_n=64)
    with pytest.raises(ValueError, match="page_size 16 is not a multiple"):
        model = tiny_causal_lm("qwen2")
        from unittest import mock
        with mock.patch.object(decode_attention, "usable", lambda *args: (True, "ok")):
            RolloutEngine(model, max_batch_size=2, max_seq_len=64, page_size=16, attention="triton", compile=False)


@needs_kernel
@pytest.mark.slow
def test_engine_with_the_paged_kernel_matches_the_static_cache(qwen2):
    """The engine's Triton step over pages (RoPE and the cache write in the kernel) samples what the
    static cache with PyTorch attention samples: GRPO groups, EOS, slots refilled."""
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, eos_token_ids=(5, 9, 21), pad_token_id=0)
    prompts = GROUPS[::2]
    kwargs = dict(max_batch_size=4, max_seq_len=48, device=DEVICE)
    expected = RolloutEngine(qwen2, kv_cache="static", attention="sdpa", **kwargs).generate(prompts, params)
    engine = RolloutEngine(qwen2, attention="triton", page_size=32, attention_tuning={"block_n": 32}, **kwargs)
    assert engine.attention == "triton" and engine.paged
    got = engine.generate(prompts, params)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)


def test_preemptions_reach_the_step_metrics(qwen2):
    """The trainer's rollout metrics carry ``rollout/preemptions`` when the engine reports them."""
    from types import SimpleNamespace

    from rlcore.trainer.loop import Trainer

    engine = RolloutEngine(qwen2, max_batch_size=4, max_seq_len=48, page_size=16, kv_pages=6)
    batch = engine.generate([p for p in PROMPTS[3:] for _ in range(2)], SamplingParams(max_new_tokens=30))
    assert batch.stats["rollout/preemptions"] > 0
    trainer = SimpleNamespace(gen_cfg=SimpleNamespace(max_new_tokens=30), c=SimpleNamespace(eos_ids=[]))
    trainer.truncated = lambda rollout: Trainer.truncated(trainer, rollout)
    metrics = Trainer.rollout_metrics(trainer, batch, torch.zeros(len(batch.response_ids)))
    assert metrics["rollout/preemptions"] == batch.stats["rollout/preemptions"]


@needs_kernel
def test_extend_through_the_paged_kernel_equals_the_gathered_sdpa_extend(qwen2):
    """Ragged observation appends with the Triton engine: each new token a query of the paged decode
    kernel (its row's pages, its own key mask) gives the logits and the cache of gathering the rows'
    keys/values into one masked SDPA call."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
    appends = [[15, 16, 2, 3], [4], [17, 6, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44]]
    kwargs = dict(max_batch_size=3, max_seq_len=96, device=DEVICE, page_size=16, attention_tuning={"block_n": 16},
                  compile=False)
    results = []
    for kind in ("sdpa", "triton"):
        engine = RolloutEngine(qwen2, attention=kind, **kwargs)
        assert engine.paged and engine.attention == kind
        engine._prefill([0, 1, 2], prompts, 0)
        engine._set_pages([0, 1, 2], [engine.slot_pages[s] + engine.pool.take(3 - len(engine.slot_pages[s]))
                                      for s in range(3)])
        logits = engine._extend([0, 1, 2], appends, [18, 18, 18], [3, 2, 18], [15, 16, 0])
        results.append((logits.float(), engine))
    (want, sdpa), (got, triton) = results
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for row in range(3):  # the new keys/values landed in each row's pages alike
        mine = decode_attention.gather_pages(triton.cache[0], triton.state.table[row:row + 1], 1, 36)
        theirs = decode_attention.gather_pages(sdpa.cache[0], sdpa.state.table[row:row + 1], 1, 36)
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("width", [32, 64])
def test_extend_as_captured_equals_the_eager_extend(qwen2, width):
    """The extend a CUDA graph holds (one padded per-token table, fixed shapes, padding tokens writing to
    the null page, a power-of-two length) gives the eager extend's logits, keys and values; stale
    entries of a larger earlier extend in its buffers change nothing."""
    from rlcore.rollout.engine import extend

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
    appends = [[15, 16, 2, 3], [4], [17, 6, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44]]
    kwargs = dict(max_batch_size=3, max_seq_len=96, device=DEVICE, page_size=16, attention_tuning={"block_n": 16},
                  compile=False, attention="triton", use_cuda_graphs=False)
    results = []
    for graphs in (False, True):
        engine = RolloutEngine(qwen2, **kwargs)
        engine._prefill([0, 1, 2], prompts, 0)
        engine._set_pages([0, 1, 2], [engine.slot_pages[s] + engine.pool.take(3 - len(engine.slot_pages[s]))
                                      for s in range(3)])
        if graphs:
            engine._extend_graphs = extend.ExtendGraphs(engine, capture=False)
            engine._extend_graphs.tokens.fill_(7)  # stale values of an earlier, larger extend
            engine._extend_graphs.last.fill_(width - 1)
        null_before = engine.cache[:, :, 1:].clone()
        logits = engine._extend([0, 1, 2], appends, [18, 18, 18], [3, 2, 18], [15, 16, 0])
        assert engine.counters["extend_graph_calls"] == int(graphs)
        results.append((logits.float(), engine, null_before))
    (want, eager, _), (got, padded, before) = results
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert padded.slot_pages == eager.slot_pages
    owned = sorted({p for pages_ in padded.slot_pages[:3] for p in pages_} - {0})  # the null page is scratch
    torch.testing.assert_close(padded.cache[:, :, owned], eager.cache[:, :, owned], atol=1e-5, rtol=1e-5)
    # only the rows' new columns changed (the padding wrote to the null page alone)
    changed = (padded.cache[:, :, 1:] != before).any(-1).any(-2).any(0).any(0).nonzero().tolist()
    written = {(padded.slot_pages[r][c // 16] - 1, c % 16) for r, k in zip(range(3), (4, 1, 17))
               for c in range(18, 18 + k)}
    assert {tuple(x) for x in changed} == written


def test_extend_buckets_and_token_table():
    """Token and length buckets, and the per-token table: columns, positions, pages and the padding."""
    from rlcore.rollout.engine import extend

    assert [extend.token_bucket(n) for n in (1, 64, 65, 4096)] == [64, 64, 128, 4096]
    assert extend.token_bucket(4097) is None
    assert [extend.length_bucket(n, 1000) for n in (1, 256, 257, 900)] == [256, 256, 512, 1000]
    table, last = extend.token_table([[5, 6, 7], [8]], rows=[2, 0], columns=[14, 3], positions=[10, 1],
                                     pages=[[0, 4, 9], [3]], page_size=8, width=6)
    assert last == [2, 3]
    assert table.tolist() == [[5, 6, 7, 8, 0, 0], [2, 2, 2, 0, 0, 0], [14, 15, 16, 3, 0, 0], [10, 11, 12, 1, 0, 0],
                              [14, 14, 14, 3, 0, 0], [4, 4, 9, 3, 0, 0], [6, 7, 0, 3, 0, 0]]
    with pytest.raises(ValueError, match="do not fit"):
        extend.token_table([[1] * 7], [0], [0], [0], [[1]], 8, 6)


def test_a_freed_row_goes_back_to_the_first_columns(qwen2):
    """Paged: a row freed by a finished sample (no request waiting for it) decodes on from column 1 of
    the null page, so its idle steps attend to a few columns rather than as many as its sample had;
    the samples of the call are those of the static cache."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16]]
    engine = RolloutEngine(qwen2, max_batch_size=2, max_seq_len=40, page_size=16, attention_length_step=8)
    freed = {}
    release = engine._release

    def spy(slots, keep_pages=False):
        out = release(slots, keep_pages)
        freed.update({s: (int(engine.state.cache_index[s]), engine.slot_pages[s]) for s in slots})
        return out

    engine._release = spy
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0.0, pad_token_id=0))
    assert freed and all(col == 1 and pages_ == [] for col, pages_ in freed.values())
    params = SamplingParams(max_new_tokens=24, temperature=0.0, pad_token_id=0)
    got = engine.generate(prompts, params)
    want = RolloutEngine(qwen2, kv_cache="static", max_batch_size=2, max_seq_len=40).generate(prompts, params)
    assert torch.equal(got.response_ids, want.response_ids)
