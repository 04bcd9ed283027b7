"""The PPO update: epochs over shuffled mini-batches, gradient accumulation over micro-batches, clipping."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.profiler import record_function

from rlcore import rlmath
from rlcore.config.schema import PPOConfig
from rlcore.errors import TrainingError
from rlcore.trainer.experience import Experience
from rlcore.rollout.base import host_to_device
from rlcore.trainer import aligned
from rlcore.trainer.models import response_logprobs, response_values
from rlcore.trainer.packing import micro_batches
from rlcore.trainer.sizes import SampleSizes as _Sizes
from rlcore.trainer.sizes import host_sizes as _host_sizes
from rlcore.trainer.sizes import padding_share as _padding_share

log = logging.getLogger(__name__)


@dataclass
class Batching:
    """How one rollout of ``n`` samples is cut: ``mini`` samples per optimizer step, ``micro`` per backward."""

    mini: int
    micro: int

    @classmethod
    def from_config(cls, n: int, ppo: PPOConfig, grad_accum: int, strict: bool = True) -> "Batching":
        """``strict``: a rollout of ``n`` samples that ``ppo.mini_batch_size`` does not divide is an
        error (the configured rollout); otherwise (a rollout that dynamic sampling made smaller) the
        last optimizer step takes the remainder."""
        from rlcore.config.loader import mini_batch_problem

        problem = mini_batch_problem(n, int(ppo.mini_batch_size or 0)) if strict else None
        if problem:
            from rlcore.errors import ConfigError

            raise ConfigError([f"'ppo.mini_batch_size' = {ppo.mini_batch_size}: {problem}"])
        mini = min(n, ppo.mini_batch_size or n)
        micro = ppo.micro_batch_size or max(1, mini // max(1, grad_accum))
        return cls(mini=mini, micro=min(micro, mini))


def on_policy(n: int, ppo: PPOConfig, grad_accum: int) -> bool:
    """True when the update of a rollout of ``n`` samples is one optimizer step over all of them.

    Every micro-batch's forward then runs on the weights that scored the rollout, so the old
    log-probs equal the new ones (detached): the ratio is 1 and no separate forward pass is needed.
    """
    return int(ppo.ppo_epochs) == 1 and Batching.from_config(n, ppo, grad_accum, strict=False).mini >= n


def share_counts(response_mask: torch.Tensor, groups: Sequence[torch.Tensor], loss_agg: str) -> list[float]:
    """What each micro-batch's loss is a mean over: its valid tokens (``token-mean``), or its sequences
    that have a valid token (the per-sequence means); ``token-sum``: 1 each (sums add up)."""
    if loss_agg == "token-sum":  # sums add up: every micro-batch's sum counts once
        return [1.0] * len(groups)
    counts = [response_mask[g.to(response_mask.device)].sum(-1).float().cpu() for g in groups]
    if loss_agg != "token-mean":
        counts = [(c > 0).float() for c in counts]
    return [float(c.sum()) for c in counts]


def group_weights(response_mask: torch.Tensor, groups: Sequence[torch.Tensor], loss_agg: str) -> list[float]:
    """Weight of each micro-batch's (mean) loss so that the accumulated gradient is the mini-batch's.

    ``groups`` holds the sample indices of each micro-batch of one mini-batch. ``token-mean``
    losses are means over a micro-batch's valid tokens, so each weighs its share of the
    mini-batch's valid tokens; per-sequence means weigh their share of the sequences that have a
    valid token (the ones :func:`rlcore.rlmath.aggregate_loss` counts). Either way the result does
    not depend on how the mini-batch is cut or ordered, nor on how many tokens each micro-batch
    holds; ``token-sum`` losses add up, each micro-batch's weighing 1. ``response_mask [B, R]``.
    """
    counts = share_counts(response_mask, groups, loss_agg)
    if loss_agg == "token-sum":
        return counts
    total = float(sum(counts))
    if total <= 0:
        sizes = [len(g) for g in groups]
        return [n / max(1, sum(sizes)) for n in sizes]
    return [c / total for c in counts]


def provisional_total(samples: int, max_new_tokens: int, loss_agg: str) -> float:
    """A stand-in for :func:`group_weights`' denominator before the rollout is over (the overlapped
    update, :mod:`rlcore.trainer.overlap`): an upper bound of the valid tokens (``token-mean``) or of
    the sequences; the gradients accumulated with it are rescaled once the true one is known."""
    if loss_agg == "token-sum":
        return 1.0
    return float(samples * (max_new_tokens if loss_agg == "token-mean" else 1))


@dataclass
class Accumulated:
    """Micro-batches of one rollout whose forward and backward already ran (during the rollout:
    :mod:`rlcore.trainer.overlap`), their gradients in ``.grad``, each loss weighed by its count
    (:func:`share_counts`) over a provisional denominator (:func:`provisional_total`).

    ``groups``: each micro-batch's sample indices (into the rollout); ``provisional``: the weight
    each was accumulated with; ``stats``: their metrics, one value per micro-batch and name (as
    :func:`actor_micro_loss` records them); ``logprobs``: each micro-batch's on-policy log-probs
    ``[samples, columns]`` (response columns from the first); ``seconds``: forward and backward
    time; ``wait_s``: time the trainer waited for them after the rollout."""

    groups: list[torch.Tensor] = field(default_factory=list)
    provisional: list[float] = field(default_factory=list)
    stats: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    logprobs: list[torch.Tensor] = field(default_factory=list)
    seconds: float = 0.0
    wait_s: float = 0.0

    @property
    def done(self) -> torch.Tensor:
        """The sample indices whose gradient is accumulated."""
        return torch.cat(self.groups) if self.groups else torch.zeros(0, dtype=torch.long)

    def rescale(self, model: torch.nn.Module, weights: Sequence[float]) -> None:
        """Turn the provisional weights into ``weights`` (the true ones of :attr:`groups`): the
        gradient is linear in the weights, which differ from the provisional ones by one factor."""
        provisional = float(sum(self.provisional))
        scale = float(sum(weights)) / provisional if provisional > 0 else 1.0
        if scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)


def micro_weights(response_mask: torch.Tensor, mini_idx: torch.Tensor, micro: int, loss_agg: str) -> list[float]:
    """:func:`group_weights` of ``mini_idx`` cut into micro-batches of ``micro`` samples."""
    return group_weights(response_mask, list(torch.split(mini_idx, micro)), loss_agg)


def _grad_norm(model: torch.nn.Module, grad_clip: float) -> float:
    """The global gradient norm of ``model`` (over every rank's shards), after clipping to ``grad_clip``."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip and grad_clip > 0 else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _step(optim, sched, apply: bool) -> None:
    """One optimizer and scheduler step (``apply``), or drop the gradients of a skipped step."""
    if apply:
        optim.step()
        sched.step()
    optim.zero_grad(set_to_none=True)


class NonFiniteGuard:
    """Skips optimizer steps whose loss or gradient norm is not finite; stops the run after
    ``limit`` such steps in a row (``trainer.max_nonfinite_steps``).

    :attr:`streak` counts the skipped optimizer steps since the last applied one (the loop does not
    save a checkpoint while it is non-zero); :attr:`skipped` counts them over the run.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.streak = 0
        self.skipped = 0

    def allow(self, finite: bool, where: str) -> bool:
        """Whether the optimizer step may be applied.

        :raises TrainingError: more than ``limit`` non-finite steps in a row.
        """
        if finite:
            self.streak = 0
            return True
        self.streak += 1
        self.skipped += 1
        if self.streak > self.limit:
            raise TrainingError(
                f"training diverged: {self.streak} optimizer steps in a row had a non-finite loss or gradient "
                f"norm ({where}); stopped after trainer.max_nonfinite_steps={self.limit}. No checkpoint or "
                "export was written from the diverged weights; the last checkpoint holds the last finite "
                "state. Lower actor.lr / critic.lr, set actor.grad_clip, or check the reward scale")
        log.warning("skipping an optimizer step: non-finite loss or gradient norm (%s); %d in a row, the run "
                    "stops after trainer.max_nonfinite_steps=%d", where, self.streak, self.limit)
        return False


def params_finite(*modules) -> bool:
    """Whether every parameter of ``modules`` is finite on every rank (collective)."""
    from rlcore.distributed.init import any_rank

    bad = False
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if not bool(torch.isfinite(local.detach()).all()):
                bad = True
                break
    return not any_rank(bad)


def _losses_finite(values: list[float]) -> bool:
    """Whether the micro-batch losses of this optimizer step are finite on every rank (collective)."""
    from rlcore.distributed.init import any_rank

    return not any_rank(not all(math.isfinite(v) for v in values))


def actor_micro_loss(actor, mb: Experience, ppo: PPOConfig, temperature: float, kl_loss_coef: float,
                     weight: float, stats: dict, packed: bool = False,
                     known: Optional[aligned.KnownRows] = None) -> torch.Tensor:
    """Forward and backward of one actor micro-batch; returns the (detached) log-probs the ratio's
    denominator used: the recomputed old ones, or, on-policy, this forward's own. ``known``: the rows'
    sizes from the host (see :func:`~rlcore.trainer.models.response_logprobs`)."""
    # Without an entropy bonus the entropy is only a metric: no autograd graph over the vocabulary for it.
    logp, ent = response_logprobs(actor, mb.input_ids, mb.attention_mask, mb.response_len, temperature,
                                  with_entropy=True, entropy_grad=ppo.entropy_coeff != 0,
                                  response_mask=mb.response_mask, packed=packed, known=known)
    mask = mb.response_mask
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()  # None: on-policy (see on_policy)
    horizon = int(ppo.generation.max_new_tokens)  # the constant length of seq-mean-token-sum-norm
    is_weights = None
    if ppo.rollout_is != "none" and mb.rollout_logprobs is not None:
        # one factor on every token's policy-gradient loss, whatever the loss (see rlmath.rollout_is_weights)
        is_weights, is_stats = rlmath.rollout_is_weights(old, mb.rollout_logprobs, mask, ppo.rollout_is,
                                                         ppo.rollout_is_cap)
        stats["rollout_is/weight_mean"].append(_value(is_stats["mean"]))
        stats["rollout_is/capped_frac"].append(_value(is_stats["capped_frac"]))
    pg_loss, pg_stats = rlmath.policy_loss(logp, old, mb.advantages, mask, ppo.cliprange,
                                           ppo.cliprange_high, ppo.dual_clip, ppo.loss_agg,
                                           kind=ppo.policy_loss, horizon=horizon, token_weights=is_weights)
    entropy = rlmath.masked_mean(ent.detach(), mask)
    loss = pg_loss
    if ppo.entropy_coeff != 0:  # the bonus is aggregated like the policy loss
        loss = loss - ppo.entropy_coeff * rlmath.aggregate_loss(ent, mask, ppo.loss_agg, horizon)
    if kl_loss_coef > 0 and mb.ref_logprobs is not None:
        kl_tokens = rlmath.kl_penalty(logp, mb.ref_logprobs, ppo.kl_estimator)
        loss = loss + kl_loss_coef * rlmath.aggregate_loss(kl_tokens, mask, ppo.loss_agg, horizon)
        stats["actor/kl_loss"].append(_value(rlmath.masked_mean(kl_tokens.detach(), mask)))
    (loss * weight).backward()
    # kept on the device: read to the host once an optimizer step (host_stats), so the host does not wait
    # for this backward before it queues the next micro-batch
    stats["loss/policy"].append(_value(pg_loss))
    stats["entropy/mean"].append(_value(entropy))
    stats["actor/clipfrac"].append(_value(pg_stats["clipfrac"]))
    stats["actor/approx_kl"].append(_value(pg_stats["approx_kl"]))
    return old


def _value(x):
    """A metric of one micro-batch as recorded: a tensor stays on its device, detached (see :func:`host_stats`);
    a distributed one (DTensor) as its full value."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach()


def host_stats(stats: dict[str, list]) -> dict[str, list[float]]:
    """``stats`` with every value a float: the values still on a device are read in one transfer a device."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for values in stats.values():
        for v in values:
            if isinstance(v, torch.Tensor):
                by_device[v.device].append(v)
    read: dict[int, float] = {}
    for tensors in by_device.values():
        for v, x in zip(tensors, torch.stack([t.reshape(()).float() for t in tensors]).tolist()):
            read[id(v)] = x
    return {k: [read[id(v)] if isinstance(v, torch.Tensor) else float(v) for v in values] for k, values in stats.items()}


def set_gradient_sync(module, on: bool) -> None:
    """Turn the cross-rank gradient reduction of an FSDP2 module on or off (no-op for other modules).

    With it off, a backward accumulates this rank's unsharded gradients without communication, so
    ``trainer.gradient_accumulation_steps`` micro-batches cost one reduce-scatter, not one each
    (the price: the unsharded gradients are held until the last micro-batch)."""
    setter = getattr(module, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(on)


def critic_micro_loss(critic, mb: Experience, ppo: PPOConfig, weight: float, stats: dict,
                      packed: bool = False) -> None:
    """Forward and backward of one critic micro-batch (a token mean: ``weight`` is its token share)."""
    values = response_values(critic, mb.input_ids, mb.attention_mask, mb.response_len,
                             response_mask=mb.response_mask, packed=packed)
    vf_loss, clipfrac = rlmath.value_loss(values, mb.values, mb.returns, mb.response_mask, ppo.cliprange_value)
    (ppo.vf_coef * vf_loss * weight).backward()
    stats["loss/value"].append(_value(vf_loss))
    stats["critic/clipfrac"].append(_value(clipfrac))


def mismatch_metrics(exp: Experience, trainer_logprobs: Optional[torch.Tensor]) -> dict[str, float]:
    """``rollout/logprob_*``: the rollout's log-probs against the trainer's recomputation of the same tokens."""
    if exp.rollout_logprobs is None or trainer_logprobs is None:
        return {}
    m = rlmath.logprob_mismatch(exp.rollout_logprobs, trainer_logprobs, exp.response_mask)
    return {"rollout/logprob_abs_diff_mean": float(m["abs_diff_mean"]),
            "rollout/logprob_abs_diff_max": float(m["abs_diff_max"]), "rollout/logprob_kl": float(m["kl"])}


def token_budget(ppo: PPOConfig, recompute: dict[str, Any]) -> int:
    """``ppo.max_tokens_per_micro_batch`` (0: off), lowered to what fits without checkpointing (see
    :meth:`~rlcore.trainer.recompute.Recompute.token_budget`)."""
    budget = int(ppo.max_tokens_per_micro_batch)
    for policy in recompute.values():  # a budget that would need checkpointing is lowered to one that does not
        budget = min(budget, policy.token_budget(budget)) if policy is not None else budget
    return budget


def ppo_update(exp: Experience, *, actor, actor_opt, actor_sched, actor_grad_clip: float,
               critic=None, critic_opt=None, critic_sched=None, critic_grad_clip: float = 0.0,
               ppo: PPOConfig, grad_accum: int, temperature: float, kl_loss_coef: float,
               generator: Optional[torch.Generator] = None, packed: bool = False,
               recompute: Optional[dict[str, Any]] = None,
               guard: Optional[NonFiniteGuard] = None,
               pre: Optional[Accumulated] = None) -> dict[str, float]:
    """Run ``ppo.ppo_epochs`` passes over ``exp``; return averaged metrics.

    Each mini-batch is cut into micro-batches of ``ppo.micro_batch_size`` samples, or of at most
    ``ppo.max_tokens_per_micro_batch`` tokens; ``packed``: each micro-batch's forward is one packed
    row (:mod:`rlcore.trainer.packing`). ``recompute``: per role (``actor``, ``critic``) an
    :class:`~rlcore.trainer.recompute.Recompute` that turns activation checkpointing on for the
    micro-batches that need it. An optimizer step whose loss or gradient norm is not finite is
    skipped (``guard`` decides and stops the run after too many in a row); ``train/nonfinite_steps``
    counts the skipped ones. ``pre``: micro-batches whose gradients are already accumulated (the
    overlapped update; one optimizer step over ``exp``, no critic): only the other samples run
    here, and the step's metrics weigh both parts alike."""
    cut = Batching.from_config(exp.size, ppo, grad_accum, strict=False)
    if pre is not None and pre.groups and (int(ppo.ppo_epochs) != 1 or cut.mini < exp.size or critic is not None):
        raise ValueError("ppo_update: pre-accumulated micro-batches need one optimizer step over the rollout "
                         "(ppo_epochs=1, one mini-batch) and no critic")
    started = time.perf_counter()
    stats: dict[str, list[float]] = defaultdict(list)
    spent = {"critic": 0.0}  # the critic's seconds (each of its micro-batches and steps waited for)
    recompute = recompute or {}
    skipped = 0
    actor.train()
    if critic is not None:
        critic.train()
    sizes = _host_sizes(exp)  # each sample's tokens, read to the host once: length grouping, padding share
    budget = token_budget(ppo, recompute)
    if budget:
        stats["actor/micro_batch_token_budget"].append(float(budget))
    # on-policy, the trainer's log-probs come from the update's own forward: kept for the mismatch metrics
    own_old = torch.zeros_like(exp.rollout_logprobs) if (
        exp.old_logprobs is None and exp.rollout_logprobs is not None) else None
    for _ in range(ppo.ppo_epochs):
        order = torch.randperm(exp.size, generator=generator)
        for start in range(0, exp.size, cut.mini):  # every sample trains: a last, smaller step takes a remainder
            mini_idx = order[start:start + cut.mini]
            if pre is not None and pre.groups:  # the samples whose gradient is accumulated already are left out
                mini_idx = mini_idx[~torch.isin(mini_idx, pre.done)]
            if ppo.group_by_length:  # similar lengths share a micro-batch (stable: ties keep the shuffle)
                mini_idx = mini_idx[torch.sort(sizes.tokens[mini_idx.cpu()], descending=True, stable=True).indices]
            with record_function("rlcore.update.plan"):
                groups, weights, token_weights = _plan(exp, mini_idx, cut.micro, budget, ppo.loss_agg, packed, pre)
            stats["actor/padding_frac"].append(_padding_share(groups, sizes, packed, ppo.trim_padding))
            done = len(pre.groups) if pre is not None else 0
            if done:
                pre.rescale(actor, weights[:done])
                _fill_own_old(own_old, pre)
            micro = _accumulate(exp, groups[done:], weights[done:], token_weights[done:], actor=actor, critic=critic,
                                ppo=ppo, temperature=temperature, kl_loss_coef=kl_loss_coef, packed=packed,
                                recompute=recompute, own_old=own_old, spent=spent, sizes=sizes)
            if done:
                micro = {k: list(pre.stats.get(k, [])) + list(micro.get(k, [])) for k in dict.fromkeys([*pre.stats, *micro])}
            with record_function("rlcore.update.optimizer_step"):
                applied = _finish_step(micro, weights, token_weights, stats, spent, guard, actor=actor,
                                       actor_opt=actor_opt, actor_sched=actor_sched, actor_grad_clip=actor_grad_clip,
                                       critic=critic, critic_opt=critic_opt, critic_sched=critic_sched,
                                       critic_grad_clip=critic_grad_clip)
            skipped += not applied
            stats["actor/micro_batches"].append(float(len(groups)))
    out = {k: sum(v) / len(v) for k, v in stats.items() if v}
    out.update(mismatch_metrics(exp, own_old if own_old is not None else exp.old_logprobs))
    _wait(exp.input_ids.device)  # the update's seconds include its queued work (the last optimizer step)
    actor_s = time.perf_counter() - started - spent["critic"]
    out["actor/lr"] = float(actor_sched.get_last_lr()[0])
    out["actor/optimizer_steps"] = float(len(stats["actor/grad_norm"]) - skipped)
    out["train/nonfinite_steps"] = float(skipped)
    out["time/update_actor_s"] = actor_s + (pre.wait_s if pre is not None else 0.0)
    if critic is not None:
        out["time/update_critic_s"] = spent["critic"]
    return out


def _finish_step(micro: dict[str, list[float]], weights: list[float], token_weights: list[float],
                 stats: dict[str, list[float]], spent: dict[str, float], guard: Optional[NonFiniteGuard], *,
                 actor, actor_opt, actor_sched, actor_grad_clip: float, critic, critic_opt, critic_sched,
                 critic_grad_clip: float) -> bool:
    """Clip, check and apply (or skip) one optimizer step whose gradients are accumulated; its
    per-micro-batch metrics ``micro`` go into ``stats`` weighed as the gradients were. Whether it applied."""
    micro = host_stats(micro)
    norms = {"actor": _grad_norm(actor, actor_grad_clip)}
    critic_s = 0.0
    if critic is not None:
        t1 = time.perf_counter()
        norms["critic"] = _grad_norm(critic, critic_grad_clip)
        critic_s = time.perf_counter() - t1
    losses = micro.get("loss/policy", []) + micro.get("loss/value", [])
    finite = all(math.isfinite(v) for v in norms.values()) and _losses_finite(losses)
    for name, values in micro.items():
        if values:
            stats[name].append(_step_value(name, values, weights, token_weights))
    where = ", ".join(f"{k} grad norm {v:.4g}" for k, v in norms.items())
    apply = finite if guard is None else guard.allow(finite, where)
    for name, v in norms.items():
        stats[f"{name}/grad_norm"].append(v)
    _step(actor_opt, actor_sched, apply)
    if critic is not None:
        device = next(critic.parameters()).device
        _wait(device)
        t4 = time.perf_counter()
        _step(critic_opt, critic_sched, apply)
        _wait(device)
        spent["critic"] += critic_s + (time.perf_counter() - t4)
    return apply


def _accumulate(exp: Experience, groups: list[torch.Tensor], weights: list[float], token_weights: list[float], *,
                actor, critic, ppo: PPOConfig, temperature: float, kl_loss_coef: float, packed: bool,
                recompute: dict[str, Any], own_old: Optional[torch.Tensor], spent: dict[str, float],
                sizes: Optional[_Sizes] = None) -> dict[str, list[float]]:
    """Forward and backward of one mini-batch's micro-batches ``groups`` (sample indices), the actor's
    losses weighed by ``weights`` and the critic's by ``token_weights``; the gradients accumulate for
    one optimizer step. Returns the step's per-micro-batch metrics; adds the critic's time to
    ``spent["critic"]`` and, on-policy, this forward's log-probs to ``own_old``."""
    micro: dict[str, list[float]] = defaultdict(list)  # this optimizer step's values, one per micro-batch
    for k, (group, weight) in enumerate(zip(groups, weights)):
        # Sharded gradients are reduced across ranks once per optimizer step, in the last
        # micro-batch's backward; the earlier ones accumulate locally.
        last = k == len(groups) - 1
        set_gradient_sync(actor, last)
        if critic is not None:
            set_gradient_sync(critic, last)
        idx = host_to_device(group, exp.input_ids.device)
        used, known = sizes.shapes(group) if sizes is not None else (None, None)
        with record_function("rlcore.update.micro_batch"):
            mb, old = actor_micro_step(actor, exp, idx, weight, micro, ppo=ppo, temperature=temperature,
                                       kl_loss_coef=kl_loss_coef, packed=packed, recompute=recompute, k=k,
                                       used=used, known=known)
        if own_old is not None:
            own_old[idx, :old.shape[1]] = old.to(own_old.dtype)
        if critic is not None:  # each role's time apart: wait for the actor's backward (alone, none is waited for)
            _wait(idx.device)
            t1 = time.perf_counter()
            with _recomputing(recompute.get("critic"), _tokens(mb, packed)), record_function("rlcore.update.critic"):
                critic_micro_loss(critic, mb, ppo, token_weights[k], micro, packed)
            _wait(idx.device)
            spent["critic"] += time.perf_counter() - t1
    return micro


def actor_micro_step(actor, exp: Experience, idx: torch.Tensor, weight: float, stats: dict, *, ppo: PPOConfig,
                     temperature: float, kl_loss_coef: float, packed: bool, recompute: dict[str, Any],
                     k: int = 0, used: Optional[tuple[int, int]] = None,
                     known: Optional[aligned.KnownRows] = None) -> tuple[Experience, torch.Tensor]:
    """The actor's forward and backward of the samples ``idx`` of ``exp`` (cut to their columns with
    ``ppo.trim_padding``, checkpointed as ``recompute`` decides): the micro-batch and the log-probs
    of :func:`actor_micro_loss`. ``k``: the micro-batch's place in its step (for :data:`CHECK_FINITE`);
    ``used``: the samples' used columns where the caller read them already (:meth:`_Sizes.used`);
    ``known``: their sizes likewise (:meth:`_Sizes.known`): with both, the micro-batch reads nothing of
    the device before its metrics are read at the optimizer step.
    Out of memory under ``gradient_checkpointing=auto`` before any of its gradient was accumulated, the
    micro-batch runs again with every layer checkpointed (:meth:`~rlcore.trainer.recompute.Recompute.retry_after_oom`)."""
    mb = exp.select(idx)
    if ppo.trim_padding:
        mb = mb.trimmed(used)
    policy, tokens = recompute.get("actor"), _tokens(mb, packed, known)
    accumulations, recorded = getattr(policy, "accumulations", 0), {key: len(v) for key, v in stats.items()}
    again = False
    try:
        with _recomputing(policy, tokens):
            old = actor_micro_loss(actor, mb, ppo, temperature, kl_loss_coef, weight, stats, packed, known)
    except torch.OutOfMemoryError:
        # gradient_checkpointing=auto guessed short: the same micro-batch again, every layer checkpointed,
        # where nothing of it reached .grad (outside this block, so the failed try's tensors are freed)
        if policy is None or not policy.retry_after_oom(accumulations, tokens):
            raise
        again = True
    if again:
        for key in list(stats):  # the failed try's values out, and the keys it alone added
            del stats[key][recorded.get(key, 0):]
            if not stats[key] and key not in recorded:
                del stats[key]
        with policy.for_tokens(tokens, every=True):
            old = actor_micro_loss(actor, mb, ppo, temperature, kl_loss_coef, weight, stats, packed, known)
    if CHECK_FINITE:
        _check_micro_batch(actor, mb, old, stats, k)
    return mb, old


def _tokens(mb: Experience, packed: bool, known: Optional[aligned.KnownRows] = None) -> int:
    """Tokens one forward over ``mb`` processes: the real ones packed, rows x width padded (the longest
    row's tokens when the rows are moved left, :mod:`rlcore.trainer.aligned`; from ``known`` where the
    host has it)."""
    if packed:
        return int(mb.attention_mask.sum())
    if aligned.ENABLED and known is not None and known.longest is not None:
        return len(mb.attention_mask) * int(known.longest)
    if aligned.ENABLED:
        return len(mb.attention_mask) * int(mb.attention_mask.sum(-1).max()) if len(mb.attention_mask) else 0
    return mb.attention_mask.numel()


def _plan(exp: Experience, mini_idx: torch.Tensor, micro: int, budget: int, loss_agg: str, packed: bool,
          pre: Optional[Accumulated]) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """The micro-batches of ``mini_idx`` after ``pre``'s (if any), and the loss weights and token shares
    of all of them (:func:`group_weights`)."""
    groups = micro_batches(exp.attention_mask, exp.response_mask, mini_idx, micro, budget, packed) \
        if len(mini_idx) else []
    groups = (list(pre.groups) if pre is not None else []) + list(groups)
    weights = group_weights(exp.response_mask, groups, loss_agg)
    token_weights = weights if loss_agg == "token-mean" else group_weights(exp.response_mask, groups, "token-mean")
    return groups, weights, token_weights


def _fill_own_old(own_old: Optional[torch.Tensor], pre: Accumulated) -> None:
    """The on-policy log-probs of ``pre``'s micro-batches into ``own_old`` (for the mismatch metrics)."""
    if own_old is None:
        return
    for group, logp in zip(pre.groups, pre.logprobs):
        width = min(logp.shape[1], own_old.shape[1])  # wider rows (the rollout's cap): the rest is padding
        own_old[group.to(own_old.device), :width] = logp[:, :width].to(own_old.device, own_old.dtype)


#: ``RLCORE_CHECK_FINITE=<directory>``: after every actor micro-batch, check its log-probs, loss and the
#: accumulated gradients; the first micro-batch that makes one non-finite is saved there (a diagnosis aid:
#: it costs a device sync and a pass over the gradients per micro-batch)
CHECK_FINITE = os.environ.get("RLCORE_CHECK_FINITE", "")


def _check_micro_batch(actor, mb: Experience, logp: torch.Tensor, micro: dict, k: int) -> None:
    """See :data:`CHECK_FINITE`: log and save the first micro-batch after which something is not finite."""
    if getattr(_check_micro_batch, "saved", False):
        return
    mask = mb.response_mask.bool()
    found = []
    if not bool(torch.isfinite(logp[mask[:, :logp.shape[1]]]).all()):
        found.append("log-probs")
    if micro.get("loss/policy") and not math.isfinite(float(micro["loss/policy"][-1])):
        found.append("policy loss")
    bad = [name for name, p in actor.named_parameters()
           if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if bad:
        found.append(f"gradients of {len(bad)} parameters (first: {', '.join(bad[:4])})")
    if not found:
        return
    os.makedirs(CHECK_FINITE, exist_ok=True)
    path = os.path.join(CHECK_FINITE, f"nonfinite_micro_batch_{os.getpid()}.pt")
    torch.save({"micro_batch": k, "found": found, "input_ids": mb.input_ids.cpu(),
                "attention_mask": mb.attention_mask.cpu(), "response_mask": mb.response_mask.cpu(),
                "advantages": mb.advantages.cpu() if mb.advantages is not None else None,
                "logprobs": logp.detach().float().cpu()}, path)
    log.warning("RLCORE_CHECK_FINITE: micro-batch %d (%d samples, %s tokens wide) made non-finite: %s; saved to %s",
                k, mb.input_ids.shape[0], mb.input_ids.shape[1], "; ".join(found), path)
    _check_micro_batch.saved = True


def _step_value(name: str, values: list[float], weights: list[float], token_weights: list[float]) -> float:
    """An optimizer step's value of a per-micro-batch metric, whatever the cut: the policy loss
    summed with the weights its gradient was accumulated with (``ppo.loss_agg``), the token means
    (value loss, entropy, clip fractions, KL, importance weights) with each micro-batch's token share."""
    shares = weights if name == "loss/policy" else token_weights
    if len(values) != len(shares):  # not recorded for every micro-batch: a plain mean
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, shares))


def _wait(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; others run their work as it is queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _recomputing(policy, tokens: int):
    """The activation-checkpointing decision of ``policy`` for a micro-batch of ``tokens`` (none: a no-op)."""
    return policy.for_tokens(tokens) if policy is not None else contextlib.nullcontext()
