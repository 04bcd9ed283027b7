"""The default reshard policy: FSDP2 over all ranks for training, full weights for generation."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from rlcore.config.schema import FSDPConfig
from rlcore.protocols import DistInfo


class FSDPReshardPolicy:
    """Single process: the model is used as is. Several processes: ``fully_shard`` for training,
    ``unshard()`` while generating and ``reshard()`` after."""

    def __init__(self, fsdp: FSDPConfig, dist: DistInfo):
        self.fsdp = fsdp
        self.dist = dist
        self._stats: dict[str, float] = {}

    def prepare(self, model: torch.nn.Module, role: str) -> torch.nn.Module:
        if not self.dist.distributed:
            return model
        from rlcore.distributed.fsdp import apply_fsdp

        return apply_fsdp(model, self.fsdp, self.dist)

    @contextlib.contextmanager
    def generation(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        t0 = time.perf_counter()
        sharded = self.dist.distributed and hasattr(model, "unshard")
        if sharded:
            model.unshard()
        self._stats["reshard/to_gen_s"] = time.perf_counter() - t0
        try:
            yield model
        finally:
            t1 = time.perf_counter()
            if sharded:
                model.reshard()
            self._stats["reshard/to_train_s"] = time.perf_counter() - t1

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
