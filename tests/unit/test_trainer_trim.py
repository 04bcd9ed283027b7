"""Padding trimming and length grouping of the update: faster forwards, the same numbers."""

import copy

import pytest
import torch

from rlcore.config.schema import PPOConfig
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer.experience import Experience, batched_logprobs, used_columns
from rlcore.trainer.models import response_logprobs
from rlcore.trainer.update import micro_weights, ppo_update


def ragged_experience(model, batch=8, prompt=6, response=7, seed=0) -> Experience:
    """Left-padded prompts of 2..6 tokens and responses of 1..7 tokens (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    resp_mask = torch.zeros(batch, response)
    for row in range(batch):
        mask[row, :prompt - int(torch.randint(2, prompt + 1, (1,), generator=g))] = 0
        length = int(torch.randint(1, response + 1, (1,), generator=g))
        resp_mask[row, :length] = 1
        mask[row, prompt + length:] = 0
    mask[:, :2] = 0  # no prompt uses the first two columns
    resp_mask[:, -1] = 0  # nor any response the last one
    mask[:, -1] = 0
    with torch.no_grad():
        old, _ = response_logprobs(model, ids, mask, response)
    return Experience(input_ids=ids, attention_mask=mask, response_mask=resp_mask, old_logprobs=old * resp_mask,
                      scores=torch.zeros(batch), advantages=torch.randn(batch, response, generator=g) * resp_mask)


def assert_same_tokens_and_logprobs(model, exp: Experience, cut: Experience) -> None:
    """``cut`` (a trimmed ``exp``) holds every real token, and its response log-probs are ``exp``'s."""
    assert int(cut.attention_mask.sum()) == int(exp.attention_mask.sum())
    assert int(cut.response_mask.sum()) == int(exp.response_mask.sum())
    full, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len)
    short, _ = response_logprobs(model, cut.input_ids, cut.attention_mask, cut.response_len)
    m = cut.response_mask.bool()
    torch.testing.assert_close(short[m], full[:, :cut.response_len][m], rtol=1e-5, atol=1e-5)


def test_used_columns():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    resp = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert used_columns(mask, resp) == (1, 2)  # prompt columns 1..3, response columns 0..1
    assert used_columns(torch.zeros(2, 7), torch.zeros(2, 3)) == (3, 1)  # keeps one prompt and one response column


def test_trimmed_experience_drops_unused_columns_only():
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model)
    cut = exp.trimmed()
    assert cut.input_ids.shape[1] < exp.input_ids.shape[1] and cut.response_len == exp.response_len - 1
    assert_same_tokens_and_logprobs(model, exp, cut)
    trimmed = batched_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, 1.0, 3,
                               exp.response_mask)
    plain = batched_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, 1.0, 3)
    m = exp.response_mask.bool()
    torch.testing.assert_close(trimmed[m], plain[m], rtol=1e-5, atol=1e-5)


def test_token_weights_follow_the_token_counts():
    resp = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]).float()
    idx = torch.tensor([0, 1, 2, 3])
    assert micro_weights(resp, idx, 2, "token-mean") == pytest.approx([5 / 10, 5 / 10])
    assert micro_weights(resp, torch.tensor([0, 3, 2, 1]), 2, "token-mean") == pytest.approx([7 / 10, 3 / 10])
    assert micro_weights(resp, idx, 3, "seq-mean-token-mean") == pytest.approx([3 / 4, 1 / 4])


def _update(model, exp, **ppo_kw):
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    ppo = PPOConfig(**ppo_kw)
    ppo_update(exp, actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=0.0, ppo=ppo, grad_accum=1,
               temperature=1.0, kl_loss_coef=0.0, generator=torch.Generator().manual_seed(0))
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_trimming_and_grouping_leave_the_update_unchanged(loss_agg):
    """One optimizer step: the whole batch in one forward == micro-batches of 2, trimmed and grouped by length."""
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=1)
    whole = _update(model, exp, micro_batch_size=8, trim_padding=False, group_by_length=False, loss_agg=loss_agg)
    cut = _update(model, exp, micro_batch_size=2, trim_padding=True, group_by_length=True, loss_agg=loss_agg)
    plain = _update(model, exp, micro_batch_size=2, trim_padding=False, group_by_length=False, loss_agg=loss_agg)
    assert max(float(d.abs().max()) for d in whole) > 0
    for a, b, c in zip(whole, cut, plain):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-3, atol=1e-5)


def test_trimmed_rows_are_widened_to_an_aligned_width_with_padding_only():
    """Compiled layers specialise on the row width's alignment: a trimmed micro-batch is widened to a
    multiple of TRIM_MULTIPLE with padding columns (left first), and its log-probs stay the same."""
    from rlcore.trainer.experience import TRIM_MULTIPLE

    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, batch=6, prompt=20, response=24, seed=3)
    first, kept = used_columns(exp.attention_mask, exp.response_mask)
    tight = exp.input_ids.shape[1] - exp.response_len - first + kept
    assert tight % TRIM_MULTIPLE != 0, "the test needs a tight width that is not aligned"
    cut = exp.trimmed()
    assert cut.input_ids.shape[1] % TRIM_MULTIPLE == 0 and cut.input_ids.shape[1] < exp.input_ids.shape[1]
    assert cut.input_ids.shape[1] - tight < TRIM_MULTIPLE
    assert_same_tokens_and_logprobs(model, exp, cut)


@pytest.mark.parametrize("seed", range(6))
def test_row_columns_of_any_rows_give_their_used_columns(seed):
    """The update reads each row's used columns to the host once and cuts every micro-batch from them:
    for any subset of rows (no prompt, no trained token, gaps, all-padding rows) the same as reading the
    subset's masks."""
    from rlcore.trainer.experience import row_columns, rows_used

    g = torch.Generator().manual_seed(seed)
    rows, prompt_cols, response_cols = 9, (0, 5, 7)[seed % 3], (1, 6, 0)[seed // 2 % 3]
    attention = (torch.rand(rows, prompt_cols + response_cols, generator=g) < 0.6).long()
    response = (torch.rand(rows, response_cols, generator=g) < 0.4).long() * attention[:, prompt_cols:]
    first, kept = row_columns(attention, response)
    for _ in range(20):
        idx = torch.randperm(rows, generator=g)[:int(torch.randint(1, rows + 1, (1,), generator=g))]
        assert rows_used(first[idx], kept[idx], prompt_cols) == used_columns(attention[idx], response[idx])


def test_the_update_trims_from_the_host_sizes_as_from_the_masks(monkeypatch):
    """With the columns read once an update, each trimmed micro-batch is what trimming its own masks gives:
    the update's result is unchanged, and no micro-batch reads its masks for it."""
    import rlcore.trainer.experience as experience
    import rlcore.trainer.update as update

    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=4)
    calls = []
    plain = experience.used_columns
    monkeypatch.setattr(experience, "used_columns", lambda *a: calls.append(1) or plain(*a))
    with monkeypatch.context() as m:  # each micro-batch trimmed from its own masks
        m.setattr(update._Sizes, "used", lambda self, idx: None)
        expected = _update(copy.deepcopy(model), exp, trim_padding=True, micro_batch_size=3)
    assert len(calls) == 3
    calls.clear()
    got = _update(copy.deepcopy(model), exp, trim_padding=True, micro_batch_size=3)
    assert calls == []
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_the_host_knows_which_rows_are_contiguous_and_their_longest():
    """``SampleSizes.known``: the longest row where every row's tokens are one run, ``None`` where some row
    has a hole or attends no response column; the trained tokens summed."""
    from rlcore.trainer.sizes import host_sizes

    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=2)
    sizes = host_sizes(exp)
    every = torch.arange(exp.size)
    known = sizes.known(every)
    assert known.longest == int(exp.attention_mask.sum(-1).max())
    assert known.trained == int(exp.response_mask.sum())
    assert sizes.known(torch.tensor([1, 3])).trained == int(exp.response_mask[[1, 3]].sum())
    holed = ragged_experience(model, seed=2)
    row = 5
    cols = holed.attention_mask[row].nonzero().flatten()
    holed.attention_mask[row, cols[1]] = 0  # a hole after its first token
    sizes = host_sizes(holed)
    assert sizes.known(every).longest is None
    others = torch.tensor([r for r in range(exp.size) if r != row])
    assert sizes.known(others).longest == int(holed.attention_mask[others].sum(-1).max())
    silent = ragged_experience(model, seed=2)
    silent.attention_mask[0, silent.attention_mask.shape[1] - silent.response_len:] = 0  # no response attended
    assert host_sizes(silent).known(every).longest is None


def test_the_update_shapes_its_forwards_from_the_host_sizes(monkeypatch):
    """With the rows' sizes from the host the update is unchanged bit for bit, moves the rows left with the
    longest it was given (no read of the device for it) and finds the trained tokens with a count known in
    advance; a micro-batch with a hole still checks its rows on the device."""
    import rlcore.trainer.aligned as aligned
    import rlcore.trainer.models as models
    import rlcore.trainer.update as update

    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=4)
    cols = exp.attention_mask[6].nonzero().flatten()
    exp.attention_mask[6, cols[1]] = 0  # sample 6 has a hole
    given = []
    plain = aligned.align_left
    monkeypatch.setattr(models, "align_left", lambda *a, longest=None, **k: given.append(longest) or
                        plain(*a, longest=longest, **k))
    with monkeypatch.context() as m:
        m.setattr(update._Sizes, "known", lambda self, idx: None)
        expected = _update(copy.deepcopy(model), exp, trim_padding=True, micro_batch_size=3, group_by_length=False)
    assert given and all(v is None for v in given)
    given.clear()
    statics = []
    nonzero_static = torch.nonzero_static
    monkeypatch.setattr(torch, "nonzero_static", lambda *a, **k: statics.append(k["size"]) or nonzero_static(*a, **k))
    got = _update(copy.deepcopy(model), exp, trim_padding=True, micro_batch_size=3, group_by_length=False)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert len(given) == 3 and sum(v is None for v in given) == 1  # the micro-batch holding sample 6
    # the two micro-batches moved left find their trained tokens by count (the holed one runs masked)
    assert len(statics) == 2 and 0 < sum(statics) < int(exp.response_mask.sum())


@pytest.mark.parametrize("max_tokens", [0, 40])
def test_the_no_grad_passes_shape_their_chunks_from_the_host_sizes(max_tokens, monkeypatch):
    """The old/reference log-prob and value passes cut and shape each chunk from the sizes the host read once:
    the same values bit for bit as from each chunk's masks, with the chunks' rows moved left by a longest
    known in advance (a chunk holding a row with a hole still checks on the device)."""
    import rlcore.trainer.models as models
    from rlcore.trainer.aligned import align_left
    from rlcore.trainer.experience import batched_values
    from rlcore.trainer.sizes import host_sizes

    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=7)
    cols = exp.attention_mask[2].nonzero().flatten()
    exp.attention_mask[2, cols[1]] = 0  # sample 2 has a hole
    given = []
    monkeypatch.setattr(models, "align_left", lambda *a, longest=None, **k: given.append(longest) or
                        align_left(*a, longest=longest, **k))
    args = (exp.input_ids, exp.attention_mask, exp.response_len)
    plain = batched_logprobs(model, *args, 1.0, 3, exp.response_mask, max_tokens=max_tokens)
    assert given and all(v is None for v in given)
    given.clear()
    sizes = host_sizes(exp)
    shaped = batched_logprobs(model, *args, 1.0, 3, exp.response_mask, max_tokens=max_tokens, sizes=sizes)
    assert torch.equal(plain, shaped)
    assert sum(v is None for v in given) == 1 and len(given) >= 2
    critic = _ValueHead(model)
    assert torch.equal(batched_values(critic, *args, 3, exp.response_mask, max_tokens=max_tokens),
                       batched_values(critic, *args, 3, exp.response_mask, max_tokens=max_tokens, sizes=sizes))


class _ValueHead(torch.nn.Module):
    """A value model over the tiny LM: the hidden state's first feature (``[B, T]``)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        out = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return out.last_hidden_state[..., 0]
