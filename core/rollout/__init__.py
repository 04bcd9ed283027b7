"""Rollout: turning prompts into sampled responses with their log-probabilities.

Backends (all satisfy :class:`~rlcore.rollout.base.RolloutBackend`):

* ``engine`` — :class:`~rlcore.rollout.engine.RolloutEngine`, paged KV cache, CUDA graphs and
  continuous batching for Llama/Mistral/Qwen2 decoders;
* ``hf`` — :class:`~rlcore.rollout.hf.HFGenerateBackend`, Hugging Face ``generate`` for any model.

:func:`make_backend` picks one by name; ``"auto"`` takes the engine when it supports the model.
"""

from __future__ import annotations

import logging

from rlcore.rollout.base import RolloutBackend, RolloutBatch, SamplingParams, left_pad, mask_after_eos

log = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "engine", "hf")

__all__ = ["BACKEND_KINDS", "RolloutBackend", "RolloutBatch", "SamplingParams", "left_pad", "make_backend",
           "mask_after_eos"]


def make_backend(model, kind: str = "auto", **kw) -> RolloutBackend:
    """Build the rollout backend ``kind`` for ``model``.

    Args:
        model: a Hugging Face causal LM.
        kind: ``"auto"`` (engine when :meth:`RolloutEngine.supports` the model, else HF
            ``generate``), ``"engine"`` or ``"hf"``.
        **kw: engine arguments (``max_batch_size``, ``max_seq_len``, ``dtype``, ``device``,
            ``use_cuda_graphs``, ...). The HF backend takes only ``device``; other keys are ignored
            for it so one call site can serve both.
    Raises:
        ValueError: unknown ``kind``, or ``"engine"`` for a model it cannot run.
    """
    from rlcore.rollout.engine import RolloutEngine
    from rlcore.rollout.hf import HFGenerateBackend

    if kind not in BACKEND_KINDS:
        raise ValueError(f"rollout backend {kind!r} is unknown; choose one of {', '.join(BACKEND_KINDS)}")
    name = type(model).__name__
    if kind == "auto":
        kind = "engine" if RolloutEngine.supports(model, kw.get("max_seq_len")) else "hf"
        log.info("rollout backend auto -> %s for %s", kind, name)
    if kind == "engine":
        if "max_batch_size" not in kw or "max_seq_len" not in kw:
            raise ValueError("rollout backend 'engine' needs max_batch_size and max_seq_len")
        return RolloutEngine(model, **kw)
    return HFGenerateBackend(model, device=kw.get("device"))
