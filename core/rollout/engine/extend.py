"""CUDA graphs of the multi-turn extend: an observation's tokens appended to live sequences without
launching the forward's kernels one by one.

An extend (:meth:`rlcore.rollout.engine.RolloutEngine._extend`) runs every layer over the new tokens
of the episodes that resume together: a few hundred tokens, so the forward is bound by its kernel
launches (tens per layer), and the device waits for the host meanwhile. With the paged cache and the
Triton kernel, the forward takes its inputs as one ``[7, T]`` table of per-token values
(:func:`rlcore.rollout.engine.llama.extend_tokens`), so the engine captures it once per (token bucket,
length bucket) and replays it: the host writes the table (padded to the bucket with tokens that
attend to column 0 and write to the null page) and launches one graph.

Token buckets are powers of two from 64 to 4,096; a larger extend runs eagerly. Attention lengths
are rounded up to powers of two from 256 (few graphs; the kernel skips no masked column, so a
bucket costs at most twice the columns of the widest row). The graphs hold the final hidden states
of the rows' last tokens; the head runs after the replay. They have a memory pool of their own.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import torch

from rlcore.rollout.engine import llama

if TYPE_CHECKING:
    from rlcore.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

#: padded token counts of captured extends (an extend of more tokens runs eagerly)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
#: the smallest attention-length bucket; lengths are rounded up to powers of two from here
MIN_LENGTH = 256
#: extends through graphs where the engine can (CUDA graphs on, paged cache, Triton attention)
ENABLED = True


def token_bucket(tokens: int) -> int | None:
    """The smallest bucket holding ``tokens`` new tokens, or None when none does."""
    return next((b for b in TOKEN_BUCKETS if b >= tokens), None)


def length_bucket(needed: int, max_seq_len: int) -> int:
    """``needed`` attended columns rounded up to a power of two from :data:`MIN_LENGTH`, at most ``max_seq_len``."""
    length = MIN_LENGTH
    while length < needed:
        length *= 2
    return min(length, max_seq_len)


def token_table(appends: Sequence[Sequence[int]], rows: Sequence[int], columns: Sequence[int],
                positions: Sequence[int], pages: Sequence[Sequence[int]], page_size: int,
                width: int) -> tuple[torch.Tensor, list[int]]:
    """The host side of an extend: ``[7, width]`` int64 per-token values (see
    :data:`rlcore.rollout.engine.llama.TOKEN_FIELDS`) of appending ``appends[i]`` to cache row
    ``rows[i]`` at column ``columns[i]`` and position ``positions[i]`` (the row's pages ``pages[i]``),
    padded with zeros (column 0, the null page), and the index of each row's last new token."""
    table = torch.zeros(len(llama.TOKEN_FIELDS), width, dtype=torch.long)
    values: list[list[int]] = [[] for _ in llama.TOKEN_FIELDS]
    last = []
    for ids, row, col, pos, owned in zip(appends, rows, columns, positions, pages):
        cols = range(col, col + len(ids))
        values[0] += ids
        values[1] += [row] * len(ids)
        values[2] += cols
        values[3] += range(pos, pos + len(ids))
        values[4] += [col] * len(ids)
        values[5] += [owned[c // page_size] for c in cols]
        values[6] += [c % page_size for c in cols]
        last.append(len(values[0]) - 1)
    if len(values[0]) > width:
        raise ValueError(f"extend: {len(values[0])} new tokens do not fit {width}")
    table[:, :len(values[0])] = torch.tensor(values, dtype=torch.long)
    return table, last


class ExtendGraphs:
    """Extend forwards of an engine, one CUDA graph per (token bucket, length bucket), captured on
    first use. With ``capture=False`` the same padded forward runs without graphs (what the CPU
    tests check)."""

    def __init__(self, engine: "RolloutEngine", capture: bool = True):
        self.engine, self.capture = engine, bool(capture)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.tokens = torch.zeros(len(llama.TOKEN_FIELDS), TOKEN_BUCKETS[-1], dtype=torch.long, device=engine.device)
        self.last = torch.zeros(engine.max_batch_size, dtype=torch.long, device=engine.device)

    def run(self, appends: Sequence[Sequence[int]], rows: Sequence[int], columns: Sequence[int],
            positions: Sequence[int], needed: int) -> torch.Tensor | None:
        """The ``[m, H]`` final hidden states after each row's last new token, or None when the extend
        is too large for a bucket (the caller then runs it eagerly). The rows' pages must already
        cover the new columns and their key masks include them."""
        eng = self.engine
        width = token_bucket(sum(len(ids) for ids in appends))
        if width is None or len(rows) > len(self.last):
            return None
        table, last = token_table(appends, rows, columns, positions, [eng.slot_pages[r] for r in rows],
                                  eng.page_size, width)
        m = len(last)
        most = min(width, len(self.last))  # rows of the graph's output (the padding ones read token 0)
        # straight from pinned host memory into the buffers the graphs read (one copy each)
        cuda = eng.device.type == "cuda"
        for buffer, host in ((self.tokens[:, :width], table),
                             (self.last[:most], torch.tensor(last + [0] * (most - m), dtype=torch.long))):
            buffer.copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
        key = (width, length_bucket(needed, eng.max_seq_len))
        if not self.capture:
            return self._forward(*key, most)[:m]
        if key not in self.graphs:
            try:
                start = time.perf_counter()
                self.graphs[key] = self._capture(*key, most)
                eng.counters["extend_graph_captures"] += 1
                eng.counters["graph_capture_s"] += time.perf_counter() - start
            except RuntimeError as error:  # capture refused: eager extends from now on
                log.warning("rollout engine: CUDA graph capture of an extend failed (%s); extending without graphs",
                            error)
                eng._extend_graphs = None
                return None
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:m]

    def _forward(self, width: int, length: int, most: int) -> torch.Tensor:
        eng = self.engine
        return llama.extend_tokens(eng.weights, eng.spec, eng.cache, eng.state.table, self.tokens[:, :width],
                                   self.last[:most], eng.state.bias, eng.cos, eng.sin, length, eng.attention_tuning)

    def _capture(self, width: int, length: int, most: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.engine.device
        # warm-up runs write the same keys/values the replay writes (the forward has no other state)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(width, length, most)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = self._forward(width, length, most)
        log.debug("rollout engine: captured extend graph for %d tokens, length %d", width, length)
        return graph, hidden

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None
