"""Turning a scored rollout into training data: old/reference log-probs, values, advantages."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import torch

from rlcore import rlmath
from rlcore.config.schema import AdvEstimator, AlgorithmConfig, PPOConfig
from rlcore.rollout.base import RolloutBatch, host_to_device
from rlcore.trainer.models import response_logprobs, response_values
from rlcore.trainer.packing import micro_batches


@dataclass
class Experience:
    """Tensors of one rollout, ``B`` samples. ``T = P + R`` (prompt + response)."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, R] float
    old_logprobs: Optional[torch.Tensor]  # [B, R]; None: the update uses its own (on-policy) forward
    scores: torch.Tensor  # [B]
    ref_logprobs: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    rollout_logprobs: Optional[torch.Tensor] = None  # [B, R]: what the sampler reported for its tokens
    group_ids: Optional[torch.Tensor] = None  # [B] long: samples of one prompt share an id (None: consecutive groups)
    baseline: Optional[torch.Tensor] = None  # [B] ReMax: the score of the prompt's greedy response
    loss_mask: Optional[torch.Tensor] = None  # [B] float: 0 leaves a sample out of the loss (mask_truncated)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_mask.shape[1])

    def trimmed(self, used: Optional[tuple[int, int]] = None) -> "Experience":
        """The same samples without the columns no sample uses (see :func:`used_columns`; ``used``: its
        result where the caller has it already, e.g. from :func:`row_columns`, saving a device read)."""
        columns, kept = _sequence_columns(self.attention_mask, self.response_mask, used)
        if columns.stop - columns.start == self.input_ids.shape[1]:
            return self
        picked = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask"):
                v = v[:, columns]
            elif isinstance(v, torch.Tensor) and v.dim() == 2:
                v = v[:, :kept]
            picked[f.name] = v
        return replace(self, **picked)

    def select(self, idx: torch.Tensor) -> "Experience":
        picked = {}
        for f in fields(self):
            v = getattr(self, f.name)
            picked[f.name] = v[idx] if isinstance(v, torch.Tensor) else v
        return replace(self, **picked)


def used_columns(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """``(first, kept)`` for left-padded prompts followed by right-padded responses.

    ``first``: the first prompt column any row uses (at most the last prompt column, whose logit
    predicts the first response token); ``kept``: the response columns up to the last one any row
    uses (at least 1). Dropping the columns outside changes no valid token's position (positions
    come from the attention mask) nor any log-prob that is used. ``attention_mask [B, T]``,
    ``response_mask [B, R]``.
    """
    prompt_cols = attention_mask.shape[1] - response_mask.shape[1]
    used = torch.cat([attention_mask[:, :prompt_cols].bool().any(0), response_mask.bool().any(0)]).cpu()
    prompt_used, response_used = used[:prompt_cols], used[prompt_cols:]
    first = int(prompt_used.int().argmax()) if bool(prompt_used.any()) else prompt_cols
    first = max(0, min(first, prompt_cols - 1))
    kept = int(response_used.nonzero().max()) + 1 if bool(response_used.any()) else 1
    return first, kept


#: Trimmed rows are widened (with padding columns) to a multiple of this many, where the padded
#: width allows: compiled layers then see one alignment of the length and do not recompile for another
#: (the packed rows' :data:`rlcore.trainer.packing.PACK_MULTIPLE`).
TRIM_MULTIPLE = 8


def row_columns(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, on the host: its first used prompt column (the prompt width if none) and one past its
    last used response column (0 if none); :func:`rows_used` turns any rows' values into
    :func:`used_columns` of those rows."""
    prompt_cols = attention_mask.shape[1] - response_mask.shape[1]
    first, kept = torch.stack([first_set(attention_mask[:, :prompt_cols]), end_of_set(response_mask)]).cpu()
    return first, kept


def first_set(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: each row's first set column of ``mask [B, C]`` (``C`` where none is), on its device."""
    first = torch.full((mask.shape[0],), mask.shape[1], dtype=torch.long, device=mask.device)
    if mask.shape[1]:
        first = torch.where(mask.bool().any(-1), mask.bool().int().argmax(-1).long(), first)
    return first


def end_of_set(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: one past each row's last set column of ``mask [B, C]`` (0 where none is), on its device."""
    end = torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    if mask.shape[1]:
        set_ = mask.bool()
        end = torch.where(set_.any(-1), mask.shape[1] - set_.flip(-1).int().argmax(-1).long(), end)
    return end


def rows_used(first: torch.Tensor, kept: torch.Tensor, prompt_cols: int) -> tuple[int, int]:
    """:func:`used_columns` of the rows whose :func:`row_columns` are ``first`` and ``kept``."""
    low = int(first.min()) if len(first) else prompt_cols
    return max(0, min(low, prompt_cols - 1)), max(int(kept.max()) if len(kept) else 0, 1)


def _sequence_columns(attention_mask: torch.Tensor, response_mask: torch.Tensor,
                      used: Optional[tuple[int, int]] = None) -> tuple[slice, int]:
    """The used columns of the whole sequences (:func:`used_columns`, or ``used``) as a slice, and
    ``kept``, widened to a multiple of :data:`TRIM_MULTIPLE` columns: first with unused prompt (left
    padding) columns, then with unused response columns; the tightest cut when no multiple fits the rows."""
    first, kept = used if used is not None else used_columns(attention_mask, response_mask)
    prompt_cols, response_cols = attention_mask.shape[1] - response_mask.shape[1], response_mask.shape[1]
    short = -(prompt_cols - first + kept) % TRIM_MULTIPLE
    if short <= first + response_cols - kept:  # else no aligned width fits: the tightest cut
        left = min(short, first)
        first, kept = first - left, kept + short - left
    return slice(first, prompt_cols + kept), kept


def _trim(ids: torch.Tensor, mask: torch.Tensor, response_mask: Optional[torch.Tensor],
          used: Optional[tuple[int, int]] = None):
    """``(ids, mask, kept)``: the rows cut to their used columns (unchanged without ``response_mask``;
    ``used``: those columns where the host knows them)."""
    if response_mask is None:
        return ids, mask, None
    columns, kept = _sequence_columns(mask, response_mask, used)
    return ids[:, columns], mask[:, columns], kept


def _host_shapes(sizes: Any, idx: torch.Tensor, response_mask: Optional[torch.Tensor]) -> tuple:
    """``(used, known)`` of the samples ``idx`` from the host's ``sizes`` (:class:`~rlcore.trainer.sizes.SampleSizes`),
    or ``(None, None)`` (read from the device) without sizes or a response mask."""
    if sizes is None or response_mask is None:
        return None, None
    return sizes.shapes(idx)


def _forward_groups(mask: torch.Tensor, response_mask: Optional[torch.Tensor], micro: int, max_tokens: int,
                    packed: bool) -> list[torch.Tensor]:
    """The sample indices of each no-grad forward: ``micro`` samples each in order, or token-budget
    groups (:func:`rlcore.trainer.packing.micro_batches`) of the samples sorted by length."""
    n = len(mask)
    if max_tokens <= 0 or response_mask is None:
        return list(torch.split(torch.arange(n), max(1, micro)))
    order = torch.sort(mask.sum(-1).cpu(), descending=True, stable=True).indices
    return micro_batches(mask, response_mask, order, micro, max_tokens, packed)


@torch.no_grad()
def batched_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, response_len: int, temperature: float,
                     micro: int, response_mask: Optional[torch.Tensor] = None, *, max_tokens: int = 0,
                     packed: bool = False, sizes: Any = None) -> torch.Tensor:
    """Log-probs ``[B, R]`` chunk by chunk; with ``response_mask`` each chunk is cut to its used
    columns (:func:`used_columns`), the unused response columns are 0, and the other positions outside
    the mask carry no meaning (0 where the head runs on the response tokens only). ``max_tokens > 0``: chunks
    of at most that many tokens instead of ``micro`` samples; ``packed``: each chunk one packed row
    (both need ``response_mask``). ``sizes``: the samples' sizes on the host
    (:func:`rlcore.trainer.sizes.host_sizes`): each chunk is cut and shaped from them, reading nothing of
    the device, so the host queues the next chunk while one runs."""
    out = torch.zeros(len(ids), response_len, dtype=torch.float32, device=ids.device)
    for host_idx in _forward_groups(mask, response_mask, micro, max_tokens, packed):
        idx = host_to_device(host_idx, ids.device)
        c_resp = None if response_mask is None else response_mask[idx]
        if packed and c_resp is not None:
            out[idx] = response_logprobs(model, ids[idx], mask[idx], response_len, temperature,
                                         response_mask=c_resp, packed=True)[0].float()
            continue
        used, known = _host_shapes(sizes, host_idx, c_resp)
        c_ids, c_mask, kept = _trim(ids[idx], mask[idx], c_resp, used)
        kept = kept or response_len
        # with the response mask the head runs on the response tokens only (0 elsewhere)
        out[idx, :kept] = response_logprobs(model, c_ids, c_mask, kept, temperature,
                                            response_mask=None if c_resp is None else c_resp[:, :kept],
                                            known=known)[0].float()
    return out


@torch.no_grad()
def batched_values(critic, ids: torch.Tensor, mask: torch.Tensor, response_len: int, micro: int,
                   response_mask: Optional[torch.Tensor] = None, *, max_tokens: int = 0,
                   packed: bool = False, sizes: Any = None) -> torch.Tensor:
    """Values ``[B, R]`` chunk by chunk, cut and shaped like :func:`batched_logprobs`."""
    out = torch.zeros(len(ids), response_len, dtype=torch.float32, device=ids.device)
    for host_idx in _forward_groups(mask, response_mask, micro, max_tokens, packed):
        idx = host_to_device(host_idx, ids.device)
        c_resp = None if response_mask is None else response_mask[idx]
        if packed and c_resp is not None:
            out[idx] = response_values(critic, ids[idx], mask[idx], response_len, response_mask=c_resp,
                                       packed=True).float()
            continue
        used, known = _host_shapes(sizes, host_idx, c_resp)
        c_ids, c_mask, kept = _trim(ids[idx], mask[idx], c_resp, used)
        kept = kept or response_len
        out[idx, :kept] = response_values(critic, c_ids, c_mask, kept, known=known).float()
    return out


def to_experience(rollout: RolloutBatch, scores: torch.Tensor, device: torch.device) -> Experience:
    ids, mask = rollout.sequences()
    return Experience(input_ids=ids.to(device), attention_mask=mask.to(device),
                      response_mask=rollout.response_mask.to(device).float(),
                      old_logprobs=rollout.logprobs.to(device).float(), scores=scores.to(device).float(),
                      rollout_logprobs=rollout.logprobs.to(device).float())


def compute_advantages(exp: Experience, algo: AlgorithmConfig, ppo: PPOConfig, kl_coef: float,
                       group_size: int) -> dict[str, float]:
    """Fill ``exp.advantages`` (and ``exp.returns`` for GAE). Returns metrics.

    Groups are ``exp.group_ids`` when set (any sizes), else consecutive blocks of ``group_size``.
    With ``exp.loss_mask`` the masked samples keep their place in their group's baseline and are
    then left out of the loss (their response mask is cleared)."""
    mask = exp.response_mask
    metrics: dict[str, float] = {}
    kl = None
    if exp.ref_logprobs is not None:
        kl = rlmath.kl_penalty(exp.old_logprobs, exp.ref_logprobs, ppo.kl_estimator).detach() * mask
        seq_kl = kl.sum(-1)
        metrics["kl/mean"] = float(seq_kl.mean())
    use_kl_reward = kl is not None and ppo.kl_in_reward and kl_coef > 0
    groups = dict(index=exp.group_ids) if exp.group_ids is not None else dict(group_size=group_size)
    seq_scores = exp.scores - (kl_coef * kl.sum(-1) if use_kl_reward else 0.0)

    def token_rewards() -> torch.Tensor:
        return rlmath.token_level_rewards(exp.scores, mask, kl if use_kl_reward else None, kl_coef)

    match algo.adv_estimator:
        case "gae":
            if exp.values is None:
                raise ValueError("GAE needs values from a critic")
            adv, ret = rlmath.compute_gae(token_rewards(), exp.values, mask, algo.gamma, algo.lam)
            if algo.whiten_advantages:
                adv = rlmath.masked_whiten(adv, mask)
            exp.advantages, exp.returns = adv, ret
            metrics["critic/returns_mean"] = float(rlmath.masked_mean(ret, mask))
            metrics["critic/values_mean"] = float(rlmath.masked_mean(exp.values, mask))
        case "grpo":
            seq_adv = rlmath.grpo_advantages(seq_scores, norm_by_std=algo.norm_adv_by_std, **groups)
            exp.advantages = rlmath.broadcast_sequence_advantages(seq_adv, mask)
        case "rloo":
            exp.advantages = rlmath.broadcast_sequence_advantages(rlmath.rloo_advantages(seq_scores, **groups), mask)
        case "reinforce_plus_plus":
            exp.advantages = rlmath.reinforce_pp_advantages(token_rewards(), mask, algo.gamma)
        case "reinforce_plus_plus_baseline":
            exp.advantages = rlmath.reinforce_pp_baseline_advantages(seq_scores, mask, **groups)
        case "remax":
            if exp.baseline is None:
                raise ValueError("ReMax needs the greedy-rollout baseline scores (exp.baseline)")
            rewards = token_rewards()
            exp.advantages = rlmath.remax_advantages(rewards, mask, exp.baseline.to(rewards.device))
            metrics["advantages/remax_baseline_mean"] = float(exp.baseline.float().mean())
        case other:
            raise ValueError(f"unknown algorithm.adv_estimator {other!r}; valid names: "
                             f"{', '.join(AdvEstimator.values())}")
    metrics["advantages/mean"] = float(rlmath.masked_mean(exp.advantages, mask))
    metrics["advantages/abs_mean"] = float(rlmath.masked_mean(exp.advantages.abs(), mask))
    if exp.loss_mask is not None:
        exp.response_mask = exp.response_mask * exp.loss_mask.to(mask.device, mask.dtype).unsqueeze(1)
        metrics["response/masked_truncated_frac"] = float(1.0 - exp.loss_mask.float().mean())
    return metrics
