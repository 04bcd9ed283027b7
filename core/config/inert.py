"""Which of the keys a user set have no effect in this run, and why. A run logs them once."""

from __future__ import annotations

from typing import Iterable

from omegaconf import DictConfig, OmegaConf

from rlcore.config.loader import SCHEMA_KEYS
from rlcore.config.schema import RLCoreConfig


def changed_keys(cfg: DictConfig) -> list[str]:
    """Dotted keys whose value differs from the schema default."""
    default = OmegaConf.structured(RLCoreConfig)
    out = []
    for key, free in SCHEMA_KEYS.items():
        node_default = OmegaConf.select(default, key)
        if isinstance(node_default, DictConfig) and not free:
            continue
        if OmegaConf.select(cfg, key) != node_default:
            out.append(key)
    return out


def inert_keys(cfg: DictConfig, world_size: int, ignore: Iterable[str] = ()) -> list[tuple[str, str]]:
    """``(key, reason)`` for every key set by the user that the core will not use; keys in ``ignore``
    (e.g. set by a preset, not by the user) are left out. Settings that only a plugin reads are that
    plugin's to report (in its ``rlcore_preflight``)."""
    ignore = set(ignore)
    rules = [
        ("fsdp.", world_size == 1, "a single process does not shard (start with torchrun or trainer.nproc_per_node)"),
        ("actor.fsdp.", world_size == 1, "a single process does not shard"),
        ("critic.fsdp.", world_size == 1, "a single process does not shard"),
        ("placement.", world_size == 1, "a single process holds every role"),
        ("critic.", cfg.algorithm.adv_estimator != "gae",
         f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains no critic"),
        ("reward_model.", not cfg.reward_model.enable, "reward_model.enable is false"),
        ("data.prefetch_factor", cfg.data.num_workers == 0, "data.num_workers is 0"),
        ("trainer.profile_steps", not cfg.trainer.enable_profiling, "trainer.enable_profiling is false"),
        ("data.shuffle_buffer", True, ""),  # the streaming plugin's: reported by the plugins
        ("data.cache_dir", bool(cfg.data.custom_cls.path),
         "data.custom_cls reads the files itself, without the tokenized cache"),
        ("ppo.kl_", cfg.ppo.kl_coeff == 0, "ppo.kl_coeff is 0"),
        ("ppo.cliprange_value", cfg.algorithm.adv_estimator != "gae", "no critic is trained"),
        ("ppo.vf_coef", cfg.algorithm.adv_estimator != "gae", "no critic is trained"),
        ("algorithm.lam", cfg.algorithm.adv_estimator != "gae", "GAE is not used"),
        ("algorithm.gamma", cfg.algorithm.adv_estimator != "gae", "GAE is not used"),
        ("algorithm.norm_adv_by_std", cfg.algorithm.adv_estimator != "grpo", "only GRPO uses it"),
        ("trainer.nproc_per_node", world_size > 1 and cfg.trainer.nproc_per_node != world_size,
         f"already running under a launcher with {world_size} processes"),
        ("trainer.gradient_accumulation_steps", cfg.ppo.micro_batch_size > 0, "ppo.micro_batch_size is set"),
        ("trainer.gradient_accumulation_steps", cfg.ppo.max_tokens_per_micro_batch > 0,
         "ppo.max_tokens_per_micro_batch cuts the micro-batches"),
        ("ppo.micro_batch_size", cfg.ppo.max_tokens_per_micro_batch > 0,
         "ppo.max_tokens_per_micro_batch cuts the micro-batches"),
        ("ppo.rollout_is_cap", cfg.ppo.rollout_is == "none", "ppo.rollout_is is none"),
        ("actor.compile_recompute_pointwise", cfg.actor.compile is False, "actor.compile is false"),
        ("critic.compile_recompute_pointwise", cfg.critic.compile is False, "critic.compile is false"),
        ("reward.stream", world_size > 1 or cfg.reward_model.enable,
         "rewards are scored after the rollout in distributed runs and with a reward model"),
    ]
    out = []
    for key in changed_keys(cfg):
        if key in ignore:
            continue
        for prefix, inert, why in rules:
            if inert and (key == prefix or key.startswith(prefix)) and key != "ppo.kl_coeff":
                if why:
                    out.append((key, why))
                break
    return out
