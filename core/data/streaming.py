"""Streaming parquet prompts: many shards at bounded memory (the ``streaming`` plugin's dataset).

Only footers are read up front (row counts per row group). Each epoch:

1. the row groups of every file are put in a seeded order (``data.shuffle``);
2. that sequence of rows is cut into ``ranks x workers`` contiguous slices whose sizes differ by at most
   one row (a row group may be split between two slices), so every row is read by exactly one
   DataLoader worker of one rank, whatever the shard count;
3. each slice is read in order, row group by row group, ``data.shuffle_buffer`` rows at a time (the
   window); a window is shuffled with a seed of (seed, epoch, slice, window), tokenized, filtered by
   the length policy, and yielded.

Memory holds one window plus one pyarrow record batch. A position is the number of raw rows of a slice
already passed; because windows have a fixed size, resuming at a position reads only the window that
contains it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from rlcore.config.schema import DataConfig
from rlcore.data.collate import LengthStats, apply_length_policy, encode_prompts
from rlcore.data.files import FileInfo
from rlcore.data.schema import check_utf8, conform, unify
from rlcore.data.table import unreadable_parquet
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

log = logging.getLogger(__name__)

#: Rows per pyarrow read; also the window size when shuffling is off.
READ_ROWS = 1024


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` of row group ``row_group`` of file ``file``."""

    file: int
    row_group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def split_rows(sizes: Sequence[tuple[int, int, int]], slot: int, num_slots: int) -> list[Piece]:
    """The pieces of slice ``slot`` when the rows of ``sizes`` (``(file, row_group, rows)``, in order)
    are cut into ``num_slots`` contiguous slices of ``total // num_slots`` or one more rows."""
    total = sum(n for _, _, n in sizes)
    lo, hi = slot * total // num_slots, (slot + 1) * total // num_slots
    pieces, offset = [], 0
    for f, rg, n in sizes:
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            pieces.append(Piece(f, rg, a - offset, b - offset))
        offset += n
        if offset >= hi:
            break
    return pieces


class _SliceReader:
    """Reads the rows of a list of pieces in order, from any starting row, a chunk at a time."""

    def __init__(self, files: Sequence[str], pieces: Sequence[Piece], start: int, schema: Any = None):
        self.files, self.pieces, self.schema = files, list(pieces), schema
        self._piece = 0
        while self._piece < len(self.pieces) and start >= self.pieces[self._piece].rows:
            start -= self.pieces[self._piece].rows
            self._piece += 1
        self._skip = start  # rows of the first piece already passed
        self._batches: Optional[Iterator[Any]] = None
        self._buf: list[dict] = []

    def _next_rows(self) -> Optional[list[dict]]:
        """The next chunk of rows of the current piece, or None when every piece is read."""
        import pyarrow.parquet as pq

        while self._piece < len(self.pieces):
            p = self.pieces[self._piece]
            with unreadable_parquet(self.files[p.file], p.row_group):
                if self._batches is None:
                    pf = pq.ParquetFile(self.files[p.file])
                    self._batches = pf.iter_batches(batch_size=READ_ROWS, row_groups=[p.row_group])
                    self._at, self._lo = 0, p.start + self._skip  # row index in the row group; first row wanted
                    self._skip = 0
                batch = next(self._batches, None) if self._at < p.stop else None
            if batch is None:
                self._piece, self._batches = self._piece + 1, None
                continue
            a, b = max(self._lo, self._at), min(p.stop, self._at + batch.num_rows)
            self._at += batch.num_rows
            if a < b:
                part = batch.slice(a - (self._at - batch.num_rows), b - a)
                check_utf8(part, f"{self.files[p.file]} (row group {p.row_group})", a)
                return (conform(part, self.schema) if self.schema is not None else part).to_pylist()
        return None

    def read(self, n: int) -> list[dict]:
        """The next ``n`` rows (fewer at the end)."""
        while len(self._buf) < n:
            rows = self._next_rows()
            if rows is None:
                break
            self._buf.extend(rows)
        out, self._buf = self._buf[:n], self._buf[n:]
        return out


class StreamingParquetDataset(IterableDataset):
    """Iterable prompt dataset over parquet shards; see the module docstring.

    Iterating yields row dicts (the prompt as text, ``input_ids`` and every other column) of this
    process's slice: rank ``dist.rank`` and, inside a DataLoader, the current worker.
    """

    #: The loader may ask for this process's slice and resume positions (see :meth:`iter_positions`).
    shards_itself = True

    def __init__(self, infos: Sequence[FileInfo], config: DataConfig, tokenizer: Any, dist: DistInfo, *,
                 shuffle: bool = True, seed: int = 0, where: str = "data.train_files"):
        import pyarrow.parquet as pq

        self.files = [i.path for i in infos]
        self.config, self.tokenizer, self.dist = config, tokenizer, dist
        self.shuffle, self.seed, self.epoch, self.where = shuffle, int(seed), 0, where
        self.window = max(1, int(config.shuffle_buffer)) if shuffle else READ_ROWS
        self.sizes: list[tuple[int, int, int]] = []
        #: Every file's columns under one schema (a column a shard lacks is null in its rows).
        self.schema: Optional[pa.Schema] = None
        for f, path in enumerate(self.files):
            meta = pq.read_metadata(path)
            self.sizes += [(f, rg, meta.row_group(rg).num_rows) for rg in range(meta.num_row_groups)
                           if meta.row_group(rg).num_rows]
            schema = meta.schema.to_arrow_schema().remove_metadata()
            self.schema = schema if self.schema is None else unify(self.schema, self.files[0], schema, path)
        self.num_rows = sum(n for _, _, n in self.sizes)
        if self.num_rows == 0:
            raise DataError(f"{where}: the dataset is empty: {len(self.files)} parquet file(s) hold 0 rows")
        self.stats = LengthStats()
        self._positions: dict[str, int] = {}

    # -- configuration by the loader ---------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def set_seed(self, seed: int) -> None:
        self.seed = int(seed)

    # -- planning ----------------------------------------------------------------------------
    def order(self) -> list[tuple[int, int, int]]:
        """Row groups in this epoch's order."""
        sizes = list(self.sizes)
        if self.shuffle:
            random.Random(f"rlcore-order-{self.seed}-{self.epoch}").shuffle(sizes)
        return sizes

    def plan(self, slot: int, num_slots: int) -> list[Piece]:
        return split_rows(self.order(), slot, num_slots)

    def slot_of(self, worker: Optional[tuple[int, int]] = None) -> tuple[int, int]:
        """``(slot, num_slots)`` of this process: rank-major, then DataLoader worker."""
        if worker is None:
            info = get_worker_info()
            worker = (info.id, info.num_workers) if info is not None else (0, 1)
        wid, nw = worker
        return self.dist.rank * nw + wid, self.dist.world_size * nw

    # -- iteration ---------------------------------------------------------------------------
    def iter_positions(self, start: int = 0, worker: Optional[tuple[int, int]] = None) -> Iterator[tuple[int, dict]]:
        """Yield ``(position, row)`` of this process's slice from raw position ``start`` on.

        ``position`` counts the raw rows of the slice passed once the row is consumed (filtered rows
        count too), so ``iter_positions(start=position)`` continues right after that row.
        """
        slot, nslots = self.slot_of(worker)
        pieces = self.plan(slot, nslots)
        total = sum(p.rows for p in pieces)
        size = self.window
        first = start // size
        reader = _SliceReader(self.files, pieces, first * size, self.schema)
        stats = LengthStats()
        warned = False
        for w in range(first, -(-total // size)):
            lo = w * size
            rows = reader.read(min(size, total - lo))
            order = list(range(len(rows)))
            if self.shuffle:
                random.Random(f"rlcore-window-{self.seed}-{self.epoch}-{slot}-{nslots}-{w}").shuffle(order)
            skip = start - lo if w == first else 0
            chosen = order[skip:]
            where = f"{self.where} ({', '.join(self._files_of(pieces))})"
            texts, ids = encode_prompts([rows[i][self.config.prompt_key] for i in chosen], self.tokenizer, where)
            keep, ids, s = apply_length_policy(ids, self.config, where)
            stats.add(s)
            if s.dropped and not warned:  # at once, not only when the slice ends
                warned = True
                log.warning("%s: dropping prompts over data.max_prompt_length=%d (%d of %d in this window of slice "
                            "%d, epoch %d, longest %d tokens); the total follows at the end of the slice", self.where,
                            self.config.max_prompt_length, s.dropped, s.rows, slot, self.epoch, s.longest)
            for j, x in zip(keep, ids):
                row = rows[chosen[j]]
                row[self.config.prompt_key], row["input_ids"] = texts[j], x
                yield lo + skip + j + 1, row
        self._finish_pass(stats, start, pieces, slot)

    def _files_of(self, pieces: Sequence[Piece]) -> list[str]:
        seen = sorted({p.file for p in pieces})
        names = [self.files[f] for f in seen[:3]]
        return names + ([f"… {len(seen) - 3} more"] if len(seen) > 3 else [])

    def _finish_pass(self, stats: LengthStats, start: int, pieces: Sequence[Piece], slot: int) -> None:
        self.stats.add(stats)
        if stats.dropped:
            log.warning("%s: dropped %d of %d prompt(s) over max_prompt_length=%d in slice %d of epoch %d",
                        self.where, stats.dropped, stats.rows, self.config.max_prompt_length, slot, self.epoch)
        if start == 0 and stats.rows and stats.dropped == stats.rows:
            raise DataError(f"{self.where}: every prompt is longer than data.max_prompt_length="
                            f"{self.config.max_prompt_length} tokens (column '{self.config.prompt_key}': "
                            f"{stats.dropped} of {stats.rows} rows dropped, longest {stats.longest}) in "
                            f"{', '.join(self._files_of(pieces))}")

    def __iter__(self) -> Iterator[dict]:
        slot, nslots = self.slot_of()
        key = f"{slot}/{nslots}"
        for pos, row in self.iter_positions(self._positions.get(key, 0), None):
            self._positions[key] = pos
            yield row
        self._positions.pop(key, None)

    # -- position ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Epoch, seed and the position of each slice iterated in this process."""
        return {"epoch": self.epoch, "seed": self.seed, "positions": dict(self._positions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])
        self._positions = {str(k): int(v) for k, v in state.get("positions", {}).items()}


def build_streaming_dataset(config: DataConfig, tokenizer: Any, split: str, dist: DistInfo) -> StreamingParquetDataset:
    """Check the split's files (parquet only) and build the dataset; training data is shuffled."""
    from rlcore.data.files import check_files

    key = f"data.{split}_files"
    infos = check_files(config.train_files if split == "train" else config.val_files, config.prompt_key, key)
    other = [i.path for i in infos if i.format != "parquet"]
    if other:
        raise DataError(f"{key}: the streaming plugin reads parquet files only; got {', '.join(other[:5])}")
    return StreamingParquetDataset(infos, config, tokenizer, dist, shuffle=bool(config.shuffle) and split == "train",
                                   where=key)
