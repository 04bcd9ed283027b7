"""Training forwards without an attention mask (rlcore.trainer.aligned): each row's tokens moved to
its first column, the attention's causal path, the same log-probs, values and gradients as the
masked forward; rows with holes keep their mask at a width the cuDNN backward computes."""

import copy

import pytest
import torch

from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import aligned as aligned_module
from rlcore.trainer import models
from rlcore.trainer.aligned import align_left, safe_masked_width
from rlcore.trainer.models import ValueModel, position_ids, response_logprobs, response_values, set_logprob_head
from rlcore.trainer.packing import pack

from test_trainer_trim import ragged_experience


def _masked_reference(model, ids, mask, response_len, temperature=1.0):
    """Log-probs of the last ``response_len`` tokens from the model's own logits under its 2-D mask."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
    logits = logits[:, -(response_len + 1):-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -response_len:, None])[..., 0]


class _AttentionSpy:
    """Records the ``attn_mask`` and ``is_causal`` of every SDPA call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, *args, **kwargs):
            self.calls.append((attn_mask is not None, bool(kwargs.get("is_causal", False)), q.shape[-2]))
            return real(q, k, v, attn_mask, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def test_align_left_moves_each_rows_tokens_to_column_zero():
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, batch=6, seed=2)
    rows = align_left(exp.input_ids, exp.attention_mask)
    assert rows is not None and rows.input_ids.shape[1] % 8 == 0
    for b in range(6):
        real = exp.input_ids[b][exp.attention_mask[b].bool()]
        n = len(real)
        assert torch.equal(rows.input_ids[b, :n], real)
        assert int(rows.lengths[b]) == n
    assert torch.equal(rows.position_ids[0], torch.arange(rows.input_ids.shape[1]))
    # the aligned column predicting response column j is the one holding the token just before it
    pos = rows.response_positions(exp.response_len)
    prompt_cols = exp.input_ids.shape[1] - exp.response_len
    for b in range(6):
        for j in range(int(exp.response_mask[b].sum())):
            assert rows.input_ids[b, pos[b, j]] == exp.input_ids[b, prompt_cols + j - 1]
            assert rows.input_ids[b, pos[b, j] + 1] == exp.input_ids[b, prompt_cols + j]


def test_rows_with_a_hole_or_no_token_are_not_aligned():
    ids = torch.arange(12).view(2, 6)
    holed = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1]])
    assert align_left(ids, holed) is None
    empty = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
    assert align_left(ids, empty) is None


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "gpt2"])
def test_the_training_forward_passes_no_mask_and_gives_the_masked_forwards_logprobs(family, monkeypatch):
    model = tiny_causal_lm(family)
    exp = ragged_experience(model, batch=8, seed=5)
    want = _masked_reference(model, exp.input_ids, exp.attention_mask, exp.response_len, 0.7).detach()
    spy = _AttentionSpy(monkeypatch)
    got, ent = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, 0.7, with_entropy=True)
    assert spy.calls and all(not masked and causal for masked, causal, _ in spy.calls), spy.calls
    m = exp.response_mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all() and torch.isfinite(ent).all()


def test_gradients_equal_the_masked_forwards():
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, batch=8, seed=7)
    m = exp.response_mask
    results = []
    for aligned in (True, False):
        copy_ = copy.deepcopy(model)
        if aligned:
            logp, _ = response_logprobs(copy_, exp.input_ids, exp.attention_mask, exp.response_len)
        else:
            logp = _masked_reference(copy_, exp.input_ids, exp.attention_mask, exp.response_len)
        (logp * m * exp.advantages).sum().backward()
        results.append({n: p.grad.clone() for n, p in copy_.named_parameters()})
    for name, grad in results[0].items():
        torch.testing.assert_close(grad, results[1][name], rtol=1e-4, atol=1e-4 * float(grad.abs().max()), msg=name)


def test_a_model_without_a_plain_head_uses_its_own_logits_over_the_window(monkeypatch):
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, batch=8, seed=9)
    want, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len)
    monkeypatch.setattr(models, "split_head", lambda *a, **k: None)
    got, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len)
    m = exp.response_mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)


def test_the_fused_head_reads_the_aligned_positions():
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, batch=8, seed=11)
    want = _masked_reference(model, exp.input_ids, exp.attention_mask, exp.response_len).detach()
    fused = copy.deepcopy(model)
    set_logprob_head(fused, "fused")
    got, _ = response_logprobs(fused, exp.input_ids, exp.attention_mask, exp.response_len,
                               response_mask=exp.response_mask)
    m = exp.response_mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
    assert (got[~m] == 0).all()


def test_critic_values_equal_the_masked_forwards(monkeypatch):
    critic = ValueModel.from_causal_lm(tiny_causal_lm("qwen2"))
    exp = ragged_experience(tiny_causal_lm("qwen2"), batch=8, seed=13)
    ids, mask, r = exp.input_ids, exp.attention_mask, exp.response_len
    want = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))[:, -(r + 1):-1]
    spy = _AttentionSpy(monkeypatch)
    got = response_values(critic, ids, mask, r)
    assert spy.calls and not any(masked for masked, _, _ in spy.calls)
    m = exp.response_mask.bool()
    torch.testing.assert_close(got[m], want[m].float(), rtol=1e-5, atol=1e-5)


def test_rows_with_holes_keep_their_mask_at_a_width_off_the_cudnn_remainder(monkeypatch):
    model = tiny_causal_lm("qwen2", max_position_embeddings=512)
    g = torch.Generator().manual_seed(0)
    width, r = 192, 16  # 192 % 128 == 64: the cuDNN backward's failing case under a mask
    ids = torch.randint(3, model.config.vocab_size, (2, width), generator=g)
    mask = torch.ones(2, width, dtype=torch.long)
    mask[0, :20] = 0
    mask[1, 50:60] = 0  # a hole: this batch keeps its mask
    spy = _AttentionSpy(monkeypatch)
    got, _ = response_logprobs(model, ids, mask, r)
    assert spy.calls and all(masked for masked, _, _ in spy.calls)
    assert all(length % 128 != 64 for _, _, length in spy.calls), spy.calls
    monkeypatch.undo()
    want = _masked_reference(model, ids, mask, r).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [64, 192, 320, 1344, 2112, 200, 1024])
def test_masked_widths_avoid_64_past_a_multiple_of_128(width):
    safe = safe_masked_width(width)
    assert safe >= width and safe % 128 != 64 and safe - width < 16 and (safe - width) % 8 == 0


def test_packed_rows_never_fill_to_64_past_a_multiple_of_128():
    for n in range(1, 400, 7):
        ids = torch.arange(n + 3)[None] % 50 + 3
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        rows = pack(ids, mask, torch.ones(1, 2))
        length = rows.input_ids.shape[1]
        assert length >= n and length % 8 == 0 and length % 128 != 64


def test_token_budgets_count_the_aligned_width(monkeypatch):
    from rlcore.trainer import aligned
    from rlcore.trainer.packing import group_cost

    # a long prompt with a short response beside a short prompt with a long response: aligned, the
    # rows are as wide as the longest sample, not the longest prompt plus the longest response
    assert group_cost([100, 10], [10, 100], packed=False) == 2 * 110
    monkeypatch.setattr(aligned, "ENABLED", False)
    assert group_cost([100, 10], [10, 100], packed=False) == 2 * 200
    assert group_cost([100, 10], [10, 100], packed=True) == 220


def test_with_a_response_mask_the_head_runs_on_the_response_tokens_only(monkeypatch):
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, batch=8, seed=15)
    want = _masked_reference(model, exp.input_ids, exp.attention_mask, exp.response_len).detach()
    rows = []
    real = torch.nn.functional.linear
    head = model.get_output_embeddings().weight

    def counting(x, w, *args, **kwargs):
        if w.data_ptr() == head.data_ptr():
            rows.append(x.shape[:-1].numel())
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    got, ent = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, with_entropy=True,
                                 response_mask=exp.response_mask)
    m = exp.response_mask.bool()
    assert rows == [int(m.sum())]  # one head product, over the response tokens alone
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
    assert (got[~m] == 0).all() and (ent[~m] == 0).all() and torch.isfinite(ent).all()


class _PackedCheckSpy:
    """Counts the calls that reach Hugging Face's own packed-sequence check (which reads the device)."""

    def __init__(self, monkeypatch):
        import transformers.masking_utils as masking

        aligned_module._install_check()
        wrapper = masking.find_packed_sequence_indices
        self.calls = 0
        original = wrapper.__wrapped__

        def counted(position_ids, *args, **kwargs):
            self.calls += 1
            return original(position_ids, *args, **kwargs)

        monkeypatch.setattr(wrapper, "__wrapped__", counted)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_aligned_forwards_skip_the_models_packed_sequence_check(family, monkeypatch):
    """The rows moved left are never packed: their forwards (actor and critic) do not run the model's check
    of the position ids, which reads the device; a forward outside them still does, with the same result."""
    model = tiny_causal_lm(family)
    exp = ragged_experience(model, batch=6, seed=17)
    want = _masked_reference(model, exp.input_ids, exp.attention_mask, exp.response_len).detach()
    spy = _PackedCheckSpy(monkeypatch)
    got, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len)
    response_values(ValueModel.from_causal_lm(tiny_causal_lm(family)), exp.input_ids, exp.attention_mask,
                    exp.response_len)
    assert spy.calls == 0
    m = exp.response_mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
    positions = torch.arange(8)[None].expand(2, -1)
    model(input_ids=torch.ones(2, 8, dtype=torch.long), position_ids=positions, use_cache=False)
    assert spy.calls == 1


def test_the_packed_sequence_answer_holds_only_in_its_block_and_thread():
    import threading

    import transformers.masking_utils as masking

    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    aligned_module._install_check()
    assert masking.find_packed_sequence_indices(packed) is not None
    seen = []
    with aligned_module.rows_not_packed():
        assert masking.find_packed_sequence_indices(packed) is None
        with aligned_module.rows_not_packed():  # nested blocks
            assert masking.find_packed_sequence_indices(packed) is None
        assert masking.find_packed_sequence_indices(packed) is None
        other = threading.Thread(target=lambda: seen.append(masking.find_packed_sequence_indices(packed)))
        other.start()
        other.join()
    assert seen[0] is not None and seen[0].tolist() == [[0, 0, 0, 1, 1, 1]]
    assert masking.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 1]]
    aligned_module._install_check()  # installed once: not wrapped twice
    assert not getattr(masking.find_packed_sequence_indices.__wrapped__, "_rlcore_rows_not_packed", False)
