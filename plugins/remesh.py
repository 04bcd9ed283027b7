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

from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_reshard_policy(fsdp, remeshing, dist):
    if not remeshing.enabled:
        return None
    from rlcore.distributed.remesh import RemeshPolicy

    return RemeshPolicy(fsdp, remeshing, dist)
