"""Rollout: turning prompts into sampled responses with their log-probabilities.

Backends satisfy :class:`~rlcore.rollout.base.RolloutBackend` and come from the factory hook
``rlcore_rollout_backend``. Two are built in:

* ``engine`` — :class:`~rlcore.rollout.engine.RolloutEngine` (the built-in ``engine`` plugin), paged
  KV cache, CUDA graphs and continuous batching for Llama/Mistral/Qwen2/Qwen3 decoders;
* ``hf`` — :class:`~rlcore.rollout.hf.HFGenerateBackend` (the ``defaults`` plugin), Hugging Face
  ``generate`` for any model.

:func:`make_backend` asks the hook for one by name outside a training run; ``"auto"`` takes the
engine when it supports the model.
"""

from __future__ import annotations

from typing import Any, Optional

from rlcore.rollout.base import RolloutBackend, RolloutBatch, SamplingParams, left_pad, mask_after_eos

#: The backends built in; a backend plugin adds its own name.
BACKEND_KINDS = ("auto", "engine", "hf")

__all__ = ["BACKEND_KINDS", "RolloutBackend", "RolloutBatch", "SamplingParams", "left_pad", "make_backend",
           "mask_after_eos"]


def make_backend(model, kind: str = "auto", *, max_batch_size: Optional[int] = None,
                 max_seq_len: Optional[int] = None, pm: Any = None, **engine: Any) -> RolloutBackend:
    """The rollout backend ``kind`` for ``model``, from the ``rlcore_rollout_backend`` hook.

    Args:
        model: a Hugging Face causal LM.
        kind: ``"auto"`` (engine when :meth:`RolloutEngine.supports` the model, else HF
            ``generate``), ``"engine"``, ``"hf"``, or a backend plugin's name (with ``pm``).
        max_batch_size, max_seq_len: the largest batch and sequence (the engine needs both).
        pm: the plugin manager to ask (default: the built-in plugins only).
        **engine: the engine's settings (``dtype``, ``device``, ``use_cuda_graphs``, ...); the HF
            backend reads only ``device``.
    Raises:
        ValueError: an unknown ``kind`` without ``pm``, or ``"engine"`` for a model it cannot run.
    """
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.protocols import DistInfo, RolloutRequest

    if pm is None and kind not in BACKEND_KINDS:
        raise ValueError(f"rollout backend {kind!r} is unknown; choose one of {', '.join(BACKEND_KINDS)}")
    pm = pm or build_plugin_manager()
    request = RolloutRequest(backend=kind, max_batch_size=max_batch_size, max_seq_len=max_seq_len, engine=engine)
    return pm.build("rlcore_rollout_backend", model=model, request=request, dist=DistInfo())
