"""Pure tensor math for RL post-training: masking, log-probs, advantages, KL and losses.

Every function here is stateless and side-effect free (the small KL controller classes at the
end hold one float each). Nothing touches a model, an optimizer or ``torch.distributed``.

Shape notation used in the docstrings:

- ``B``: number of sequences in the batch (one prompt + response each)
- ``T``: response length (padded)
- ``V``: vocabulary size
- ``N``: number of scored samples, laid out as consecutive groups of ``group_size`` samples
  that share a prompt

Masks are ``bool`` or ``0/1`` tensors with the same shape as the values they select; a nonzero
entry marks a valid (response) token. Values at masked positions never reach a result.
"""

from __future__ import annotations

import torch

from rlcore.config.schema import KLControllerKind, KLEstimator, LossAgg, PolicyLoss

__all__ = [
    "masked_fill_zero",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "entropy_from_logits",
    "compute_gae",
    "group_index",
    "grpo_advantages",
    "rloo_advantages",
    "discounted_returns",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "overlong_penalty",
    "KL_ESTIMATORS",
    "kl_penalty",
    "token_level_rewards",
    "broadcast_sequence_advantages",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "POLICY_LOSSES",
    "policy_loss",
    "value_loss",
    "ROLLOUT_IS_MODES",
    "rollout_is_weights",
    "logprob_mismatch",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]

# Upper bound on the float32 elements materialised at once by the chunked logit reductions
# (2**26 floats = 256 MiB).
_LOGIT_CHUNK_ELEMENTS = 1 << 26

# The log-ratio fed to ``exp`` is clamped to this range so ratios stay finite.
_MAX_LOG_RATIO = 20.0


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_fill_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with every position outside ``mask`` set to 0 (shapes ``S`` -> ``S``)."""
    return torch.where(_as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is set.

    Masked entries are replaced by zero before summing, so a NaN or inf there cannot leak into
    the result.

    :param x: values, any shape ``S``.
    :param mask: ``S``, bool or 0/1.
    :param dim: dimension to reduce; ``None`` reduces everything to a scalar.
    :returns: ``S`` without ``dim`` (a scalar when ``dim`` is ``None``).
    """
    kept = masked_fill_zero(x, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set.

    An all-masked slice gives 0 (the sum is 0 and ``eps`` keeps the division finite).

    :param x: values, any shape ``S``.
    :param mask: ``S``, bool or 0/1.
    :param dim: dimension to reduce; ``None`` reduces everything to a scalar.
    :param eps: added to the count of valid positions.
    :returns: ``S`` without ``dim`` (a scalar when ``dim`` is ``None``).
    """
    count = masked_sum(torch.ones_like(x, dtype=torch.float32), mask, dim)
    return masked_sum(x, mask, dim) / (count + eps)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all positions where ``mask`` is set.

    :param x: values, any shape ``S``.
    :param mask: ``S``, bool or 0/1.
    :param unbiased: apply Bessel's correction ``n / (n - 1)``.
    :returns: scalar.
    :raises ValueError: fewer than 2 valid positions (``unbiased``) or none at all.
    """
    n = int(_as_bool(mask).sum().item())
    needed = 2 if unbiased else 1
    if n < needed:
        raise ValueError(
            f"masked_var needs at least {needed} valid position(s) (unbiased={unbiased}), got {n}"
        )
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to unit variance using statistics of the valid positions only.

    :param x: values, any shape ``S``.
    :param mask: ``S``, bool or 0/1.
    :param shift_mean: when True the result has zero mean; when False the original mean is
        added back (only the scale changes).
    :param eps: added to the variance before the square root.
    :returns: ``S``; zero at masked positions.
    :raises ValueError: fewer than 2 valid positions.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return masked_fill_zero(out, mask)


# ---------------------------------------------------------------------------------------------
# Logits -> token log-probs / entropy
# ---------------------------------------------------------------------------------------------


def _map_logit_chunks(logits: torch.Tensor, temperature: float, fn) -> torch.Tensor:
    """Apply ``fn(z, rows)`` to float32 ``z = logits[rows] / temperature``, chunk by chunk.

    Chunks split dim 0 so each holds at most ``_LOGIT_CHUNK_ELEMENTS`` elements; slicing dim 0
    never copies, even for a non-contiguous view such as ``logits[:, :-1]``. ``logits`` is
    ``[R, ..., V]``; ``fn`` returns ``[r, ...]`` and the chunks are concatenated to ``[R, ...]``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n_rows = logits.shape[0]
    if n_rows == 0:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    step = max(1, _LOGIT_CHUNK_ELEMENTS // max(1, logits[0].numel()))
    parts = []
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        z = logits[rows].float()
        parts.append(fn(z if temperature == 1.0 else z / temperature, rows))
    return torch.cat(parts, dim=0)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    Computed as ``z[label] - logsumexp(z)`` in float32, a bounded chunk of rows at a time, so
    a full ``[B, T, V]`` float32 log-softmax is never materialised.

    :param logits: ``[B, T, V]`` (any float dtype; any leading shape ``[..., V]`` works).
    :param labels: ``[B, T]`` token ids in ``[0, V)``, integer dtype.
    :param temperature: sampling temperature, > 0.
    :returns: ``[B, T]`` float32.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: "
            "expected logits [..., V] with labels [...]"
        )
    if logits.dim() == 1:
        return logprobs_from_logits(logits[None], labels[None], temperature)[0]

    def chunk(z: torch.Tensor, rows: slice) -> torch.Tensor:
        picked = z.gather(-1, labels[rows].long().unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(z, dim=-1)

    return _map_logit_chunks(logits, temperature, chunk)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)`` in float32, chunked over rows.

    :param logits: ``[B, T, V]`` (any leading shape ``[..., V]`` works).
    :param temperature: sampling temperature, > 0.
    :returns: ``[B, T]`` float32.
    """
    if logits.dim() == 1:
        return entropy_from_logits(logits[None], temperature)[0]

    def chunk(z: torch.Tensor, rows: slice) -> torch.Tensor:
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)

    return _map_logit_chunks(logits, temperature, chunk)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., 2015) over valid tokens only.

    The recursion runs backwards over the valid positions of each row:
    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``,
    where ``V_next`` / ``A_next`` belong to the next *valid* position of the same row, and are
    0 after the last one (no bootstrap past the end of a response). Masked positions are
    skipped: their rewards and values are ignored and they do not count as a time step.

    Advantages are returned raw (not whitened); whiten with :func:`masked_whiten` if wanted.
    Inputs are used as given: pass detached tensors when the result is a training target.

    :param rewards: ``[B, T]`` per-token rewards.
    :param values: ``[B, T]`` value estimates ``V(s_t)``.
    :param mask: ``[B, T]`` valid response tokens.
    :param gamma: discount factor.
    :param lam: GAE lambda.
    :returns: ``(advantages, returns)``, each ``[B, T]``, ``returns = advantages + values``;
        both are zero where ``mask`` is not set.
    """
    if rewards.dim() != 2 or not rewards.shape == values.shape == mask.shape:
        raise ValueError(
            f"compute_gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and "
            f"mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    valid = _as_bool(mask)
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if rewards.shape[1] == 0:
        empty = torch.zeros(rewards.shape, dtype=dtype, device=rewards.device)
        return empty, empty.clone()
    rewards, values = rewards.to(dtype), values.to(dtype)
    next_value = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    advantages = [zero] * rewards.shape[1]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[t] = torch.where(valid[:, t], adv_t, zero)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    adv = torch.stack(advantages, dim=1)
    returns = torch.where(valid, adv + values, zero)
    return adv, returns


def group_index(n: int | None = None, group_size: int | None = None, index=None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Dense group ids ``[N]`` (``0..G-1``) of ``N`` samples.

    Either ``index`` (one key per sample: ints, strings or any hashable, e.g. a prompt id; samples
    with equal keys form one group, in any order and of any size) or ``group_size`` (consecutive
    groups of that size) must be given.

    :raises ValueError: neither given, a length mismatch, or ``N`` not a multiple of ``group_size``.
    """
    if index is not None:
        if isinstance(index, torch.Tensor):
            if index.dim() != 1 or (n is not None and index.shape[0] != n):
                raise ValueError(f"group index must be 1-D [{n}], got shape {tuple(index.shape)}")
            return torch.unique(index, return_inverse=True)[1].to(device or index.device)
        keys = list(index)
        if n is not None and len(keys) != n:
            raise ValueError(f"group index has {len(keys)} keys for {n} samples")
        ids: dict = {}
        return torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long, device=device)
    if group_size is None or n is None:
        raise ValueError("pass either group_size or index (one group key per sample)")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n % group_size:
        raise ValueError(f"{n} scores do not split into groups of {group_size}")
    return torch.arange(n, device=device) // group_size


def _group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(group count, group sum, unbiased group std)`` of ``scores [N]`` (std 0 for size 1)."""
    groups = int(gid.max()) + 1 if gid.numel() else 0  # no samples: empty results
    x = scores.to(torch.promote_types(scores.dtype, torch.float32))
    count = torch.zeros(groups, dtype=x.dtype, device=x.device).index_add_(0, gid, torch.ones_like(x))
    total = torch.zeros(groups, dtype=x.dtype, device=x.device).index_add_(0, gid, x)
    mean = total / count
    sq = torch.zeros(groups, dtype=x.dtype, device=x.device).index_add_(0, gid, (x - mean[gid]).square())
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return count[gid], total[gid], std[gid]


def _scored_groups(scores: torch.Tensor, group_size: int | None, index, fn: str):
    """:func:`_group_stats` of ``scores`` grouped by ``group_size`` or ``index``; errors name ``fn``."""
    if scores.dim() != 1:
        raise ValueError(f"{fn}: scores must be 1-D [N], got shape {tuple(scores.shape)}")
    try:
        gid = group_index(scores.shape[0], group_size, index, scores.device)
    except ValueError as e:
        raise ValueError(f"{fn}: {e}") from None
    return _group_stats(scores, gid)


def grpo_advantages(
    scores: torch.Tensor,
    group_size: int | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    *,
    index=None,
) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al., 2024): a score minus its group's mean, over its std.

    Groups are consecutive blocks of ``group_size`` samples, or (``index``) the samples sharing a
    key such as a prompt id, which may differ in size (e.g. after filtering). The std is the
    unbiased sample std of the group. A group of one sample has no baseline: advantage 0.

    :param scores: ``[N]`` sequence scores.
    :param group_size: samples per prompt (when ``index`` is not given).
    :param norm_by_std: divide by ``std + eps``; False is Dr. GRPO's mean centring (Liu et al., 2025).
    :param eps: added to the std.
    :param index: ``[N]`` group keys (tensor or sequence of hashables), instead of ``group_size``.
    :returns: ``[N]``.
    """
    count, total, std = _scored_groups(scores, group_size, index, "grpo_advantages")
    centred = scores - total / count
    if norm_by_std:
        centred = centred / (std + eps)
    return torch.where(count > 1, centred, torch.zeros_like(centred)).to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group_size: int | None = None, *, index=None) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al., 2024): ``s_i - mean(s_j, j != i)`` in the group.

    Groups as in :func:`grpo_advantages` (``group_size`` or ``index``). With ``index``, a group
    of one sample has no other sample to form a baseline and gets advantage 0.

    :param scores: ``[N]`` sequence scores.
    :param group_size: samples per prompt, >= 2 (when ``index`` is not given).
    :param index: ``[N]`` group keys instead of ``group_size``.
    :returns: ``[N]``.
    :raises ValueError: ``group_size < 2`` (no other samples to form the baseline).
    """
    if index is None and group_size is not None and group_size < 2:
        raise ValueError(f"rloo_advantages: group_size must be >= 2, got {group_size}")
    count, total, _ = _scored_groups(scores, group_size, index, "rloo_advantages")
    others = (total - scores) / (count - 1).clamp_min(1)
    return torch.where(count > 1, scores - others, torch.zeros_like(scores)).to(scores.dtype)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go over valid tokens: ``G_t = r_t + gamma * G_next`` (0 after the last valid token).

    :param rewards: ``[B, T]`` per-token rewards (e.g. :func:`token_level_rewards`).
    :param mask: ``[B, T]``; masked positions neither add a reward nor count as a time step.
    :param gamma: discount.
    :returns: ``[B, T]``, zero where ``mask`` is not set.
    """
    valid = _as_bool(mask)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return out


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025): discounted token returns, whitened over the whole batch.

    ``A_t = whiten(G_t)`` with ``G_t`` from :func:`discounted_returns` (the per-token KL penalty,
    if any, is part of ``rewards``); mean and std are taken over every valid token of the batch,
    the global normalisation that replaces a critic.

    :param rewards: ``[B, T]`` token rewards. :param mask: ``[B, T]``. :param gamma: discount.
    :returns: ``[B, T]``.
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int | None = None,
                                     *, index=None) -> torch.Tensor:
    """REINFORCE++-baseline (Hu, 2025): a score minus its group's mean, given to every token, then
    whitened over the batch's valid tokens (the group mean removes the prompt's difficulty, the global
    whitening sets the scale, with no per-group std).

    :param scores: ``[N]`` sequence scores. :param mask: ``[N, T]``.
    :param group_size: samples per prompt, or ``index``: group keys (see :func:`grpo_advantages`).
    :returns: ``[N, T]``.
    """
    centred = grpo_advantages(scores, group_size, norm_by_std=False, index=index)
    return masked_whiten(broadcast_sequence_advantages(centred, mask), mask)


def remax_advantages(rewards: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al., 2023): reward-to-go minus the score of the prompt's greedy response.

    ``A_t = sum_{s >= t} r_s - b`` where ``b`` is the reward of a greedy (argmax) rollout of the same
    prompt: a baseline that needs one extra generation per prompt and no critic.

    :param rewards: ``[B, T]`` token rewards. :param mask: ``[B, T]``.
    :param baseline: ``[B]`` greedy-response scores.
    :returns: ``[B, T]``, zero where ``mask`` is not set.
    """
    if baseline.shape != rewards.shape[:1]:
        raise ValueError(f"remax_advantages: baseline {tuple(baseline.shape)} must be [B] for rewards "
                         f"{tuple(rewards.shape)}")
    returns = discounted_returns(rewards, mask, 1.0)
    return masked_fill_zero(returns - baseline.to(returns.dtype).unsqueeze(1), mask)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025): 0 up to ``max_length - buffer`` tokens, then
    falling linearly to ``-factor`` at ``max_length`` (and ``-factor`` beyond).

    ``R(|y|) = -factor * clip((|y| - (L_max - L_buffer)) / L_buffer, 0, 1)``.

    :param lengths: ``[B]`` response lengths in tokens.
    :param max_length: ``L_max``, the length cap. :param buffer: ``L_buffer`` in ``(0, L_max]``.
    :param factor: the penalty at the cap.
    :returns: ``[B]`` float32, added to the scores.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    over = (lengths.float() - (max_length - buffer)) / buffer
    return -float(factor) * over.clamp(0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# KL and rewards
# ---------------------------------------------------------------------------------------------

#: Names accepted by :func:`kl_penalty`, aliases included (``ppo.kl_estimator``'s enum).
KL_ESTIMATORS = KLEstimator.values()


def _kl_value(diff: torch.Tensor, estimator: str) -> torch.Tensor:
    match estimator:
        case "k1" | "kl":
            return diff
        case "abs":
            return diff.abs()
        case "k2" | "mse":
            return 0.5 * diff.square()
        case "k3" | "low_var_kl":
            log_ratio = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(
        f"unknown KL estimator {estimator!r}; valid names: {', '.join(KL_ESTIMATORS)}"
    )


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from sampled-token log-probs.

    With ``d = logprob - ref_logprob`` (Schulman, 2020, "Approximating KL divergence"):

    - ``"k1"`` / ``"kl"``: ``d``
    - ``"abs"``: ``|d|``
    - ``"k2"`` / ``"mse"``: ``0.5 * d**2``
    - ``"k3"`` / ``"low_var_kl"``: ``exp(-d) + d - 1`` (non-negative, low variance); ``-d`` is
      clamped to ``[-20, 20]`` before ``exp`` and the result to ``[-10, 10]``.
    - ``"k1+"`` / ``"k3+"``: straight-through: the value of ``k1`` / ``k3`` with the gradient of
      ``k2`` (``d * grad d``, whose expectation under the policy is the gradient of the true KL; the
      gradients of ``k1`` and ``k3`` used as a loss are biased). Same as the plain estimator in a reward.

    :param logprob: ``[B, T]`` policy log-probs of the sampled tokens.
    :param ref_logprob: ``[B, T]`` reference-model log-probs of the same tokens.
    :param estimator: one of :data:`KL_ESTIMATORS`.
    :returns: ``[B, T]``.
    :raises ValueError: unknown estimator.
    """
    diff = logprob - ref_logprob
    if estimator in ("k1+", "k3+"):
        grad_part = 0.5 * diff.square()
        return grad_part - grad_part.detach() + _kl_value(diff, estimator[:-1]).detach()
    return _kl_value(diff, estimator)


def _last_valid_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` mask -> (``[B]`` index of the last valid position, ``[B]`` row has any)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    last = torch.where(_as_bool(mask), positions, -1).max(dim=-1).values
    return last.clamp_min(0), last >= 0


def token_level_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coeff: float = 0.0,
) -> torch.Tensor:
    """Spread sequence scores over tokens: score at the last valid token, KL penalty everywhere.

    ``reward[b, t] = -kl_coeff * kl[b, t] * mask[b, t] + scores[b] * [t == last_valid(b)]``.
    A row without any valid token gets all-zero rewards (its score has nowhere to go).

    :param scores: ``[B]`` sequence-level scores.
    :param response_mask: ``[B, T]`` valid response tokens.
    :param kl: ``[B, T]`` per-token KL estimate (see :func:`kl_penalty`), or None.
    :param kl_coeff: weight of the KL penalty.
    :returns: ``[B, T]``.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"token_level_rewards: expected scores [B] and response_mask [B, T], got "
            f"{tuple(scores.shape)} and {tuple(response_mask.shape)}"
        )
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    if kl is not None:
        dtype = torch.promote_types(dtype, kl.dtype)
        rewards = masked_fill_zero(-kl_coeff * kl.to(dtype), response_mask)
    else:
        rewards = torch.zeros(response_mask.shape, dtype=dtype, device=scores.device)
    last, has_any = _last_valid_index(response_mask)
    placed = masked_fill_zero(scores.to(dtype), has_any)
    return rewards.scatter_add(1, last.unsqueeze(1), placed.unsqueeze(1))


def broadcast_sequence_advantages(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Give every valid token of a sequence that sequence's advantage.

    :param adv: ``[B]`` sequence-level advantages (e.g. from :func:`grpo_advantages`).
    :param response_mask: ``[B, T]``.
    :returns: ``[B, T]``; zero where the mask is not set.
    """
    if adv.dim() != 1 or response_mask.dim() != 2 or adv.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"broadcast_sequence_advantages: expected adv [B] and response_mask [B, T], got "
            f"{tuple(adv.shape)} and {tuple(response_mask.shape)}"
        )
    return masked_fill_zero(adv.unsqueeze(1).expand(response_mask.shape), response_mask)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------

#: Ways :func:`aggregate_loss` turns a ``[B, T]`` loss into a scalar (``ppo.loss_agg``'s enum).
LOSS_AGG_MODES = LossAgg.values()


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, loss_agg: str,
                   horizon: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - ``"token-mean"``: mean over all valid tokens of the batch (DAPO's token-level loss).
    - ``"seq-mean-token-sum"``: sum over each sequence's valid tokens, mean over sequences.
    - ``"seq-mean-token-mean"``: mean over each sequence's valid tokens, mean over sequences
      (GRPO's original form; GSPO's sequence-level objective).
    - ``"seq-mean-token-sum-norm"``: each sequence's token sum divided by the constant ``horizon``
      (the generation length cap), mean over sequences: Dr. GRPO's length-unbiased form
      ``1/G sum_i 1/L sum_t l_{i,t}`` (Liu et al., 2025).
    - ``"token-sum"``: sum over all valid tokens (no normalisation).

    Sequence means count only rows with at least one valid token.

    :param loss: ``[B, T]``.
    :param mask: ``[B, T]``.
    :param loss_agg: one of :data:`LOSS_AGG_MODES`.
    :param horizon: the constant ``L`` of ``seq-mean-token-sum-norm``; None uses ``T`` (pass the
        length cap when responses are cut to their used columns).
    :returns: scalar.
    :raises ValueError: unknown mode or a horizon < 1.
    """
    match loss_agg:
        case "token-mean":
            return masked_mean(loss, mask)
        case "token-sum":
            return masked_sum(loss, mask)
        case "seq-mean-token-sum" | "seq-mean-token-mean" | "seq-mean-token-sum-norm":
            reduce = masked_mean if loss_agg == "seq-mean-token-mean" else masked_sum
            per_seq = reduce(loss, mask, dim=-1)
            if loss_agg == "seq-mean-token-sum-norm":
                length = loss.shape[-1] if horizon is None else int(horizon)
                if length < 1:
                    raise ValueError(f"seq-mean-token-sum-norm needs a horizon >= 1, got {length}")
                per_seq = per_seq / length
            return masked_mean(per_seq, _as_bool(mask).any(dim=-1))
    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid names: {', '.join(LOSS_AGG_MODES)}")


#: Policy-gradient losses of :func:`policy_loss` (``ppo.policy_loss``).
POLICY_LOSSES = PolicyLoss.values()


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's token log-ratios: ``log s_i + logp_t - sg(logp_t)``, ``s_i`` the length-normalised
    sequence ratio (detached), so the value is ``log s_i`` at every token and the gradient of token
    ``t`` is ``grad logp_t``."""
    seq = masked_mean(log_ratio, mask, dim=-1).detach().unsqueeze(-1)
    return (log_ratio - log_ratio.detach() + seq).clamp(max=10.0)


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    token_weights: torch.Tensor | None = None,
    kind: str = "vanilla",
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss: PPO's clipped surrogate (with clip-higher and dual-clip), GSPO or CISPO.

    With token ratios ``r = exp(logprob - old_logprob)`` (log-ratio clamped to ``[-20, 20]``),
    ``lo = 1 - cliprange`` and ``hi = 1 + cliprange_high``:

    - ``"vanilla"`` (Schulman et al., 2017): ``l = max(-A * r, -A * clip(r, lo, hi))``. With
      ``dual_clip = c`` the loss of tokens with ``A < 0`` is further capped at ``-c * A`` (Ye et
      al., 2020), which bounds the update when the ratio is far above 1 on a bad action.
    - ``"gspo"`` (Zheng et al., 2025): the same clipped surrogate on the sequence ratio
      ``s_i = exp(mean_t log r_{i,t})`` (geometric mean of the token ratios), one value per sequence;
      a token's gradient is ``s_i * grad logprob_t`` (GSPO-token with a sequence-level advantage).
      With ``loss_agg="seq-mean-token-mean"`` this is the paper's objective.
    - ``"cispo"`` (MiniMax, 2025): ``l = -sg(clip(r, lo, hi)) * A * logprob``: the importance weight
      is clipped and detached instead of the update, so clipped tokens still give gradients.

    :param logprob: ``[B, T]`` current policy log-probs (carries the gradient).
    :param old_logprob: ``[B, T]`` log-probs of the policy that sampled the data.
    :param advantages: ``[B, T]``.
    :param mask: ``[B, T]`` valid response tokens.
    :param cliprange: lower (and default upper) clip distance, e.g. 0.2.
    :param cliprange_high: upper clip distance; None uses ``cliprange``.
    :param dual_clip: the constant ``c > 1``, or None to disable (``vanilla`` only).
    :param loss_agg: one of :data:`LOSS_AGG_MODES`.
    :param token_weights: ``[B, T]`` factors multiplying each token's loss before aggregation
        (e.g. :func:`rollout_is_weights`; no gradient flows into them), or None.
    :param kind: one of :data:`POLICY_LOSSES`.
    :param horizon: the constant length of ``seq-mean-token-sum-norm`` (see :func:`aggregate_loss`).
    :returns: ``(loss, metrics)``: scalar loss; metrics are detached float scalars
        ``clipfrac`` (share of valid tokens where clipping changed the term),
        ``approx_kl`` (k3 estimate of ``KL(old || new)``) and ``dual_clipfrac``.
    :raises ValueError: negative clip ranges, ``dual_clip <= 1`` (or set for another kind), an
        unknown ``loss_agg`` or ``kind``.
    """
    high = cliprange if cliprange_high is None else cliprange_high
    if cliprange < 0 or high < 0:
        raise ValueError(f"clip ranges must be >= 0, got cliprange={cliprange}, high={high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid names: {', '.join(LOSS_AGG_MODES)}")
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; valid names: {', '.join(POLICY_LOSSES)}")
    if dual_clip is not None and kind != "vanilla":
        raise ValueError(f"dual_clip applies to the vanilla policy loss only, not {kind!r}")

    token_log_ratio = (logprob - old_logprob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    log_ratio = _sequence_log_ratio(token_log_ratio, mask) if kind == "gspo" else token_log_ratio
    ratio = log_ratio.exp()
    dual_taken = torch.zeros_like(ratio, dtype=torch.bool)
    if kind == "cispo":
        weight = ratio.detach().clamp(1.0 - cliprange, 1.0 + high)
        loss = -advantages * weight * logprob
        clip_taken = weight != ratio.detach()
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + high)
        loss = torch.maximum(unclipped, clipped)
        clip_taken = clipped > unclipped
        if dual_clip is not None:
            cap = -advantages * dual_clip
            dual_taken = (advantages < 0) & (loss > cap)
            loss = torch.where(dual_taken, cap, loss)
    if token_weights is not None:
        loss = loss * token_weights.detach()

    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clip_taken.float(), mask),
            "approx_kl": masked_mean(token_log_ratio.exp() - 1.0 - token_log_ratio, mask).float(),
            "dual_clipfrac": masked_mean(dual_taken.float(), mask),
        }
    return aggregate_loss(loss, mask, loss_agg, horizon), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value-function loss ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``.

    :param values: ``[B, T]`` current value predictions (carries the gradient).
    :param old_values: ``[B, T]`` predictions of the critic that produced the rollout.
    :param returns: ``[B, T]`` targets (e.g. from :func:`compute_gae`).
    :param mask: ``[B, T]``.
    :param cliprange_value: the clip distance ``c``; None disables clipping.
    :returns: ``(loss, clipfrac)``: scalar masked token mean, and the detached share of valid
        tokens where the clipped term is the larger one (0 when unclipped).
    """
    err = (values - returns).square()
    if cliprange_value is None:
        no_clip = torch.zeros((), dtype=torch.float32, device=values.device)
        return 0.5 * masked_mean(err, mask), no_clip
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 or None, got {cliprange_value}")
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    err_clipped = (clipped_values - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((err_clipped > err).float(), mask)
    return loss, clipfrac


# ---------------------------------------------------------------------------------------------
# Rollout / trainer mismatch
# ---------------------------------------------------------------------------------------------

#: Kinds of :func:`rollout_is_weights`.
ROLLOUT_IS_MODES = ("none", "token", "sequence")


def rollout_is_weights(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights correcting for tokens sampled by a policy other than ``old``.

    The sampler (a rollout engine in lower precision, or an older policy) gave the log-probs
    ``rollout_logprob``; the trainer's recomputation of the same tokens is ``old_logprob``. With
    ``rho_t = exp(old_t - rollout_t)``:

    - ``"token"``: ``w_t = min(rho_t, cap)`` per token (truncated IS, as in TIS);
    - ``"sequence"``: ``w_t = min(prod_s rho_s, cap)`` for every token of the sequence, the
      product taken over its valid tokens (computed as a sum of log-ratios);
    - ``"none"``: all ones.

    The weights are detached: they scale the policy-gradient loss of each token and carry no
    gradient themselves. Masked positions get weight 0.

    :param old_logprob: ``[B, T]`` trainer log-probs of the sampled tokens.
    :param rollout_logprob: ``[B, T]`` sampler log-probs of the same tokens.
    :param mask: ``[B, T]`` valid response tokens.
    :param mode: one of :data:`ROLLOUT_IS_MODES`.
    :param cap: the truncation ``C > 0``.
    :returns: ``(weights [B, T], metrics)``; metrics (detached scalars): ``mean`` (mean weight
        over valid tokens) and ``capped_frac`` (share of valid tokens whose weight was cut).
    :raises ValueError: unknown mode or ``cap <= 0``.
    """
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"unknown rollout_is mode {mode!r}; valid names: {', '.join(ROLLOUT_IS_MODES)}")
    if not cap > 0:
        raise ValueError(f"rollout_is cap must be > 0, got {cap}")
    with torch.no_grad():
        valid = _as_bool(mask)
        if mode == "none":
            weights = valid.to(torch.float32)
            capped = torch.zeros_like(weights, dtype=torch.bool)
        else:
            log_rho = masked_fill_zero((old_logprob - rollout_logprob).float(), valid)
            if mode == "sequence":
                log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
            log_cap = torch.log(torch.tensor(float(cap), dtype=torch.float32, device=log_rho.device))
            capped = log_rho > log_cap
            weights = masked_fill_zero(torch.minimum(log_rho, log_cap).exp(), valid)
        metrics = {"mean": masked_mean(weights, valid), "capped_frac": masked_mean(capped.float(), valid)}
    return weights, metrics


def logprob_mismatch(
    rollout_logprob: torch.Tensor, trainer_logprob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's recomputation of the same tokens.

    :param rollout_logprob: ``[B, T]`` log-probs the rollout reported for its sampled tokens.
    :param trainer_logprob: ``[B, T]`` the trainer's teacher-forced log-probs of those tokens.
    :param mask: ``[B, T]`` valid response tokens.
    :returns: detached scalars: ``abs_diff_mean`` and ``abs_diff_max`` (of ``|rollout - trainer|``
        over valid tokens; 0 without any) and ``kl``, the k3 estimate of
        ``KL(rollout || trainer)`` per token (``r - 1 - log r`` with ``r = p_trainer / p_rollout``,
        unbiased as the tokens were sampled by the rollout; non-negative).
    """
    with torch.no_grad():
        valid = _as_bool(mask)
        diff = masked_fill_zero((trainer_logprob - rollout_logprob).float(), valid)
        # in float64: for gaps of 1e-4 or less, r - 1 - log r cancels to 0 in float32
        kl = kl_penalty(rollout_logprob.double(), trainer_logprob.double(), "k3")
        return {
            "abs_diff_mean": masked_mean(diff.abs(), valid),
            "abs_diff_max": diff.abs().max() if diff.numel() else diff.new_zeros(()),
            "kl": masked_mean(kl, valid).float(),
        }


# ---------------------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------------------


class KLController:
    """Holds the KL coefficient ``value``; subclasses decide how ``update`` moves it."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Observe the KL measured over ``n_steps`` samples; the base class keeps ``value``."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if "value" not in state:
            raise ValueError(f"{type(self).__name__} state is missing key 'value'")
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A KL coefficient that never changes.

    :param kl_coef: the coefficient, exposed as ``value``.
    """


class AdaptiveKLController(KLController):
    """Proportional controller steering the observed KL towards ``target`` (Ziegler et al., 2019).

    On each ``update``: ``e = clip(current_kl / target - 1, -0.2, 0.2)`` and
    ``value *= 1 + e * n_steps / horizon``.

    :param init_kl_coef: starting coefficient.
    :param target: KL the controller aims for, > 0.
    :param horizon: number of samples over which the coefficient adapts, > 0.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not target > 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    kind: str,
    kl_coef: float,
    target: float | None = None,
    horizon: float | None = None,
) -> KLController:
    """Build a KL controller by name.

    :param kind: ``"fixed"`` or ``"adaptive"``.
    :param kl_coef: (initial) coefficient.
    :param target: target KL; required for ``"adaptive"``.
    :param horizon: adaptation horizon; required for ``"adaptive"``.
    :raises ValueError: unknown kind, or missing target/horizon for ``"adaptive"``.
    """
    match kind:
        case "fixed":
            return FixedKLController(kl_coef)
        case "adaptive":
            if target is None or horizon is None:
                raise ValueError("adaptive KL controller needs both target and horizon")
            return AdaptiveKLController(kl_coef, target, horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; valid names: {', '.join(sorted(KLControllerKind.values()))}")
