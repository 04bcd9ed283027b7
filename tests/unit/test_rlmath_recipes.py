"""The recipe losses and estimators of rlcore.rlmath against their papers' formulas, on cases worked out by hand.

References: GSPO (Zheng et al., 2025, arXiv:2507.18071), CISPO (MiniMax-M1, arXiv:2506.13585), Dr. GRPO
(Liu et al., 2025, arXiv:2503.20783), REINFORCE++ (Hu, 2025, arXiv:2501.03262), ReMax (Li et al., 2023,
arXiv:2310.10505), DAPO (Yu et al., 2025, arXiv:2503.14476), KL estimators (Schulman, 2020).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcore import rlmath

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ------------------------------------------------------------------------------ groups of unequal size

def test_grpo_groups_keyed_by_prompt_id_of_unequal_size():
    # prompt "a": scores 1, 0, 1 (mean 2/3, unbiased std sqrt(1/3)); prompt "b": 0, 2 (mean 1, std sqrt 2);
    # prompt "c": one sample -> no baseline, advantage 0. Samples interleaved on purpose.
    scores = T([1.0, 0.0, 0.0, 1.0, 5.0, 2.0])
    keys = ["a", "b", "a", "a", "c", "b"]
    sa, sb = math.sqrt(1 / 3), math.sqrt(2.0)
    expected = [(1 - 2 / 3) / sa, (0 - 1) / sb, (0 - 2 / 3) / sa, (1 - 2 / 3) / sa, 0.0, (2 - 1) / sb]
    close(rlmath.grpo_advantages(scores, index=keys, eps=0.0), expected, atol=1e-6)
    close(rlmath.grpo_advantages(scores, index=keys, norm_by_std=False),
          [1 / 3, -1.0, -2 / 3, 1 / 3, 0.0, 1.0])
    # integer tensor keys give the same groups
    close(rlmath.grpo_advantages(scores, index=T([7, 3, 7, 7, 9, 3]), eps=0.0), expected, atol=1e-6)


def test_grpo_index_agrees_with_consecutive_groups():
    scores = torch.randn(12, generator=torch.Generator().manual_seed(0))
    close(rlmath.grpo_advantages(scores, 4), rlmath.grpo_advantages(scores, index=torch.arange(12) // 4))


def test_rloo_groups_of_unequal_size():
    scores = T([1.0, 0.0, 0.0, 1.0, 5.0, 2.0])
    keys = ["a", "b", "a", "a", "c", "b"]
    # a: 1 - (0+1)/2 = 0.5; 0 - (1+1)/2 = -1; b: 0 - 2 = -2, 2 - 0 = 2; c alone: 0
    close(rlmath.rloo_advantages(scores, index=keys), [0.5, -2.0, -1.0, 0.5, 0.0, 2.0])
    with pytest.raises(ValueError, match="group_size or index"):
        rlmath.rloo_advantages(scores)
    with pytest.raises(ValueError, match="6 keys for 5"):
        rlmath.grpo_advantages(scores[:5], index=keys)


# ------------------------------------------------------------------------------ REINFORCE++ / ReMax

def test_discounted_returns_skip_masked_positions():
    rewards = T([[0.0, 1.0, 9.0, 2.0]])
    mask = T([[1, 1, 0, 1]])
    # G_3 = 2, G_1 = 1 + 0.5 * 2 = 2, G_0 = 0 + 0.5 * 2 = 1; the masked position is skipped
    close(rlmath.discounted_returns(rewards, mask, 0.5), [[1.0, 2.0, 0.0, 2.0]])


def test_reinforce_pp_whitens_returns_over_the_batch():
    scores = T([1.0, 0.0])
    mask = T([[1, 1], [1, 0]])
    rewards = rlmath.token_level_rewards(scores, mask)  # [[0, 1], [0, 0]]
    # gamma 1: returns [[1, 1], [0, -]]; valid values 1, 1, 0: mean 2/3, unbiased var 1/3
    adv = rlmath.reinforce_pp_advantages(rewards, mask, 1.0)
    s = math.sqrt(1 / 3 + 1e-8)
    close(adv, [[(1 - 2 / 3) / s, (1 - 2 / 3) / s], [(0 - 2 / 3) / s, 0.0]], atol=1e-5)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens_globally():
    scores = T([1.0, 0.0, 3.0, 3.0])  # groups of 2: centred 0.5, -0.5, 0, 0
    mask = T([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv = rlmath.reinforce_pp_baseline_advantages(scores, mask, 2)
    tokens = [0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0]  # valid tokens: mean 0, unbiased var 1/6
    s = math.sqrt(sum(t * t for t in tokens) / 6 + 1e-8)
    close(adv, [[0.5 / s, 0.5 / s], [-0.5 / s, -0.5 / s], [0.0, 0.0], [0.0, 0.0]], atol=1e-5)


def test_remax_is_return_minus_greedy_baseline():
    scores = T([1.0, 0.25])
    mask = T([[1, 1, 0], [1, 1, 1]])
    rewards = rlmath.token_level_rewards(scores, mask)
    adv = rlmath.remax_advantages(rewards, mask, T([0.5, 0.25]))
    close(adv, [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="baseline"):
        rlmath.remax_advantages(rewards, mask, T([0.5]))


# ------------------------------------------------------------------------------ DAPO overlong shaping

def test_overlong_penalty_is_dapo_soft_punishment():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then (6 - |y|) / 4, -1 at the cap
    lengths = T([3, 6, 7, 8, 10, 12])
    close(rlmath.overlong_penalty(lengths, 10, 4, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(rlmath.overlong_penalty(lengths, 10, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="overlong buffer"):
        rlmath.overlong_penalty(lengths, 10, 0)


# ------------------------------------------------------------------------------ aggregation

def test_token_sum_and_dr_grpo_seq_mean_token_sum_norm():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    close(rlmath.aggregate_loss(loss, mask, "token-sum"), 10.0)
    # Dr. GRPO: 1/G sum_i 1/L sum_t l_it with the constant L (here 8, the length cap)
    close(rlmath.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=8), (6 / 8 + 4 / 8) / 2)
    close(rlmath.aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), (6 / 3 + 4 / 3) / 2)  # L = T
    # cutting padding columns changes nothing when the horizon is given
    close(rlmath.aggregate_loss(loss[:, :2] * 0 + T([[1.0, 2.0], [4.0, 0.0]]), T([[1, 1], [1, 0]]),
                                "seq-mean-token-sum-norm", horizon=8), (3 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="horizon"):
        rlmath.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=0)


# ------------------------------------------------------------------------------ KL

def test_kl_is_k1_and_straight_through_variants():
    lp = T([0.5, -1.0], requires_grad=True)
    ref = T([0.0, 0.0])
    close(rlmath.kl_penalty(lp, ref, "kl"), [0.5, -1.0])
    for name, value in (("k1+", [0.5, -1.0]), ("k3+", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1])):
        lp.grad = None
        out = rlmath.kl_penalty(lp, ref, name)
        close(out, value, atol=1e-6)  # the value of k1 / k3 ...
        out.sum().backward()
        close(lp.grad, [0.5, -1.0])  # ... the gradient of k2 = 0.5 d^2: d


# ------------------------------------------------------------------------------ GSPO

def test_gspo_sequence_ratio_clipped_per_sequence():
    # sequence 0: token log-ratios 0.1, 0.3 -> s = exp(0.2) (above 1.1); sequence 1: log-ratio -0.05 (1 token;
    # padding ignored) -> s = exp(-0.05), inside the clip range [1 - 0.1, 1 + 0.1].
    old = torch.zeros(2, 2)
    lp = T([[0.1, 0.3], [-0.05, 5.0]], requires_grad=True)
    mask = T([[1, 1], [1, 0]])
    adv = T([[1.0, 1.0], [-2.0, -2.0]])
    loss, m = rlmath.policy_loss(lp, old, adv, mask, 0.1, kind="gspo", loss_agg="seq-mean-token-mean")
    s0, s1 = math.exp(0.2), math.exp(-0.05)
    # paper: -1/G sum_i min(s_i A_i, clip(s_i) A_i)
    l0 = -min(s0 * 1.0, min(max(s0, 0.9), 1.1) * 1.0)  # clipped at 1.1: no gradient
    l1 = -min(s1 * -2.0, min(max(s1, 0.9), 1.1) * -2.0)  # unclipped: -A * s1
    close(loss, (l0 + l1) / 2, atol=1e-6)
    close(m["clipfrac"], 2 / 3, atol=1e-6)  # both tokens of sequence 0
    loss.backward()
    # token gradient of an unclipped sequence: -A_i * s_i * (1/|y_i|) grad logp_t; clipped sequence: 0
    close(lp.grad, [[0.0, 0.0], [2.0 * s1 / 2, 0.0]], atol=1e-6)  # 1/G = 1/2, |y_1| = 1


def test_gspo_gradient_is_length_normalised_sequence_ratio():
    # unclipped: grad of -1/G sum_i s_i A_i = -1/G sum_i A_i s_i 1/|y_i| sum_t grad logp_it
    old = T([[0.0, -0.2, 0.1]])
    lp = T([[0.05, -0.1, 0.0]], requires_grad=True)
    mask = T([[1, 1, 1]])
    adv = torch.full((1, 3), 0.7)
    loss, _ = rlmath.policy_loss(lp, old, adv, mask, 1.0, kind="gspo", loss_agg="seq-mean-token-mean")
    s = math.exp((0.05 + 0.1 - 0.1) / 3)
    close(loss, -0.7 * s, atol=1e-6)
    loss.backward()
    close(lp.grad, [[-0.7 * s / 3] * 3], atol=1e-6)


# ------------------------------------------------------------------------------ CISPO

def test_cispo_clips_detached_weight_and_keeps_gradients_of_clipped_tokens():
    # ratios e^0.5 (above 1 + 0.2: weight 1.2), 1, e^-0.5 (below 0.8: weight 0.8)
    lp = T([[0.5, 0.0, -0.5]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = T([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, m = rlmath.policy_loss(lp, old, adv, mask, 0.2, kind="cispo", loss_agg="token-mean")
    # J = 1/|o| sum_t sg(clip(r_t)) A_t log pi_t
    close(loss, -(1.2 * 1.0 * 0.5 + 1.0 * 1.0 * 0.0 + 0.8 * -1.0 * -0.5) / 3, atol=1e-6)
    loss.backward()
    close(lp.grad, [[-1.2 / 3, -1.0 / 3, 0.8 / 3]], atol=1e-6)  # no token loses its gradient
    close(m["clipfrac"], 2 / 3, atol=1e-6)
    # PPO's clip, by contrast, zeroes the gradient of the first token (A > 0, r > 1 + eps)
    lp.grad = None
    rlmath.policy_loss(lp, old, adv, mask, 0.2)[0].backward()
    assert float(lp.grad[0, 0]) == 0.0


def test_policy_loss_kind_checks():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="vanilla, gspo, cispo"):
        rlmath.policy_loss(x, x, x, x + 1, 0.2, kind="bogus")
    with pytest.raises(ValueError, match="dual_clip applies to the vanilla"):
        rlmath.policy_loss(x, x, x, x + 1, 0.2, dual_clip=3.0, kind="gspo")
