"""The prompt loader: endless, seeded, sharded over ranks, prefetched by DataLoader workers, resumable.

Map-style datasets: each epoch is a seeded permutation (``seed``, ``epoch``); rank ``r`` of ``W`` takes
every ``W``-th index of it, cut to whole batches. The position is the number of rows this rank took in
the epoch, so a resumed loader continues with exactly the batches an uninterrupted one would give.

Iterable datasets: each DataLoader worker reads its own share, tagging rows with a position. The loader
records, per worker, the position of the last row handed out; a resumed loader restarts every worker
right after it (each row of the epoch still comes exactly once). Datasets that shard themselves
(``shards_itself = True``) are read as they are, and jump to the position when they also have
``iter_positions`` (``streaming``); Hugging Face iterable datasets are split by node and by worker by
``datasets``; any other iterable is read in full by every worker, which keeps every
``ranks x workers``-th row. Rows before a resumed position are skipped by reading them.

The last rows of an epoch that do not fill a batch are dropped (a new permutation comes next epoch).
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from rlcore.config.schema import DataConfig
from rlcore.data.collate import list_collate
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

log = logging.getLogger(__name__)


def is_map_style(dataset: Any) -> bool:
    return not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")


def _hf_iterable(dataset: Any) -> bool:
    """A ``datasets.IterableDataset`` (only possible once ``datasets`` is imported)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(dataset, getattr(datasets, "IterableDataset", ()))


def epoch_indices(num_rows: int, batch_size: int, seed: int, epoch: int, dist: DistInfo, shuffle: bool,
                  start: int = 0) -> list[int]:
    """This rank's indices of one epoch: whole batches only, disjoint from every other rank's.

    ``start`` skips the epoch's first ``start`` rows of the permutation (rows the ranks of an earlier
    run, possibly of another world size, already took); the rest is dealt out as usual."""
    if shuffle:
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
        order = torch.randperm(num_rows, generator=g)
    else:
        order = torch.arange(num_rows)
    order = order[int(start):]
    per_rank = len(order) // dist.world_size
    mine = order[dist.rank: per_rank * dist.world_size: dist.world_size]
    return mine[: per_rank // batch_size * batch_size].tolist()


class _ListSampler(Sampler):
    def __init__(self, indices: list[int]):
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class _Positioned(IterableDataset):
    """Wraps an iterable dataset: yields ``(worker, position, row)`` of this worker's share, from saved positions."""

    def __init__(self, base: Any, dist: DistInfo, starts: dict[int, int]):
        self.base, self.dist, self.starts = base, dist, starts

    def __iter__(self) -> Iterator[tuple[int, int, dict]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self.starts.get(wid, 0)
        shards_itself = bool(getattr(self.base, "shards_itself", False))
        if shards_itself and hasattr(self.base, "iter_positions"):
            for pos, row in self.base.iter_positions(start, (wid, nw)):
                yield wid, pos, row
            return
        if shards_itself or _hf_iterable(self.base):
            rows = iter(self.base)  # datasets splits by worker itself; by node in PromptLoader
        else:
            slot, nslots = self.dist.rank * nw + wid, self.dist.world_size * nw
            rows = (r for i, r in enumerate(self.base) if i % nslots == slot)
        for pos, row in enumerate(rows, 1):
            if pos > start:
                yield wid, pos, row


class PromptLoader:
    """Batches of prompt rows for one rank, forever. See the module docstring.

    :param dataset: a map-style or iterable dataset of row dicts.
    :param config: the ``data`` section (workers, prefetching, pinning, shuffling).
    :param batch_size: prompts per batch on this rank.
    :param seed: seed of the per-epoch shuffles.
    :param dist: rank and world size.
    """

    def __init__(self, dataset: Any, config: DataConfig, batch_size: int, seed: int, dist: DistInfo):
        if batch_size < 1:
            raise DataError(f"prompt batch size must be >= 1, got {batch_size}")
        self.config, self.batch_size, self.seed, self.dist = config, int(batch_size), int(seed), dist
        self.map_style = is_map_style(dataset)
        if not self.map_style and _hf_iterable(dataset) and dist.world_size > 1:
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=dist.rank, world_size=dist.world_size)
        if not self.map_style and hasattr(dataset, "set_seed"):
            dataset.set_seed(self.seed)
        self.dataset = dataset
        self.epoch = 0
        self._offset = 0  # map-style: rows taken by this rank in this epoch (after ``_start``)
        self._start = 0  # map-style: rows of this epoch's permutation taken before a resume with another world size
        self._positions: dict[int, int] = {}  # iterable: worker -> position of the last row handed out
        self._it: Optional[Iterator[Any]] = None
        self._buf: deque = deque()
        self._epoch_batches = 0
        self._pending: Optional[tuple[list[dict], dict[str, Any]]] = None  # (first batch, state before it)
        if self.map_style:
            n = len(dataset)
            if n // dist.world_size < self.batch_size:
                raise DataError(f"the training set has {n} rows: {n // dist.world_size} per rank for "
                                f"{dist.world_size} rank(s), fewer than one batch of {self.batch_size} prompts "
                                "(ppo.rollout_batch_size; data.filter_overlong_prompts may have dropped some)")

    # -- iteration -----------------------------------------------------------------------------
    def _loader_kwargs(self) -> dict[str, Any]:
        workers = int(self.config.num_workers)
        # a DataLoader's iterator draws its workers' base seed from ``generator``, else from the global
        # torch RNG: one number per epoch, drawn at the first batch, which would shift every later
        # random draw (dropout masks) of a resumed run against an uninterrupted one
        seed = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 1009 + self.dist.rank)
        kw: dict[str, Any] = dict(num_workers=workers, collate_fn=list_collate, generator=seed,
                                  pin_memory=bool(self.config.pin_memory) and torch.cuda.is_available())
        if workers > 0:
            kw["prefetch_factor"] = int(self.config.prefetch_factor)
        return kw

    def _start_epoch(self) -> None:
        if self.map_style:
            idx = epoch_indices(len(self.dataset), self.batch_size, self.seed, self.epoch, self.dist,
                                bool(self.config.shuffle), start=self._start)
            dl = DataLoader(self.dataset, batch_size=self.batch_size, sampler=_ListSampler(idx[self._offset:]),
                            drop_last=True, **self._loader_kwargs())
        else:
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(self.epoch)
            stream = _Positioned(self.dataset, self.dist, dict(self._positions))
            dl = DataLoader(stream, batch_size=self.batch_size, **self._loader_kwargs())
        self._it = iter(dl)
        self._buf.clear()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self._offset, self._start, self._positions, self._epoch_batches = 0, 0, {}, 0
        self._it = None

    def check_first_batch(self) -> None:
        """Read the first batch now (iterable datasets, whose length is unknown), so a set too small
        for one batch fails before anything expensive starts. The batch is handed out first, and
        :meth:`state_dict` reports the position before it until then. Map-style sets are checked
        by their length on construction."""
        if not self.map_style and self._pending is None and self._it is None:
            before = self.state_dict()
            self._pending = (self.next_batch(), before)

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows; a new (reshuffled) epoch starts when one ends."""
        if self._pending is not None:
            batch, self._pending = self._pending[0], None
            return batch
        for _ in range(3):
            if self._it is None:
                self._start_epoch()
            batch = self._next_map() if self.map_style else self._next_iterable()
            if batch is not None:
                self._epoch_batches += 1
                return batch
            if self._epoch_batches == 0 and not (self._offset or self._positions):
                break
            self._next_epoch()
        raise DataError(f"rank {self.dist.rank}: an epoch of the training set gave no full batch of "
                        f"{self.batch_size} prompts (too few rows for {self.dist.world_size} rank(s) x "
                        f"{max(1, int(self.config.num_workers))} worker(s))")

    def _next_map(self) -> Optional[list[dict]]:
        batch = next(self._it, None)
        if batch is not None:
            self._offset += len(batch)
        return batch

    def _next_iterable(self) -> Optional[list[dict]]:
        while len(self._buf) < self.batch_size:
            chunk = next(self._it, None)
            if chunk is None:
                return None
            self._buf.extend(chunk)
        rows = []
        for _ in range(self.batch_size):
            wid, pos, row = self._buf.popleft()
            self._positions[wid] = pos
            rows.append(row)
        return rows

    # -- position ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch, and rows taken (map-style) or per-worker positions (iterable)."""
        if self._pending is not None:
            return dict(self._pending[1])
        state: dict[str, Any] = {"kind": "map" if self.map_style else "iterable", "epoch": self.epoch,
                                 "seed": self.seed, "world_size": self.dist.world_size,
                                 "num_workers": int(self.config.num_workers)}
        if self.map_style:
            # every rank takes its batches in lockstep, so the epoch's first ``consumed`` rows of the
            # permutation are exactly the rows all ranks took: a run of any world size resumes there
            state.update(offset=self._offset, start=self._start, num_rows=len(self.dataset),
                         consumed=self._start + self._offset * self.dist.world_size)
        else:
            state["positions"] = {str(k): int(v) for k, v in self._positions.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kind = "map" if self.map_style else "iterable"
        if state.get("kind") != kind:
            raise DataError(f"cannot resume the data position: it was saved for a {state.get('kind')} dataset, "
                            f"this run has a {kind} one")
        self.epoch, self.seed = int(state["epoch"]), int(state.get("seed", self.seed))
        self._offset, self._start, self._positions, self._epoch_batches, self._it, self._pending = 0, 0, {}, 0, None, None
        if self.map_style:
            if int(state.get("num_rows", -1)) != len(self.dataset):
                log.warning("the training set changed since the checkpoint (%s rows -> %d rows): epoch %d restarts "
                            "from its first batch", state.get("num_rows"), len(self.dataset), self.epoch)
            elif state.get("world_size") != self.dist.world_size:
                consumed = int(state.get("consumed", int(state.get("offset", 0)) * int(state.get("world_size") or 1)))
                self._start = consumed
                log.info("the world size changed since the checkpoint (%s -> %d ranks): epoch %d continues after "
                         "the %d rows the earlier ranks took", state.get("world_size"), self.dist.world_size,
                         self.epoch, consumed)
            else:
                self._start, self._offset = int(state.get("start", 0)), int(state.get("offset", 0))
            return
        if hasattr(self.dataset, "set_seed"):
            self.dataset.set_seed(self.seed)
        if (int(state.get("num_workers", -1)) != int(self.config.num_workers)
                or state.get("world_size") != self.dist.world_size):
            log.warning("data.num_workers or the world size changed since the checkpoint: epoch %d restarts "
                        "from its first row", self.epoch)
            return
        self._positions = {int(k): int(v) for k, v in state.get("positions", {}).items()}
