"""The built-in default plugin: one answer for every factory hook, used when no selected plugin answers.

- dataset provider: map-style parquet/jsonl with an Arrow cache (or the demo task when no files are given),
  or the user class of ``data.custom_cls``;
- placement: every role colocated on the local device;
- reshard: FSDP2 over all ranks for training, full weights for generation;
- reward: Python function rewards (and a Hugging Face reward model where ``reward_model.enable``);
- checkpoint: every ``trainer.save_steps``, keep the last N, atomic, resumable;
- rollout backend: Hugging Face ``generate`` for ``actor.rollout_backend`` ``auto`` or ``hf`` and for every
  tensor-parallel replica (the built-in ``engine`` plugin answers first for the models it supports);
- metrics: one console line per logged step;
- environments: ``python`` (a sandboxed Python tool), ``guess`` (a number-guessing game), ``demo_lookup``
  (the demo's tool task); tool-call parser ``hermes``.
"""

from __future__ import annotations

import logging

from rlcore.hookspecs import hookimpl

log = logging.getLogger(__name__)


@hookimpl
def rlcore_preflight(config, plugins):
    """What the default components cannot do: offload a reward model, remesh the actor."""
    from rlcore.errors import PlacementError, PluginError
    from rlcore.rewards.backend import OFFLOAD_NEEDS_PLUGIN

    rm, remeshing = config["reward_model"], config["actor"]["remeshing"]
    if rm["enable"] and rm["offload"] and "rm-offload" not in plugins:
        raise PlacementError(OFFLOAD_NEEDS_PLUGIN)
    if remeshing["enabled"] and "remesh" not in plugins:
        raise PluginError("actor.remeshing.enabled=true needs the 'remesh' plugin: add --plugins remesh "
                          "(or plugins: [remesh] in the config)")
    for key, why in inert_keys(config, plugins):
        log.warning("config key '%s' has no effect in this run: %s", key, why)


def inert_keys(config, plugins):
    """``(key, why)`` for settings only a plugin that is not selected reads."""
    from rlcore.config.schema import DataConfig, RemeshingConfig

    out = []
    if "remesh" not in plugins and config["actor"]["remeshing"] != _as_dict(RemeshingConfig()):
        out.append(("actor.remeshing", "the 'remesh' plugin is not selected"))
    if "streaming" not in plugins and config["data"]["shuffle_buffer"] != DataConfig().shuffle_buffer:
        out.append(("data.shuffle_buffer", "only the 'streaming' plugin uses it"))
    return out


def _as_dict(obj):
    import dataclasses

    return dataclasses.asdict(obj)


@hookimpl
def rlcore_register_rewards(register):
    from rlcore.rewards.rules import BUILTIN_REWARDS

    for name, fn in BUILTIN_REWARDS.items():
        register(name, fn)


@hookimpl
def rlcore_environment(register):
    from rlcore.demo import LookupEnv
    from rlcore.envs.builtin import BUILTIN_ENVIRONMENTS

    for name, factory in BUILTIN_ENVIRONMENTS.items():
        register(name, factory)
    register("demo_lookup", LookupEnv)


@hookimpl
def rlcore_tool_parser(register):
    from rlcore.envs.tools import BUILTIN_PARSERS

    for name, parser in BUILTIN_PARSERS.items():
        register(name, parser)


@hookimpl
def rlcore_dataset_provider(config, tokenizer, split, dist):
    from rlcore.data.provider import build_dataset

    return build_dataset(config, tokenizer, split, dist)


@hookimpl
def rlcore_placement_policy(request, dist):
    from rlcore.distributed.placement import ColocatedPlacement

    return ColocatedPlacement(request, dist)


@hookimpl
def rlcore_reshard_policy(fsdp, remeshing, dist):
    from rlcore.distributed.reshard import FSDPReshardPolicy

    return FSDPReshardPolicy(fsdp, dist)


@hookimpl
def rlcore_reward_backend(reward_model, reward_function, reward, placement, tokenizer, rewards):
    from rlcore.rewards.backend import build_reward_backend

    return build_reward_backend(reward_model, reward_function, reward, placement, tokenizer, rewards)


@hookimpl
def rlcore_checkpoint_policy(trainer, dist):
    from rlcore.trainer.checkpoint import DefaultCheckpointPolicy

    return DefaultCheckpointPolicy(trainer, dist)


@hookimpl
def rlcore_world_split(world_size, config):
    from rlcore.trainer.sources import WholeWorld

    return WholeWorld()


@hookimpl
def rlcore_rollout_backend(model, request):
    if request.backend not in ("auto", "hf") and not request.tensor_parallel:
        return None
    from rlcore.rollout.hf import HFGenerateBackend

    return HFGenerateBackend(model, device=request.engine.get("device"))


@hookimpl
def rlcore_metrics(step, metrics, split):
    from rlcore.observe.console import print_metrics

    print_metrics(step, metrics, split)
