"""The ``remesh`` plugin: different shard layouts for generation and training (a 3-D hybrid engine).

Select it with ``plugins: [remesh]`` and turn it on with ``actor.remeshing.enabled: true``:

* training: FSDP2 shard groups of ``actor.remeshing.training_shard_size`` ranks, replicated across
  groups (HSDP);
* generation: tensor-parallel replicas of ``actor.remeshing.generation_shard_size`` ranks, built
  from the training shards by redistribution; prompts are split over the replicas.

The implementation is :class:`rlcore.distributed.remesh.RemeshPolicy`; ``docs/distributed.md``
explains the layouts and the cost of each switch.
"""

from __future__ import annotations

import logging

from rlcore.hookspecs import hookimpl

log = logging.getLogger(__name__)


@hookimpl
def rlcore_preflight(config):
    """Shard sizes against the world size, where it is known before any process starts."""
    remeshing = config["actor"]["remeshing"]
    if not remeshing["enabled"]:
        log.warning("plugin 'remesh' is selected but does nothing in this run: actor.remeshing.enabled is false")
        return
    from rlcore.distributed.init import known_world_size

    world = known_world_size(config["trainer"]["nproc_per_node"])
    if world is not None:
        from rlcore.config.schema import RemeshingConfig
        from rlcore.distributed.remesh import check_sizes

        check_sizes(RemeshingConfig(**remeshing), world)


@hookimpl
def rlcore_reshard_policy(fsdp, remeshing, dist):
    if not remeshing.enabled:
        return None
    from rlcore.distributed.remesh import RemeshPolicy

    return RemeshPolicy(fsdp, remeshing, dist)
