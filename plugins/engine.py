"""``engine`` (built in, always registered): the in-process rollout engine as a rollout backend.

It answers ``rlcore_rollout_backend`` for ``actor.rollout_backend`` ``engine``, and for ``auto`` when
:meth:`~rlcore.rollout.engine.RolloutEngine.supports` the model (Llama, Mistral and Qwen2 decoders
that fit ``max_seq_len``); it passes for tensor-parallel replicas, which Hugging Face ``generate``
(the ``defaults`` plugin) runs. ``actor.rollout_engine`` holds its settings.
"""

from __future__ import annotations

import logging

from rlcore.hookspecs import hookimpl

log = logging.getLogger(__name__)


@hookimpl
def rlcore_rollout_backend(model, request):
    if request.tensor_parallel or request.backend not in ("auto", "engine"):
        return None
    from rlcore.rollout.engine import RolloutEngine

    if request.backend == "auto":
        if not RolloutEngine.supports(model, request.max_seq_len):
            log.info("rollout backend auto -> hf for %s (the engine does not support it)", type(model).__name__)
            return None
        log.info("rollout backend auto -> engine for %s", type(model).__name__)
    if request.max_batch_size is None or request.max_seq_len is None:
        raise ValueError("rollout backend 'engine' needs max_batch_size and max_seq_len")
    settings = {**dict(request.engine), "max_batch_size": request.max_batch_size, "max_seq_len": request.max_seq_len}
    settings.setdefault("kv_reserve_bytes", int(request.memory_reserve_bytes))
    return RolloutEngine(model, **settings)
