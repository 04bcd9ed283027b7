"""Rollout/trainer mismatch: the truncated importance weights and the mismatch metrics, by hand; their wiring in the loss."""

import copy
import math
from collections import defaultdict

import pytest
import torch

from rlcore import rlmath
from rlcore.config.schema import PPOConfig
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer.update import actor_micro_loss, ppo_update

from test_trainer_trim import ragged_experience

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.3, -9.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.4, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_weights_by_hand():
    w, m = rlmath.rollout_is_weights(OLD, ROLLOUT, MASK, "token", cap=1.5)
    # rho = exp(old - rollout): e^0.5 = 1.65 -> capped 1.5, e^-1, e^0, e^-0.2, e^0.1; masked -> 0
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0], [math.exp(-0.2), math.exp(0.1), 0.0]])
    torch.testing.assert_close(w, expected)
    assert float(m["capped_frac"]) == pytest.approx(1 / 5)
    assert float(m["mean"]) == pytest.approx(float(expected.sum()) / 5)


def test_sequence_weights_by_hand():
    w, m = rlmath.rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", cap=1.0)
    # row 0: exp(0.5 - 1 + 0) = e^-0.5; row 1: exp(-0.2 + 0.1) = e^-0.1 (the masked -9 vs 0 is not counted)
    expected = torch.tensor([[math.exp(-0.5)] * 3, [math.exp(-0.1)] * 2 + [0.0]])
    torch.testing.assert_close(w, expected)
    assert float(m["capped_frac"]) == 0.0
    w, m = rlmath.rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", cap=0.8)
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.5)] * 3, [0.8, 0.8, 0.0]]))
    assert float(m["capped_frac"]) == pytest.approx(2 / 5)


def test_none_weights_and_bad_arguments():
    w, _ = rlmath.rollout_is_weights(OLD, ROLLOUT, MASK, "none", cap=2.0)
    assert w.tolist() == [[1, 1, 1], [1, 1, 0]]
    with pytest.raises(ValueError, match="token, sequence"):
        rlmath.rollout_is_weights(OLD, ROLLOUT, MASK, "tokens", cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        rlmath.rollout_is_weights(OLD, ROLLOUT, MASK, "token", cap=0.0)


def test_weights_carry_no_gradient_and_scale_the_token_losses():
    old = OLD.clone().requires_grad_(True)
    w, _ = rlmath.rollout_is_weights(old, ROLLOUT, MASK, "token", cap=2.0)
    assert not w.requires_grad
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0], [0.5, 1.0, 3.0]])
    plain, _ = rlmath.policy_loss(logp, torch.zeros(2, 3), adv, MASK, 0.2, loss_agg="seq-mean-token-sum")
    weighted, _ = rlmath.policy_loss(logp, torch.zeros(2, 3), adv, MASK, 0.2, loss_agg="seq-mean-token-sum",
                                     token_weights=w)
    # ratio 1: per-token loss -A; seq-mean of token sums
    assert float(plain.detach()) == pytest.approx(-(1 - 1 + 2 + 0.5 + 1) / 2)
    expected = -(w[0] * adv[0]).sum() - (w[1, :2] * adv[1, :2]).sum()
    assert float(weighted.detach()) == pytest.approx(float(expected) / 2)


def test_mismatch_metrics_by_hand():
    m = rlmath.logprob_mismatch(ROLLOUT, OLD, MASK)
    diffs = [0.5, 1.0, 0.0, 0.2, 0.1]
    assert float(m["abs_diff_mean"]) == pytest.approx(sum(diffs) / 5)
    assert float(m["abs_diff_max"]) == pytest.approx(1.0)
    # k3 of KL(rollout || trainer): r - 1 - log r with r = exp(trainer - rollout)
    logr = [0.5, -1.0, 0.0, -0.2, 0.1]
    assert float(m["kl"]) == pytest.approx(sum(math.exp(x) - 1 - x for x in logr) / 5, rel=1e-5)


def _grads(model, exp, **ppo_kw):
    model = copy.deepcopy(model)
    actor_micro_loss(model, exp, PPOConfig(**ppo_kw), 1.0, 0.0, 1.0, defaultdict(list))
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_correction_in_the_actor_loss(mode):
    """Sampler log-probs log(2) below the trainer's on every token: token weights 2 (or the cap); sequence
    weights 2^length, capped, per row. The gradient of a token-sum loss scales by exactly that."""
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=2)
    plain = _grads(model, exp)
    exp.rollout_logprobs = exp.old_logprobs - math.log(2.0)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, exp), plain))  # rollout_is=none: unchanged
    if mode == "token":
        for cap, factor in ((3.0, 2.0), (1.5, 1.5)):
            got = _grads(model, exp, rollout_is="token", rollout_is_cap=cap)
            for a, b in zip(got, plain):
                torch.testing.assert_close(a, factor * b, rtol=1e-4, atol=1e-6)
        return
    lengths = exp.response_mask.sum(-1)
    row = int(lengths.argmin())  # one row keeps its own weight 2^len (< cap); the others are capped
    cap = 2.0 ** float(lengths[row]) + 0.5
    assert (2.0 ** lengths > cap).sum() >= 1
    weights = torch.minimum(2.0 ** lengths, torch.tensor(cap))
    exp_w = copy.deepcopy(exp)
    exp_w.advantages = exp.advantages * weights[:, None]  # ratio 1: scaling A scales each token's loss
    exp_w.rollout_logprobs = None
    expected = _grads(model, exp_w)
    got = _grads(model, exp, rollout_is="sequence", rollout_is_cap=cap)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_update_logs_the_mismatch_on_and_off_policy():
    model = tiny_causal_lm("qwen2")
    exp = ragged_experience(model, seed=3)
    exp.rollout_logprobs = exp.old_logprobs + 0.25 * exp.response_mask
    for old in (exp.old_logprobs, None):  # recomputed before the update, or the update's own forward
        e = copy.deepcopy(exp)
        e.old_logprobs = old
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        out = ppo_update(e, actor=m, actor_opt=opt, actor_sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                         actor_grad_clip=0.0, ppo=PPOConfig(), grad_accum=1, temperature=1.0, kl_loss_coef=0.0)
        assert out["rollout/logprob_abs_diff_mean"] == pytest.approx(0.25, abs=1e-4)
        assert out["rollout/logprob_abs_diff_max"] == pytest.approx(0.25, abs=1e-4)
        assert out["rollout/logprob_kl"] == pytest.approx(math.exp(-0.25) - 1 + 0.25, abs=1e-4)


def test_mismatch_kl_of_tiny_gaps_is_not_cancelled_to_zero():
    """A gap of 1e-4 a token has k3 ~ 5e-9, below float32's resolution of r - 1 - log r near 1."""
    rollout = torch.full((2, 8), -2.0)
    trainer = rollout + 1e-4
    m = rlmath.logprob_mismatch(rollout, trainer, torch.ones(2, 8))
    assert float(m["kl"]) == pytest.approx(0.5e-8, rel=1e-2)
