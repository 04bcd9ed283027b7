"""The fused head (ppo.logprob_head): log-probs from the last hidden states, never the whole logits,
with the same values and gradients as the model's own logits; and token budgets lowered to what
fits without checkpointing."""

import copy

import pytest
import torch

from rlcore.kernels.linear_logprob import linear_token_logprobs
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import recompute
from rlcore.trainer.models import fused_head, response_logprobs, set_logprob_head

from test_trainer_packing import _close, _experience, _step
from test_trainer_trim import ragged_experience


@pytest.mark.parametrize("chunks", [1, 5])
def test_linear_logprobs_equal_the_log_softmax_of_the_logits_with_their_gradients(chunks):
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 320, 16, 40
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    rows = n // chunks
    logp, ent = linear_token_logprobs(hidden, weight, labels, 0.7, with_entropy=True,
                                      chunk_bytes=rows * vocab * hidden.element_size())
    (logp.double() * upstream).sum().backward()
    mine = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    z = hidden @ weight.t() / 0.7
    ref = torch.log_softmax(z, -1).gather(-1, labels[:, None])[:, 0]
    (ref * upstream).sum().backward()
    torch.testing.assert_close(logp.double(), ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(mine[0], hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mine[1], weight.grad, rtol=1e-4, atol=1e-5)
    entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(ent.double(), entropy.detach(), rtol=0, atol=1e-5)
    assert not ent.requires_grad


def test_linear_logprobs_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="hidden"):
        linear_token_logprobs(torch.zeros(4, 8), torch.zeros(10, 6), torch.zeros(4, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="labels"):
        linear_token_logprobs(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long), 1.0)


@pytest.mark.parametrize("packed", [False, True])
def test_fused_response_logprobs_equal_the_logits_path_with_the_same_gradient(packed):
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=3)
    mask = exp.response_mask.bool()
    results = []
    for mode in ("logits", "fused"):
        m = copy.deepcopy(model)
        set_logprob_head(m, mode)
        assert (fused_head(m, torch.device("cpu")) is not None) == (mode == "fused")
        logp, ent = response_logprobs(m, exp.input_ids, exp.attention_mask, exp.response_len, 0.9,
                                      with_entropy=True, entropy_grad=False, response_mask=exp.response_mask,
                                      packed=packed)
        (logp * mask * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in m.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    torch.testing.assert_close(lp_b[mask], lp_a[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b[mask], ent_a[mask], rtol=1e-5, atol=1e-5)
    assert max(float(g.abs().max()) for g in grads_a) > 1e-3
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)


def test_the_update_with_the_fused_head_equals_the_update_with_logits():
    model = tiny_causal_lm("qwen2")
    exp = _experience(model, None, seed=4, packed=False)
    set_logprob_head(model, "logits")
    plain_m, plain, _ = _step(model, None, exp, packed=False, micro_batch_size=3, rollout_is="token")
    set_logprob_head(model, "fused")  # the copies _step trains keep the choice
    fused_m, fused, _ = _step(model, None, exp, packed=False, micro_batch_size=3, rollout_is="token")
    _close(fused, plain)
    for key in ("loss/policy", "entropy/mean", "actor/approx_kl"):
        assert fused_m[key] == pytest.approx(plain_m[key], rel=1e-4, abs=1e-6), key


def test_models_with_something_between_head_and_softmax_keep_their_logits():
    model = tiny_causal_lm("qwen2")
    set_logprob_head(model, "fused")
    model.config.final_logit_softcapping = 30.0
    assert fused_head(model, torch.device("cpu")) is None
    del model.config.final_logit_softcapping
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
    assert fused_head(model, torch.device("cpu")) is None


def test_an_unknown_model_class_is_checked_against_its_own_logits():
    class Scaled(type(tiny_causal_lm("qwen2"))):  # logits scaled after the head: not a plain head
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    base = tiny_causal_lm("qwen2")
    model = Scaled(base.config)
    model.load_state_dict(base.state_dict())
    set_logprob_head(model, "fused")
    assert fused_head(model, torch.device("cpu")) is None
    plain = Scaled.__mro__[1](base.config)
    plain.load_state_dict(base.state_dict())

    class Renamed(type(plain)):
        pass

    same = Renamed(base.config)
    same.load_state_dict(base.state_dict())
    set_logprob_head(same, "fused")
    assert fused_head(same, torch.device("cpu")) is not None


def test_auto_uses_the_logits_off_cuda_and_bad_modes_are_refused():
    model = tiny_causal_lm("qwen2")
    assert fused_head(model, torch.device("cpu")) is None  # unset: the logits
    set_logprob_head(model, "auto")
    assert fused_head(model, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="auto, fused or logits"):
        set_logprob_head(model, "fast")


def test_the_fused_head_counts_no_logits_in_the_activation_estimate():
    model = tiny_causal_lm("qwen2")
    with_logits = recompute.activation_bytes_per_token(model.config, torch.float32)
    without = recompute.activation_bytes_per_token(model.config, torch.float32, logits=False)
    assert with_logits - without == model.config.vocab_size * 4


def test_a_token_budget_that_would_recompute_is_lowered_to_what_fits(monkeypatch):
    model = tiny_causal_lm("qwen2")
    from rlcore.distributed.fsdp import enable_gradient_checkpointing

    enable_gradient_checkpointing(model)
    policy = recompute.Recompute(model, "auto", model.config, torch.device("cpu"), logits=False)
    per_token = policy.bytes_per_token
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # the first backward's, kept out
    monkeypatch.setattr(recompute, "MIN_BUDGET", 16)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: int((40 * per_token + grads) / recompute.FREE_SHARE) + 1)
    assert policy.token_budget(100) == 40  # fits 40 tokens: 40, a multiple of 8
    assert policy.token_budget(32) == 32  # fits already
    assert policy.token_budget(0) == 0  # no budget: micro_batch_size decides
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 8 * per_token)
    assert policy.token_budget(100) == 100  # under the floor: keep the budget and checkpoint
    assert recompute.Recompute(model, False, model.config, torch.device("cpu"), logits=False).token_budget(100) == 100
    # with the model's own logits (the default head) the budget stays as given (measured: smaller micro-batches
    # ran slower than checkpointing the large ones), while the rate still counts a logits row
    with_logits = recompute.Recompute(model, "auto", model.config, torch.device("cpu"))
    assert with_logits.bytes_per_token > per_token
    monkeypatch.setattr(recompute, "free_bytes",
                        lambda device: int((40 * with_logits.bytes_per_token + grads) / recompute.FREE_SHARE) + 1)
    assert with_logits.token_budget(100) == 100
    assert with_logits.needed(48) and not with_logits.needed(40)  # what does not fit recomputes instead

    # the update cuts its mini-batch by the lowered budget, with the same gradient
    exp = _experience(model, None, seed=8, packed=False)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: 1 << 40)
    whole_m, whole, _ = _step(model, None, exp, packed=True, max_tokens_per_micro_batch=10_000)
    monkeypatch.setattr(recompute, "free_bytes", lambda device: int((24 * per_token + grads) / recompute.FREE_SHARE) + 1)

    def policies(roles):
        return {"actor": recompute.Recompute(roles["actor"], "auto", model.config, torch.device("cpu"), logits=False)}

    cut_m, cut, _ = _step(model, None, exp, packed=True, recompute_policies=policies,
                          max_tokens_per_micro_batch=10_000)
    assert whole_m["actor/micro_batches"] == 1 and cut_m["actor/micro_batches"] >= 3
    assert cut_m["actor/micro_batch_token_budget"] == 24
    assert cut_m.get("actor/recompute_frac", 0.0) == 0.0
    _close(cut, whole)
