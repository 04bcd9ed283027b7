"""The default reshard policy: FSDP2 over all ranks for training, full weights for generation.

How the trainer uses a reshard policy (the default one and ``remesh`` alike)::

    model = policy.prepare(model, "actor")                # training layout
    with policy.generation(model) as gen_module:          # generation layout
        backend = ...                                      # the rollout backend of ``gen_module``
        share = policy.generation_share(prompts, params)   # what this rank generates
        batch = backend.generate(share.prompts, share.params)
        mine = share.own(batch)                            # this rank's rows
    metrics.update(policy.stats())                         # reshard/to_gen_s, reshard/to_train_s, ...

``generation_share`` decides which prompts each rank generates and which rows of the result are
this rank's own (see :class:`rlcore.protocols.GenerationShare`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Optional, Sequence

import torch

from rlcore.config.schema import FSDPConfig
from rlcore.observe import peak
from rlcore.protocols import DistInfo, GenerationShare
from rlcore.rollout.base import SamplingParams

log = logging.getLogger(__name__)


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
        t0 = time.perf_counter()
        with peak.window(self.device) as measured:  # the switch's own peak; the run's peak is kept
            try:
                yield
            finally:
                self._sync()
        self.values[f"reshard/{name}_s"] = time.perf_counter() - t0
        if measured.peak is not None:
            self.values[f"reshard/{name}_peak_gb"] = measured.peak / 2**30
        log.debug("reshard %s: %.4f s", name, self.values[f"reshard/{name}_s"])


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


class FSDPReshardPolicy:
    """Single process: the model is used as is. Several processes: ``fully_shard`` (per
    ``fsdp.sharding_strategy``) for training; for generation every FSDP unit is gathered once,
    kept gathered through the whole rollout, and sharded again on exit.

    Every rank generates its own prompts on the full weights.
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

    def generation_share(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationShare:
        """Every rank generates its own prompts."""
        return GenerationShare(prompts, params)

    def stats(self) -> dict[str, float]:
        """``reshard/to_gen_s`` and ``reshard/to_train_s`` of the last switch (plus ``*_peak_gb`` on CUDA)."""
        return {k: v for k, v in self._timer.values.items() if not k.startswith("reshard/prepare_")}
