"""CUDA graphs of the rollout engine's decode step (:class:`DecodeGraphs`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlcore.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)


class DecodeGraphs:
    """CUDA graphs of the decode step, one per (batch bucket, length bucket, prompt sharing on),
    captured on first use."""

    def __init__(self, engine: "RolloutEngine"):
        self.engine = engine
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def run(self, n: int, length: int) -> torch.Tensor:
        key = (n, length, self.engine.state.share_active)
        if key not in self.graphs:
            try:
                start = time.perf_counter()
                self.graphs[key] = self._capture(n, length)
                self.engine.counters["graph_captures"] += 1
                self.engine.counters["graph_capture_s"] += time.perf_counter() - start
            except RuntimeError as error:  # capture refused (driver, allocator): run eagerly instead
                log.warning("rollout engine: CUDA graph capture failed (%s); decoding without graphs", error)
                self.engine._graphs = None
                self.engine.use_cuda_graphs = False
                return self.engine._decode_eager(n, length)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _capture(self, n: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        eng = self.engine
        st = eng.state
        saved = (st.positions[:n].clone(), st.cache_index[:n].clone(), st.bias[:n].clone())
        # warm-up steps write keys/values at the slots' current columns (overwritten by the real step)
        side = torch.cuda.Stream(device=eng.device)
        side.wait_stream(torch.cuda.current_stream(eng.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: compilation, cuBLAS handles and workspaces
                eng._decode_eager(n, length)
        torch.cuda.current_stream(eng.device).wait_stream(side)
        st.positions[:n].copy_(saved[0])
        st.cache_index[:n].copy_(saved[1])
        st.bias[:n].copy_(saved[2])
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: work another thread launches meanwhile (the overlapped update, rlcore.trainer.overlap)
        # neither breaks the capture nor is captured; only this thread's unsafe calls are refused
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = eng._decode_eager(n, length)
        log.debug("rollout engine: captured decode graph for batch bucket %d, length %d", n, length)
        return graph, logits

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None
