"""The default reshard policy: FSDP2 over all ranks for training, full weights for generation.

How the trainer uses a reshard policy (the default one and ``remesh`` alike)::

    model = policy.prepare(model, "actor")                # training layout
    with policy.generation(model) as gen_module:          # generation layout
        # build/refresh the rollout backend for ``gen_module`` here (see docs/distributed.md)
        batch = policy.generate_distributed(generate_fn, prompts, params)
    metrics.update(policy.stats())                         # reshard/to_gen_s, reshard/to_train_s, ...

``generate_fn(prompts, params) -> RolloutBatch`` generates on this rank; ``generate_distributed``
decides which prompts each rank generates and hands every rank the results of its own prompts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from rlcore.config.schema import FSDPConfig
from rlcore.protocols import DistInfo
from rlcore.rollout.base import RolloutBatch, SamplingParams

log = logging.getLogger(__name__)

GenerateFn = Callable[[Sequence[Sequence[int]], SamplingParams], RolloutBatch]


class SwitchTimer:
    """Wall time (device-synchronised) and peak device memory of layout switches, for ``stats()``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.values: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.values[f"reshard/{name}_s"] = time.perf_counter() - t0
            if self.device.type == "cuda":
                self.values[f"reshard/{name}_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            log.debug("reshard %s: %.4f s", name, self.values[f"reshard/{name}_s"])


def slice_rollout(batch: RolloutBatch, start: int, stop: int) -> RolloutBatch:
    """Rows ``[start, stop)`` of ``batch``, without the padding columns no kept row needs.

    Shapes: ``[B, P]``/``[B, R]`` -> ``[stop - start, P']``/``[stop - start, R']``.
    """
    pm, rm = batch.prompt_mask[start:stop], batch.response_mask[start:stop]
    used = pm.bool().any(0).nonzero()
    p0 = int(used[0]) if len(used) else pm.shape[1] - 1
    used = rm.bool().any(0).nonzero()
    r1 = int(used[-1]) + 1 if len(used) else 1
    return RolloutBatch(prompt_ids=batch.prompt_ids[start:stop, p0:], prompt_mask=pm[:, p0:],
                        response_ids=batch.response_ids[start:stop, :r1], response_mask=rm[:, :r1],
                        logprobs=batch.logprobs[start:stop, :r1], stats=dict(batch.stats))


@contextlib.contextmanager
def gathered(model: torch.nn.Module, timer: SwitchTimer, reshard_after_forward: bool) -> Iterator[torch.nn.Module]:
    """``model`` with every FSDP unit's weights gathered (timed as ``to_gen``), sharded again on exit
    (timed as ``to_train``). A model without FSDP units is yielded as is."""
    from rlcore.distributed.fsdp import fsdp_modules, gather_units, release_units

    units = fsdp_modules(model)
    if not units:
        yield model
        return
    with timer.measure("to_gen"):
        gather_units(units)
    try:
        yield model
    finally:
        with timer.measure("to_train"):
            release_units(units, reshard_after_forward)


def has_dtensor_params(module: torch.nn.Module) -> bool:
    """True when some parameter of ``module`` is a DTensor (a sharded or tensor-parallel layout)."""
    return any(type(p).__name__ == "DTensor" or hasattr(p, "device_mesh") for p in module.parameters())


class GenerationBackends:
    """Rollout backends keyed by the module a policy's ``generation()`` yields.

    Call :meth:`get` inside ``generation()``: the first call for a module builds its backend there
    (so an engine copies or references the gathered weights, never the shards); later calls refresh
    it with ``sync_weights()``. A module with DTensor weights (a tensor-parallel replica) gets the
    Hugging Face ``generate`` backend, which runs DTensor layers as they are.

    :param make_backend: ``make_backend(module, kind) -> RolloutBackend`` with ``kind`` the
        configured ``actor.rollout_backend`` or ``"hf"``.
    :param kind: the configured backend kind.
    :param prebuilt: ``{id(module): backend}`` already built for the training module (single process).
    """

    def __init__(self, make_backend: Callable[[torch.nn.Module, str], object], kind: str = "auto",
                 prebuilt: dict[int, object] | None = None):
        self.make_backend, self.kind = make_backend, kind
        self._backends: dict[int, object] = dict(prebuilt or {})
        self._fresh: set[int] = set(self._backends)

    def get(self, module: torch.nn.Module):
        key = id(module)
        if key not in self._backends:
            kind = "hf" if has_dtensor_params(module) else self.kind
            self._backends[key] = self.make_backend(module, kind)
        elif key in self._fresh:
            self._fresh.discard(key)
        else:
            self._backends[key].sync_weights()
        return self._backends[key]


class FSDPReshardPolicy:
    """Single process: the model is used as is. Several processes: ``fully_shard`` (per
    ``fsdp.sharding_strategy``) for training; for generation every FSDP unit is gathered once,
    kept gathered through the whole rollout, and sharded again on exit.

    Every rank generates its own prompts on the full weights (``generate_distributed`` is a plain call).
    """

    def __init__(self, fsdp: FSDPConfig, dist: DistInfo):
        from rlcore.distributed.fsdp import RESHARD_AFTER_FORWARD, check_fsdp_config

        check_fsdp_config(fsdp)
        self.fsdp = fsdp
        self.dist = dist
        self.reshard_after_forward = RESHARD_AFTER_FORWARD[fsdp.sharding_strategy]
        self._timer = SwitchTimer(dist.device)

    def prepare(self, model: torch.nn.Module, role: str, fsdp: Optional[FSDPConfig] = None) -> torch.nn.Module:
        """Shard ``model`` over all ranks with ``fsdp`` (default: the policy's settings); unchanged in a
        single process."""
        if not self.dist.distributed:
            return model
        from rlcore.distributed.fsdp import apply_fsdp

        with self._timer.measure(f"prepare_{role}"):
            return apply_fsdp(model, fsdp or self.fsdp, self.dist)

    @contextlib.contextmanager
    def generation(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Yield ``model`` with every weight gathered; shard again on exit."""
        if not self.dist.distributed:
            yield model
            return
        with gathered(model, self._timer, self.reshard_after_forward) as full:
            yield full

    def generate_distributed(self, generate_fn: GenerateFn, prompts: Sequence[Sequence[int]],
                             params: SamplingParams) -> RolloutBatch:
        """Every rank generates its own prompts: ``generate_fn(prompts, params)``."""
        return generate_fn(prompts, params)

    def stats(self) -> dict[str, float]:
        """``reshard/to_gen_s`` and ``reshard/to_train_s`` of the last switch (plus ``*_peak_gb`` on CUDA)."""
        return {k: v for k, v in self._timer.values.items() if not k.startswith("reshard/prepare_")}
