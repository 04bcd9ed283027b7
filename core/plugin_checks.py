"""Start-up checks of the selected plugins that need no model: their settings, the rollout backend
name, and two selected plugins answering the same factory hook.

The checks ask the plugins; none names a plugin of its own.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from rlcore.errors import PluginError
from rlcore.hookspecs import FACTORY_HOOKS

log = logging.getLogger(__name__)

#: ``actor.rollout_backend`` values the built-in plugins answer to.
BUILTIN_ROLLOUT_BACKENDS = ("auto", "engine", "hf")


def check_settings(pm: Any, cfg: DictConfig) -> None:
    """``plugin_config.<name>`` of every registered plugin against the schema it declares."""
    pm.configure(OmegaConf.to_container(cfg.plugin_config, resolve=True))


def check_rollout_backend(pm: Any, cfg: DictConfig) -> None:
    """A rollout backend name that no built-in plugin answers needs a selected plugin implementing
    ``rlcore_rollout_backend``."""
    name = str(cfg.actor.rollout_backend)
    if name in BUILTIN_ROLLOUT_BACKENDS:
        return
    providers = [n for n in pm.selected_names if _implements(pm, n, "rlcore_rollout_backend")]
    if not providers:
        raise PluginError(f"actor.rollout_backend={name!r}: no selected plugin builds rollout backends "
                          f"(rlcore_rollout_backend); the built-in ones are {', '.join(BUILTIN_ROLLOUT_BACKENDS)}, "
                          "or select the plugin that provides it with --plugins")


def check_conflicts(pm: Any, cfg: DictConfig, world_size: int,
                    tokenizer: Optional[Callable[[], Any]] = None) -> None:
    """Build, as ``rlcore train`` would, every factory hook that two or more selected plugins
    implement and that the trainer calls before a model loads; two answers are the
    :class:`PluginError` that ``train`` would raise. Hooks with at most one selected implementation
    cost nothing. The rollout backend needs the model: two plugins answering it are found when the
    model has loaded.

    :param tokenizer: loads the actor's tokenizer (the dataset and reward hooks receive it).
    """
    from rlcore.protocols import DistInfo

    dist = DistInfo(world_size=max(1, world_size))
    contested = [h for h in FACTORY_HOOKS if h != "rlcore_rollout_backend"
                 and sum(_implements(pm, n, h) for n in pm.selected_names) > 1]
    if not contested:
        return
    args = _factory_args(pm, cfg, dist, tokenizer)
    for hook in contested:
        for kwargs in args[hook]():
            pm.selected_answers(hook, **kwargs)


def provides_data(pm: Any) -> bool:
    """Whether a selected plugin implements ``rlcore_dataset_provider``."""
    return any(_implements(pm, n, "rlcore_dataset_provider") for n in pm.selected_names)


def _implements(pm: Any, name: str, hook: str) -> bool:
    plugin = pm.get_plugin(name)
    return any(impl.plugin is plugin for impl in getattr(pm.hook, hook).get_hookimpls())


def _factory_args(pm: Any, cfg: DictConfig, dist: Any, tokenizer: Optional[Callable[[], Any]]) -> dict:
    """Per factory hook, a function giving the keyword arguments of each call ``train`` makes."""
    from rlcore.config.schema import resolve_fsdp, trains_critic
    from rlcore.distributed.placement import requested_devices
    from rlcore.protocols import PlacementRequest

    def obj(node: Any) -> Any:
        return OmegaConf.to_object(node)

    def placement_args() -> list[dict]:
        devices = requested_devices(obj(cfg.actor), obj(cfg.critic), obj(cfg.reward_model),
                                    trains_critic(cfg.algorithm.adv_estimator))
        request = PlacementRequest(**devices, reward_offload=bool(cfg.reward_model.offload),
                                   rank_groups={r: list(g) for r, g in cfg.placement.rank_groups.items()})
        return [dict(request=request, dist=dist)]

    def tok() -> Any:
        return tokenizer() if tokenizer is not None else None

    def dataset_args() -> list[dict]:
        data = obj(cfg.data)
        splits = ["train"] + (["val"] if data.val_files or not data.train_files else [])  # as train asks
        return [dict(config=data, tokenizer=tok(), split=split, dist=dist) for split in splits]

    def reward_args() -> list[dict]:
        placement = pm.build("rlcore_placement_policy", **placement_args()[0])
        rewards: dict[str, Any] = {}
        pm.hook.rlcore_register_rewards(register=lambda name, fn: rewards.__setitem__(name, fn))
        return [dict(reward_model=obj(cfg.reward_model), reward_function=obj(cfg.custom_reward_function),
                     reward=obj(cfg.reward), placement=placement, tokenizer=tok(), rewards=rewards,
                     run_dir=cfg.trainer.output_dir)]

    return {
        "rlcore_placement_policy": placement_args,
        "rlcore_dataset_provider": dataset_args,
        "rlcore_reward_backend": reward_args,
        "rlcore_checkpoint_policy": lambda: [dict(trainer=obj(cfg.trainer), dist=dist)],
        "rlcore_world_split": lambda: [dict(world_size=dist.world_size, config=OmegaConf.to_container(cfg, resolve=True))],
        "rlcore_reshard_policy": lambda: [dict(fsdp=resolve_fsdp(obj(cfg.fsdp), obj(cfg.actor.fsdp)),
                                               remeshing=obj(cfg.actor.remeshing), dist=dist)],
    }
