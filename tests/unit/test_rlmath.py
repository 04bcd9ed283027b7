"""Unit tests for rlcore.rlmath against values worked out by hand or by plain Python loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlcore import rlmath
from rlcore.rlmath import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    broadcast_sequence_advantages,
    compute_gae,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    rloo_advantages,
    token_level_rewards,
    value_loss,
)

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# --- masked reductions ------------------------------------------------------------------------


X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = T([[1, 1, 0], [0, 1, 0]])


def test_masked_sum_and_mean_ignore_masked_values():
    close(masked_sum(X, M), 8.0)
    close(masked_mean(X, M), 8.0 / 3.0)
    close(masked_sum(X, M, dim=-1), [3.0, 5.0])
    close(masked_mean(X, M, dim=-1), [1.5, 5.0])
    close(masked_mean(X, M.bool(), dim=0), [1.0, 3.5, 0.0])


def test_masked_reductions_do_not_leak_nan_from_masked_positions():
    x = X.clone()
    x[0, 2] = float("nan")
    x[1, 0] = float("inf")
    close(masked_sum(x, M), 8.0)
    close(masked_mean(x, M), 8.0 / 3.0)


def test_masked_mean_of_nothing_is_zero():
    close(masked_mean(X, torch.zeros_like(M)), 0.0)


def test_masked_var_biased_and_unbiased():
    x = T([1.0, 2.0, 4.0, 100.0])
    m = T([True, True, True, False])
    # mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3
    close(masked_var(x, m, unbiased=False), 14.0 / 9.0)
    close(masked_var(x, m, unbiased=True), 7.0 / 3.0)


def test_masked_var_needs_enough_valid_positions():
    x = T([1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, T([True, False]))
    with pytest.raises(ValueError, match="at least 1"):
        masked_var(x, T([False, False]), unbiased=False)
    close(masked_var(x, T([True, False]), unbiased=False), 0.0)


def test_masked_whiten():
    x = T([[1.0, 2.0], [4.0, 100.0]])
    m = T([[1, 1], [1, 0]])
    std = math.sqrt(7.0 / 3.0)
    expected = [[(1 - 7 / 3) / std, (2 - 7 / 3) / std], [(4 - 7 / 3) / std, 0.0]]
    close(masked_whiten(x, m), expected, atol=1e-5)
    unshifted = [[v + 7 / 3 for v in expected[0]], [expected[1][0] + 7 / 3, 0.0]]
    close(masked_whiten(x, m, shift_mean=False), unshifted, atol=1e-5)


# --- logits -> log-probs / entropy ------------------------------------------------------------


def test_logprobs_hand_values():
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3), -1e9]]])
    labels = T([[1, 2]])
    close(logprobs_from_logits(logits, labels), [[math.log(0.25), math.log(0.5)]], atol=1e-6)
    # temperature 2 halves the logits: [0, ln 2] -> p(1) = 2/3
    two = T([[[0.0, 2 * math.log(2)]]])
    close(logprobs_from_logits(two, T([[1]]), temperature=2.0), [[math.log(2 / 3)]])


@pytest.mark.parametrize("chunk_elements", [1, 100, 1 << 26])
def test_chunked_logprobs_match_naive_log_softmax(monkeypatch, chunk_elements):
    monkeypatch.setattr(rlmath, "_LOGIT_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (5, 4), generator=gen)
    for temperature in (1.0, 0.7):
        naive = torch.log_softmax(logits / temperature, -1).gather(-1, labels[..., None])[..., 0]
        close(logprobs_from_logits(logits, labels, temperature), naive, atol=1e-5)


def test_logprobs_gradient_and_noncontiguous_and_bf16(monkeypatch):
    monkeypatch.setattr(rlmath, "_LOGIT_CHUNK_ELEMENTS", 30)  # < one row: one row per chunk
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(3, 6, 7, generator=gen, requires_grad=True)
    labels = torch.randint(0, 7, (3, 5), generator=gen)
    view = full[:, :-1]  # non-contiguous, like shifting logits against labels
    assert not view.is_contiguous()
    ours = logprobs_from_logits(view, labels, temperature=0.9)
    (g_ours,) = torch.autograd.grad(ours.sum(), full)
    naive = torch.log_softmax(view / 0.9, -1).gather(-1, labels[..., None])[..., 0]
    (g_naive,) = torch.autograd.grad(naive.sum(), full)
    close(ours, naive, atol=1e-5)
    close(g_ours, g_naive, atol=1e-5)

    low = view.detach().to(torch.bfloat16)
    out = logprobs_from_logits(low, labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(low.float(), -1).gather(-1, labels[..., None])[..., 0]
    close(out, ref, atol=1e-5)


def test_logprobs_shape_mismatch_and_bad_temperature():
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), 0.0)


def test_entropy_hand_values_and_naive(monkeypatch):
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(2), -1e9, -1e9], [50.0, 0.0, 0.0, 0.0]]])
    h_two = -(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3))
    close(entropy_from_logits(logits), [[math.log(4), h_two, 0.0]], atol=1e-5)

    monkeypatch.setattr(rlmath, "_LOGIT_CHUNK_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(3, 5, 9, generator=gen)
    logp = torch.log_softmax(z / 1.3, -1)
    close(entropy_from_logits(z, temperature=1.3), -(logp.exp() * logp).sum(-1), atol=1e-5)


# --- GAE ------------------------------------------------------------------------------------


def naive_gae(rewards, values, mask, gamma, lam):
    """Backward loop over plain floats; masked positions are skipped entirely."""
    advs, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        adv = [0.0] * len(r_row)
        ret = [0.0] * len(r_row)
        valid = [t for t, m in enumerate(m_row) if m]
        next_v, next_a = 0.0, 0.0
        for t in reversed(valid):
            delta = r_row[t] + gamma * next_v - v_row[t]
            next_a = delta + gamma * lam * next_a
            next_v = v_row[t]
            adv[t] = next_a
            ret[t] = next_a + v_row[t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def test_gae_hand_values_with_padding():
    # gamma .9, lam .8 worked out by hand:
    # A2 = 1 - .7 = .3; A1 = (.9*.7 - .6) + .72*.3 = .246; A0 = (.9*.6 - .5) + .72*.246 = .21712
    rewards = T([[0.0, 0.0, 1.0, 5.0, 7.0]])
    values = T([[0.5, 0.6, 0.7, 9.0, 9.0]])
    mask = T([[1, 1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0, 0.0]])


def test_gae_gamma_lam_one_is_monte_carlo_return_minus_value():
    rewards = T([[0.1, -0.2, 0.3, 1.0]])
    values = T([[0.4, 0.3, 0.2, 0.1]])
    adv, ret = compute_gae(rewards, values, torch.ones(1, 4), gamma=1.0, lam=1.0)
    close(ret, [[1.2, 1.1, 1.3, 1.0]])
    close(adv, [[0.8, 0.8, 1.1, 0.9]])


def test_gae_matches_naive_loop_with_holes_and_padding():
    rng = random.Random(3)
    B, L = 6, 9
    rewards = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    values = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    mask = []
    for b in range(B):
        n = rng.randint(0, L)
        row = [1 if t < n else 0 for t in range(L)]
        if b % 2 and n > 3:
            row[1] = 0  # a hole inside the response (e.g. masked tool output)
        mask.append(row)
    adv, ret = compute_gae(T(rewards, dtype=torch.float64), T(values, dtype=torch.float64),
                           T(mask).bool(), gamma=0.97, lam=0.9)
    ref_adv, ref_ret = naive_gae(rewards, values, mask, 0.97, 0.9)
    close(adv, ref_adv, atol=1e-12)
    close(ret, ref_ret, atol=1e-12)


def test_gae_does_not_whiten():
    rewards = T([[0.0, 3.0], [0.0, 3.0]])
    adv, _ = compute_gae(rewards, torch.zeros(2, 2), torch.ones(2, 2), gamma=1.0, lam=1.0)
    close(adv, [[3.0, 3.0], [3.0, 3.0]])


# --- group advantages -----------------------------------------------------------------------


def test_grpo_advantages():
    scores = T([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean .5, unbiased std sqrt(1/3); group 2 has no spread
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(grpo_advantages(scores, 4), [a, -a, -a, a, 0, 0, 0, 0], atol=1e-6)
    close(grpo_advantages(scores, 4, norm_by_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    close(grpo_advantages(scores, 1), [0.0] * 8)
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(scores, 3)


def test_rloo_advantages():
    scores = T([1.0, 2.0, 3.0, 6.0, 0.0, 1.0, 0.0, 1.0])
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3, -2 / 3, 1 - 1 / 3, -2 / 3, 1 - 1 / 3]
    close(rloo_advantages(scores, 4), expected)
    close(rloo_advantages(T([1.0, 3.0]), 2), [-2.0, 2.0])
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(scores, 1)


# --- KL and rewards -------------------------------------------------------------------------


LOGP = T([[-1.0, -2.0]])
REF = T([[-1.5, -1.0]])  # d = logp - ref = [0.5, -1.0]


def test_kl_estimators_hand_values():
    close(kl_penalty(LOGP, REF, "k1"), [[0.5, -1.0]])
    close(kl_penalty(LOGP, REF, "abs"), [[0.5, 1.0]])
    close(kl_penalty(LOGP, REF, "k2"), [[0.125, 0.5]])
    close(kl_penalty(LOGP, REF, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2.0]])


@pytest.mark.parametrize("name,alias", [("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_aliases_are_equal(name, alias):
    gen = torch.Generator().manual_seed(4)
    a, b = -torch.rand(3, 5, generator=gen) * 4, -torch.rand(3, 5, generator=gen) * 4
    torch.testing.assert_close(kl_penalty(a, b, name), kl_penalty(a, b, alias), rtol=0, atol=0)


def test_k3_is_clamped_and_stays_finite():
    logp = T([-60.0, 0.0], requires_grad=True)
    ref = T([0.0, -60.0])
    kl = kl_penalty(logp, ref, "k3")
    assert kl[0].item() == pytest.approx(10.0)
    assert kl[1].item() == pytest.approx(10.0)
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_unknown_kl_estimator_lists_names():
    with pytest.raises(ValueError, match="low_var_kl") as err:
        kl_penalty(LOGP, REF, "k4")
    assert "'k4'" in str(err.value)


def test_token_level_rewards():
    scores = T([1.0, 2.0, 3.0, 4.0])
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    close(token_level_rewards(scores, mask), [[0, 1, 0, 0], [0, 0, 0, 2], [0] * 4, [0, 0, 4, 0]])
    kl = torch.full((4, 4), 0.5)
    kl[0, 3] = float("nan")  # padding must not leak
    expected = [
        [-0.05, 1 - 0.05, 0, 0],
        [-0.05, -0.05, -0.05, 2 - 0.05],
        [0, 0, 0, 0],
        [-0.05, 0, 4 - 0.05, 0],
    ]
    close(token_level_rewards(scores, mask, kl=kl, kl_coeff=0.1), expected)


def test_broadcast_sequence_advantages():
    out = broadcast_sequence_advantages(T([1.5, -2.0]), T([[1, 1, 0], [0, 1, 1]]))
    close(out, [[1.5, 1.5, 0.0], [0.0, -2.0, -2.0]])


# --- policy loss ----------------------------------------------------------------------------


def one_token_loss(ratio, adv, **kw):
    """Loss and d loss / d logprob for a single token with the given ratio and advantage."""
    logp = T([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, T([[adv]], dtype=torch.float64), torch.ones(1, 1),
                                **{"cliprange": 0.2, **kw})
    loss.backward()
    return loss.item(), logp.grad.item(), {k: v.item() for k, v in metrics.items()}


@pytest.mark.parametrize(
    "ratio,adv,loss,grad,clipfrac",
    [
        (1.5, 1.0, -1.2, 0.0, 1.0),   # A > 0, ratio above 1 + eps: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5, 0.0),  # A > 0, ratio below 1 - eps: unclipped (pessimistic)
        (1.5, -1.0, 1.5, 1.5, 0.0),   # A < 0, ratio above 1 + eps: unclipped
        (0.5, -1.0, 0.8, 0.0, 1.0),   # A < 0, ratio below 1 - eps: clipped, no gradient
        (1.1, 1.0, -1.1, -1.1, 0.0),  # inside the trust region
    ],
)
def test_policy_loss_clip_branches(ratio, adv, loss, grad, clipfrac):
    got_loss, got_grad, metrics = one_token_loss(ratio, adv)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad)
    assert metrics["clipfrac"] == pytest.approx(clipfrac)
    assert metrics["dual_clipfrac"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(ratio - 1 - math.log(ratio))


def test_policy_loss_clip_higher():
    assert one_token_loss(1.25, 1.0)[0] == pytest.approx(-1.2)
    loss, grad, metrics = one_token_loss(1.25, 1.0, cliprange_high=0.28)
    assert (loss, grad, metrics["clipfrac"]) == pytest.approx((-1.25, -1.25, 0.0))
    loss, grad, _ = one_token_loss(1.5, 1.0, cliprange_high=0.28)
    assert (loss, grad) == pytest.approx((-1.28, 0.0))
    # the lower bound still uses cliprange
    assert one_token_loss(0.5, -1.0, cliprange_high=0.28)[0] == pytest.approx(0.8)


def test_policy_loss_dual_clip():
    loss, grad, metrics = one_token_loss(5.0, -1.0, dual_clip=3.0)
    assert (loss, grad, metrics["dual_clipfrac"]) == pytest.approx((3.0, 0.0, 1.0))
    loss, grad, metrics = one_token_loss(2.0, -1.0, dual_clip=3.0)  # below the cap
    assert (loss, grad, metrics["dual_clipfrac"]) == pytest.approx((2.0, 2.0, 0.0))
    loss, _, metrics = one_token_loss(5.0, 1.0, dual_clip=3.0)  # A > 0: untouched
    assert (loss, metrics["dual_clipfrac"]) == pytest.approx((-1.2, 0.0))
    with pytest.raises(ValueError, match="dual_clip"):
        one_token_loss(1.0, 1.0, dual_clip=1.0)


def test_policy_loss_aggregation_modes_and_mask():
    # ratio 1 everywhere, so the per-token loss is -A
    adv = T([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    zeros = torch.zeros(3, 3)
    expected = {"token-mean": -2.5, "seq-mean-token-sum": -5.0, "seq-mean-token-mean": -3.0}
    for mode, value in expected.items():
        loss, _ = policy_loss(zeros, zeros, adv, mask, cliprange=0.2, loss_agg=mode)
        assert loss.item() == pytest.approx(value), mode
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        policy_loss(zeros, zeros, adv, mask, cliprange=0.2, loss_agg="sum")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(zeros, mask, "mean")


def test_policy_loss_metrics_average_over_valid_tokens():
    logp = torch.log(T([[1.5, 1.0, 9.0]]))
    adv = T([[1.0, 1.0, -1.0]])
    _, metrics = policy_loss(logp, torch.zeros(1, 3), adv, T([[1, 1, 0]]), cliprange=0.2,
                             dual_clip=2.0)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["dual_clipfrac"].item() == 0.0
    assert not any(v.requires_grad for v in metrics.values())


# --- value loss -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "v,old,ret,loss,grad,clipfrac",
    [
        (1.5, 1.0, 2.0, 0.32, 0.0, 1.0),   # clipped value 1.2 is further from R: clipped term wins
        (1.1, 1.0, 2.0, 0.405, -0.9, 0.0),  # inside the clip range
        (0.5, 1.0, 2.0, 1.125, -1.5, 0.0),  # moved away from R: unclipped term is larger
        (0.5, 1.0, 0.0, 0.32, 0.0, 1.0),   # clipped from below
    ],
)
def test_value_loss_branches(v, old, ret, loss, grad, clipfrac):
    values = T([[v, 7.0]], dtype=torch.float64, requires_grad=True)
    mask = T([[1, 0]])
    got, frac = value_loss(values, T([[old, 0.0]], dtype=torch.float64),
                           T([[ret, -7.0]], dtype=torch.float64), mask, cliprange_value=0.2)
    got.backward()
    assert got.item() == pytest.approx(loss)
    assert values.grad[0, 0].item() == pytest.approx(grad)
    assert values.grad[0, 1].item() == 0.0
    assert frac.item() == pytest.approx(clipfrac)


def test_value_loss_unclipped():
    values = T([[1.5, 0.0], [3.0, 2.0]])
    loss, frac = value_loss(values, torch.zeros(2, 2), torch.zeros(2, 2), T([[1, 0], [1, 1]]), None)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 9.0 + 4.0) / 3)
    assert frac.item() == 0.0


# --- KL controllers -------------------------------------------------------------------------


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05


@pytest.mark.parametrize(
    "current,expected",
    [(12.0, 0.1 * 1.02), (3.0, 0.1 * 0.98), (6.6, 0.1 * 1.01), (6.0, 0.1)],
)
def test_adaptive_controller_moves_towards_target(current, expected):
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current, n_steps=1000)  # error clipped to +-0.2, scaled by 1000/10000
    assert ctl.value == pytest.approx(expected)


def test_controller_state_round_trip_and_factory():
    ctl = make_kl_controller("adaptive", 0.2, target=1.0, horizon=100)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(5.0, 10)
    fresh = make_kl_controller("adaptive", 0.2, target=1.0, horizon=100)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value == pytest.approx(0.2 * 1.02)
    assert isinstance(make_kl_controller("fixed", 0.3, None, None), FixedKLController)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        make_kl_controller("pid", 0.1, 1.0, 10)
    with pytest.raises(ValueError, match="target"):
        make_kl_controller("adaptive", 0.1, None, 10)
    with pytest.raises(ValueError, match="value"):
        fresh.load_state_dict({})
