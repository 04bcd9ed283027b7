"""The sections of ``rlcore convert-config`` (:mod:`rlcore.convert`) that carry the optimizer, micro-batch,
memory and validation knobs, and the summary of what was left unmapped, grouped by reason.

Each ``verl_*`` function takes the shared :class:`rlcore.convert._Source` of a verl conversion;
:func:`trl_optimizer` takes a TRL conversion's flat config and recorders.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

#: Lines of the grouped summary :func:`unmapped_summary` prints at most (the full list is in the file's header).
SUMMARY_LINES = 20
_ROLES = (("actor", "actor_rollout_ref.actor."), ("critic", "critic."))
_HF_COSINE = 0.5  # the number of cosine waves of transformers' cosine schedules (and verl's default)


def unused(s: Any, src: str, why: str) -> None:
    """``src`` has an effect only with a switch that is off in the source: nothing to carry."""
    if src in s.flat and src not in s.handled:
        s.handled.add(src)
        s.conv.mapped[src] = f"(unused in the source: {why})"


def verl_optimizer(s: Any) -> None:
    """AdamW's betas and eps, gradient clipping (``optim.clip_grad``), the cosine schedule's floor
    (``min_lr_ratio``) and waves (``num_cycles``), the critic's warmup, per role."""
    get, take, drop = s.get, s.take, s.drop
    for role, prefix in _ROLES:
        opt = prefix + "optim."
        clip, old = get(opt + "clip_grad"), get(prefix + "grad_clip")
        if clip is not None:  # verl's current key; the older <role>.grad_clip is read only without it
            take(opt + "clip_grad", f"{role}.grad_clip", float(clip))
            if prefix + "grad_clip" in s.flat:
                s.handled.add(prefix + "grad_clip")
                s.conv.mapped[prefix + "grad_clip"] = f"(superseded by optim.clip_grad: {role}.grad_clip)"
                if old is not None and float(old) != float(clip):
                    s.conv.notes.append(f"{prefix}grad_clip={old} and {opt}clip_grad={clip} differ: "
                                        f"{role}.grad_clip takes optim.clip_grad")
        if get(opt + "betas") is not None:
            take(opt + "betas", f"{role}.betas", [float(b) for b in get(opt + "betas")])
        if get(opt + "eps") is not None:
            take(opt + "eps", f"{role}.eps", float(get(opt + "eps")))
        name = get(opt + "optimizer")
        if name is not None:
            if str(name).lower() == "adamw":
                s.handled.add(opt + "optimizer")
                s.conv.mapped[opt + "optimizer"] = "(AdamW: rlcore's optimizer)"
            else:
                drop(opt + "optimizer", f"optimizer {name!r}: rlcore trains with AdamW")
        unused(s, opt + "total_training_steps", "verl fills it in from the run's steps; rlcore counts trainer.max_steps")
        _cosine(s, role, opt)
        warm = get(opt + "lr_warmup_steps")
        if role == "critic" and warm is not None and int(warm) >= 0:
            take(opt + "lr_warmup_steps", "critic.warmup_steps", int(warm))


def _cosine(s: Any, role: str, opt: str) -> None:
    """``min_lr_ratio`` > 0 with a cosine schedule is transformers' ``cosine_with_min_lr`` (``min_lr_rate``);
    ``num_cycles`` other than 0.5 goes to the schedule's keyword arguments."""
    sched = s.conv.values.get(f"{role}.lr_scheduler")
    ratio, cycles = s.get(opt + "min_lr_ratio"), s.get(opt + "num_cycles")
    if sched != "cosine":
        for key in (opt + "min_lr_ratio", opt + "num_cycles"):
            unused(s, key, f"the {sched or 'constant'} schedule has no cosine floor or waves")
        return
    kwargs = dict(s.conv.values.get(f"{role}.lr_scheduler_kwargs") or {})
    if ratio is not None and float(ratio) > 0:
        s.take(opt + "min_lr_ratio", f"{role}.lr_scheduler", "cosine_with_min_lr")
        kwargs["min_lr_rate"] = float(ratio)
    elif ratio is not None:
        s.handled.add(opt + "min_lr_ratio")
        s.conv.mapped[opt + "min_lr_ratio"] = f"(0: {role}.lr_scheduler cosine decays to zero)"
    if cycles is not None and float(cycles) != _HF_COSINE:
        kwargs["num_cycles"] = float(cycles)
        s.handled.add(opt + "num_cycles")
        s.conv.mapped[opt + "num_cycles"] = f"{role}.lr_scheduler_kwargs"
    elif cycles is not None:
        s.handled.add(opt + "num_cycles")
        s.conv.mapped[opt + "num_cycles"] = f"(0.5: the default of {role}.lr_scheduler cosine)"
    if kwargs:
        s.conv.values[f"{role}.lr_scheduler_kwargs"] = kwargs


#: verl's token budgets of the log-prob and value passes; rlcore cuts them by ``ppo.max_tokens_per_micro_batch``.
_TOKEN_BUDGETS = ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                  "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                  "critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu",
                  "reward_model.forward_max_token_len_per_gpu")
_DYNAMIC_SWITCHES = ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                     "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "critic.use_dynamic_bsz",
                     "reward_model.use_dynamic_bsz")


def _int(value: Any) -> Any:
    """``value`` as an int, or None (null, or an interpolation left unresolved)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def verl_micro_batches(s: Any) -> None:
    """``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``: micro-batches cut by a token budget,
    ``ppo.max_tokens_per_micro_batch`` (rlcore cuts the log-prob and value passes by the same one);
    ``use_remove_padding``: rlcore trims padding exactly (``ppo.trim_padding``)."""
    get, take, drop = s.get, s.take, s.drop
    switch, budget = "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    on = bool(get(switch))
    if on and _int(get(budget)) is not None:
        take(budget, "ppo.max_tokens_per_micro_batch", _int(get(budget)))
        take(switch, "ppo.max_tokens_per_micro_batch", _int(get(budget)))
        if "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in s.flat:
            unused(s, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "use_dynamic_bsz cuts by tokens")
            s.conv.values.pop("ppo.micro_batch_size", None)
    elif switch in s.flat:
        s.handled.add(switch)
        s.conv.mapped[switch] = "(off: ppo.max_tokens_per_micro_batch 0, micro-batches of samples)"
        unused(s, budget, "use_dynamic_bsz is off")
    for key in _DYNAMIC_SWITCHES:
        if key in s.flat and bool(get(key)) == on:
            s.handled.add(key)
            s.conv.mapped[key] = "(as the actor's: ppo.max_tokens_per_micro_batch)"
    for key in _TOKEN_BUDGETS:
        if key not in s.flat or key in s.handled:
            continue
        if not on:
            unused(s, key, "use_dynamic_bsz is off")
        elif _int(get(key)) is not None and _int(get(key)) == _int(get(budget)):
            s.handled.add(key)
            s.conv.mapped[key] = "(as the actor's: ppo.max_tokens_per_micro_batch)"
        else:
            drop(key, "rlcore cuts every pass by one token budget, ppo.max_tokens_per_micro_batch (from "
                      "ppo_max_token_len_per_gpu)")
    for key in ("actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.use_remove_padding",
                "critic.model.use_remove_padding", "reward_model.model.use_remove_padding"):
        if key in s.flat and key not in s.handled:
            s.handled.add(key)
            s.conv.mapped[key] = "(ppo.trim_padding: rlcore removes padding exactly, on by default)"


def verl_rollout(s: Any) -> None:
    """The rollout server's memory share, and validation sampling (``rollout.val_kwargs`` -> ``eval``)."""
    get, take = s.get, s.take
    share = "actor_rollout_ref.rollout.gpu_memory_utilization"
    if get(share) is not None and get("actor_rollout_ref.rollout.name") != "hf" and 0 < float(get(share)) <= 1:
        take(share, "actor.rollout_engine.kv_memory_fraction", float(get(share)))
        s.conv.notes.append(f"{share}={get(share)} became actor.rollout_engine.kv_memory_fraction: rlcore's share is "
                            "of the memory free when the engine starts, for its paged KV cache alone")
    val = "actor_rollout_ref.rollout.val_kwargs."
    if get(val + "do_sample") is False:
        take(val + "do_sample", "eval.temperature", 0.0)
        unused(s, val + "temperature", "val_kwargs.do_sample is off")
    elif get(val + "temperature") is not None:
        take(val + "temperature", "eval.temperature", float(get(val + "temperature")))
        if val + "do_sample" in s.flat:
            s.handled.add(val + "do_sample")
            s.conv.mapped[val + "do_sample"] = "(sampling: eval.temperature)"
    for key, target, convert in (("n", "eval.n", int), ("top_p", "eval.top_p", float),
                                 ("top_k", "eval.top_k", lambda k: max(0, int(k)))):
        if get(val + key) is not None:
            take(val + key, target, convert(get(val + key)))


def verl_critic_loss(s: Any) -> None:
    """``critic.loss_agg_mode``: rlcore's value loss is a token mean."""
    key = "critic.loss_agg_mode"
    mode = s.get(key)
    if mode is None:
        return
    if mode == "token-mean":
        s.handled.add(key)
        s.conv.mapped[key] = "(token-mean: rlcore's value loss)"
    else:
        s.drop(key, f"rlcore's value loss is a token mean; {mode!r} has no counterpart")


def trl_optimizer(conv: Any, flat: dict[str, Any], take: Callable, handled: set[str]) -> None:
    """TRL's AdamW betas and epsilon, the schedule's keyword arguments, and ``warmup_ratio`` with ``max_steps``."""
    if flat.get("adam_beta1") is not None or flat.get("adam_beta2") is not None:
        betas = [float(flat.get("adam_beta1", 0.9)), float(flat.get("adam_beta2", 0.999))]
        for key in ("adam_beta1", "adam_beta2"):
            if key in flat:
                take(key, "actor.betas", betas)
    if flat.get("adam_epsilon") is not None:
        take("adam_epsilon", "actor.eps", float(flat["adam_epsilon"]))
    prefix = "lr_scheduler_kwargs."  # a mapping (flattened into its keys, or kept whole when empty)
    kwargs = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    for key in [k for k in flat if k.startswith(prefix)] or (["lr_scheduler_kwargs"] if "lr_scheduler_kwargs" in flat
                                                             and isinstance(flat["lr_scheduler_kwargs"], dict) else []):
        take(key, "actor.lr_scheduler_kwargs", kwargs)
    ratio, steps = flat.get("warmup_ratio"), flat.get("max_steps")
    if ratio and not flat.get("warmup_steps") and steps is not None and int(steps) > 0:
        take("warmup_ratio", "actor.warmup_steps", int(float(ratio) * int(steps)))
        if "warmup_steps" in flat:
            handled.add("warmup_steps")
            conv.mapped["warmup_steps"] = "(0: warmup_ratio x max_steps is used)"
    elif "warmup_ratio" in flat and not ratio:
        handled.add("warmup_ratio")
        conv.mapped["warmup_ratio"] = "(0: actor.warmup_steps)"


#: Why a verl key has no counterpart, by where it is: (prefixes or ``.name`` endings, reason), first match wins.
VERL_REASONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("._target_", "_target_"), "the Python class verl builds the section with (_target_)"),
    (("actor_rollout_ref.actor.profiler.", "critic.profiler.", "global_profiler."),
     "verl's profiler: rlcore profiles with trainer.enable_profiling (docs/observability.md)"),
    (("actor_rollout_ref.actor.policy_loss.clip_cov", "actor_rollout_ref.actor.policy_loss.kl_cov",
      "actor_rollout_ref.actor.policy_loss.ppo_kl_coef"), "a parameter of a verl policy loss rlcore does not have"),
    (("actor_rollout_ref.model.", "critic.model.", "reward_model.model."),
     "a model-loading option of verl (fused kernels, Liger, shared memory, remote code, chat template)"),
    (("data.",), "a dataset option of verl (multimodal keys, raw chat, samplers): rlcore's data section (docs/data.md)"),
    (("algorithm.pf_ppo", "algorithm.use_pf_ppo"), "verl's prioritized-replay reweighting: no rlcore counterpart"),
    (("actor_rollout_ref.actor.ulysses", "actor_rollout_ref.ref.ulysses", "critic.ulysses",
      "actor_rollout_ref.actor.strategy", "critic.strategy", "reward_model.strategy", "actor_rollout_ref.hybrid_engine",
      "actor_rollout_ref.nccl_timeout", "reward_model.n_gpus_per_node", "reward_model.nnodes",
      "reward_model.enable_resource_pool"),
     "worker layout of verl (strategy, sequence parallelism, resource pools): rlcore places roles with placement"),
)


def verl_reason(key: str) -> str | None:
    """The reason :data:`VERL_REASONS` gives for ``key``, or None."""
    for patterns, reason in VERL_REASONS:
        if any(key.startswith(p) or (p.startswith(".") and key.endswith(p)) or key == p for p in patterns):
            return reason
    return None


def unmapped_summary(unmapped: dict[str, tuple[Any, str]], limit: int = SUMMARY_LINES) -> list[str]:
    """The unmapped keys grouped by reason, largest group first, in at most ``limit`` lines (each with
    its count and an example key)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key, (_, reason) in unmapped.items():
        groups[reason].append(key)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    shown = ordered if len(ordered) <= limit else ordered[:limit - 1]
    lines = []
    for reason, keys in shown:
        keys.sort()
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys, e.g. {keys[0]}"
        line = f"  {what}: {reason}"
        lines.append(line if len(line) <= 160 else line[:157] + "...")
    if len(shown) < len(ordered):
        rest = ordered[len(shown):]
        lines.append(f"  ... and {sum(len(keys) for _, keys in rest)} more key(s) for {len(rest)} other reason(s)")
    return lines
