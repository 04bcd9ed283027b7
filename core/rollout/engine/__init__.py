"""The in-process rollout engine: its own decoder forward, KV cache, compiled decode step and
continuous batching (:class:`RolloutEngine`, in :mod:`rlcore.rollout.engine.core`).

* :mod:`rlcore.rollout.engine.llama` — the decoder's weights and per-layer math;
* :mod:`rlcore.rollout.engine.decode` — prefill and the one-token decode step;
* :mod:`rlcore.rollout.engine.scheduler` — continuous batching over the engine's slots;
* :mod:`rlcore.rollout.engine.pages` — the paged KV cache's pool: free pages, reference counts, its size.
"""

from rlcore.rollout.engine.core import DEFAULT_BUCKETS, RolloutEngine, length_step

__all__ = ["DEFAULT_BUCKETS", "RolloutEngine", "length_step"]
