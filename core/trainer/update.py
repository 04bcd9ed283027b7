"""The PPO update: epochs over shuffled mini-batches, gradient accumulation over micro-batches, clipping."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch

from rlcore import rlmath
from rlcore.config.schema import PPOConfig
from rlcore.trainer.experience import Experience
from rlcore.trainer.models import response_logprobs, response_values


@dataclass
class Batching:
    """How one rollout of ``n`` samples is cut: ``mini`` samples per optimizer step, ``micro`` per backward."""

    mini: int
    micro: int

    @classmethod
    def from_config(cls, n: int, ppo: PPOConfig, grad_accum: int) -> "Batching":
        mini = min(n, ppo.mini_batch_size or n)
        micro = ppo.micro_batch_size or max(1, mini // max(1, grad_accum))
        return cls(mini=mini, micro=min(micro, mini))


def on_policy(n: int, ppo: PPOConfig, grad_accum: int) -> bool:
    """True when the update of a rollout of ``n`` samples is one optimizer step over all of them.

    Every micro-batch's forward then runs on the weights that scored the rollout, so the old
    log-probs equal the new ones (detached): the ratio is 1 and no separate forward pass is needed.
    """
    return int(ppo.ppo_epochs) == 1 and Batching.from_config(n, ppo, grad_accum).mini >= n


def micro_weights(response_mask: torch.Tensor, mini_idx: torch.Tensor, micro: int, loss_agg: str) -> list[float]:
    """Weight of each micro-batch's (mean) loss so that the accumulated gradient is the mini-batch's.

    ``token-mean`` losses are means over a micro-batch's valid tokens, so each weighs its share of
    the mini-batch's tokens; per-sequence means weigh their share of the samples. Either way the
    result does not depend on how the mini-batch is cut or ordered. ``response_mask [B, R]``.
    """
    sizes = [len(mini_idx[s:s + micro]) for s in range(0, len(mini_idx), micro)]
    if loss_agg == "token-sum":  # sums add up: every micro-batch's sum counts once
        return [1.0] * len(sizes)
    if loss_agg != "token-mean":
        return [n / len(mini_idx) for n in sizes]
    counts = response_mask[mini_idx.to(response_mask.device)].sum(-1).float().cpu()
    total = float(counts.sum())
    if total <= 0:
        return [n / len(mini_idx) for n in sizes]
    return [float(part.sum()) / total for part in torch.split(counts, sizes)]


def _clip_and_step(model: torch.nn.Module, optim, sched, grad_clip: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip and grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def actor_micro_loss(actor, mb: Experience, ppo: PPOConfig, temperature: float, kl_loss_coef: float,
                     weight: float, stats: dict) -> torch.Tensor:
    # Without an entropy bonus the entropy is only a metric: no autograd graph over the vocabulary for it.
    logp, ent = response_logprobs(actor, mb.input_ids, mb.attention_mask, mb.response_len, temperature,
                                  with_entropy=True, entropy_grad=ppo.entropy_coeff != 0)
    mask = mb.response_mask
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()  # None: on-policy (see on_policy)
    horizon = int(ppo.generation.max_new_tokens)  # the constant length of seq-mean-token-sum-norm
    pg_loss, pg_stats = rlmath.policy_loss(logp, old, mb.advantages, mask, ppo.cliprange,
                                           ppo.cliprange_high, ppo.dual_clip, ppo.loss_agg,
                                           kind=ppo.policy_loss, horizon=horizon)
    entropy = rlmath.masked_mean(ent.detach(), mask)
    loss = pg_loss
    if ppo.entropy_coeff != 0:  # the bonus is aggregated like the policy loss
        loss = loss - ppo.entropy_coeff * rlmath.aggregate_loss(ent, mask, ppo.loss_agg, horizon)
    if kl_loss_coef > 0 and mb.ref_logprobs is not None:
        kl_tokens = rlmath.kl_penalty(logp, mb.ref_logprobs, ppo.kl_estimator)
        loss = loss + kl_loss_coef * rlmath.aggregate_loss(kl_tokens, mask, ppo.loss_agg, horizon)
        stats["actor/kl_loss"].append(float(rlmath.masked_mean(kl_tokens.detach(), mask)))
    (loss * weight).backward()
    stats["loss/policy"].append(float(pg_loss.detach()))
    stats["entropy/mean"].append(float(entropy.detach()))
    stats["actor/clipfrac"].append(float(pg_stats["clipfrac"]))
    stats["actor/approx_kl"].append(float(pg_stats["approx_kl"]))
    return loss


def set_gradient_sync(module, on: bool) -> None:
    """Turn the cross-rank gradient reduction of an FSDP2 module on or off (no-op for other modules).

    With it off, a backward accumulates this rank's unsharded gradients without communication, so
    ``trainer.gradient_accumulation_steps`` micro-batches cost one reduce-scatter, not one each
    (the price: the unsharded gradients are held until the last micro-batch)."""
    setter = getattr(module, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(on)


def critic_micro_loss(critic, mb: Experience, ppo: PPOConfig, weight: float, stats: dict) -> None:
    values = response_values(critic, mb.input_ids, mb.attention_mask, mb.response_len)
    vf_loss, clipfrac = rlmath.value_loss(values, mb.values, mb.returns, mb.response_mask, ppo.cliprange_value)
    (ppo.vf_coef * vf_loss * weight).backward()
    stats["loss/value"].append(float(vf_loss.detach()))
    stats["critic/clipfrac"].append(float(clipfrac))


def ppo_update(exp: Experience, *, actor, actor_opt, actor_sched, actor_grad_clip: float,
               critic=None, critic_opt=None, critic_sched=None, critic_grad_clip: float = 0.0,
               ppo: PPOConfig, grad_accum: int, temperature: float, kl_loss_coef: float,
               generator: Optional[torch.Generator] = None) -> dict[str, float]:
    """Run ``ppo.ppo_epochs`` passes over ``exp``; return averaged metrics."""
    cut = Batching.from_config(exp.size, ppo, grad_accum)
    stats: dict[str, list[float]] = defaultdict(list)
    spent = {"actor": 0.0, "critic": 0.0}
    actor.train()
    if critic is not None:
        critic.train()
    lengths = exp.attention_mask.sum(-1) if ppo.group_by_length else None
    for _ in range(ppo.ppo_epochs):
        order = torch.randperm(exp.size, generator=generator)
        for start in range(0, exp.size - cut.mini + 1, cut.mini):
            mini_idx = order[start:start + cut.mini]
            if lengths is not None:  # similar lengths share a micro-batch (stable: ties keep the shuffle)
                mini_idx = mini_idx[torch.sort(lengths[mini_idx.to(lengths.device)].cpu(), descending=True,
                                               stable=True).indices]
            weights = micro_weights(exp.response_mask, mini_idx, cut.micro, ppo.loss_agg)
            for mstart, weight in zip(range(0, cut.mini, cut.micro), weights):
                # Sharded gradients are reduced across ranks once per optimizer step, in the last
                # micro-batch's backward; the earlier ones accumulate locally.
                last = mstart + cut.micro >= cut.mini
                set_gradient_sync(actor, last)
                if critic is not None:
                    set_gradient_sync(critic, last)
                idx = mini_idx[mstart:mstart + cut.micro].to(exp.input_ids.device)
                mb = exp.select(idx)
                if ppo.trim_padding:
                    mb = mb.trimmed()
                t0 = time.perf_counter()
                actor_micro_loss(actor, mb, ppo, temperature, kl_loss_coef, weight, stats)
                t1 = time.perf_counter()
                if critic is not None:
                    critic_micro_loss(critic, mb, ppo, weight, stats)
                spent["actor"] += t1 - t0
                spent["critic"] += time.perf_counter() - t1
            t0 = time.perf_counter()
            stats["actor/grad_norm"].append(_clip_and_step(actor, actor_opt, actor_sched, actor_grad_clip))
            t1 = time.perf_counter()
            if critic is not None:
                stats["critic/grad_norm"].append(_clip_and_step(critic, critic_opt, critic_sched, critic_grad_clip))
            spent["actor"] += t1 - t0
            spent["critic"] += time.perf_counter() - t1
    out = {k: sum(v) / len(v) for k, v in stats.items() if v}
    out["actor/lr"] = float(actor_sched.get_last_lr()[0])
    out["actor/optimizer_steps"] = float(len(stats["actor/grad_norm"]))
    out["time/update_actor_s"] = spent["actor"]
    if critic is not None:
        out["time/update_critic_s"] = spent["critic"]
    return out
