"""The default dataset provider: parquet/jsonl prompts as a tokenized, filtered, memory-mapped Arrow table.

``build_dataset`` returns, by case:

* ``data.custom_cls.path`` set: the user's class, ``cls(files, prompt_key=..., **kwargs)``;
* no files for the split (``train``, or ``val`` when ``train_files`` is empty too): the built-in demo task;
* otherwise a :class:`PromptTable` read from the cache when the inputs, tokenizer and options match an
  entry, else built (in ``data.preprocess_workers`` processes) and, with ``data.cache_dir``, cached.

``check_data_files`` runs the checks that need no tokenizer (files, parquet footers, prompt column) and
is called by the CLI before any model loads.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import pyarrow as pa
from torch.utils.data import Dataset

from rlcore.config.schema import DataConfig
from rlcore.data import cache as dcache
from rlcore.data.collate import LengthStats
from rlcore.data.custom import build_custom_dataset, load_custom_class
from rlcore.data.files import FileInfo, as_list, check_files, resolve_files
from rlcore.data.table import TableSink, iter_processed, open_arrow, plan_units
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

log = logging.getLogger(__name__)

#: Seconds a rank waits for another rank on the same node to finish the cache entry.
CACHE_WAIT_S = 6 * 3600.0


class RowsDataset(Dataset):
    """A map-style dataset over a list of row dicts."""

    def __init__(self, rows: Sequence[dict]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return dict(self.rows[i])


class PromptTable(Dataset):
    """Map-style dataset over an Arrow table; rows are dicts with ``input_ids`` and every other column.

    A table read from the cache is memory-mapped: DataLoader workers and ranks on a node share its pages,
    and pickling it (to a worker started by ``spawn``) sends the path, not the data.
    """

    def __init__(self, table: pa.Table, *, path: Optional[str] = None, stats: Optional[dict] = None,
                 from_cache: bool = False):
        self.path, self.from_cache = path, from_cache
        self.stats = dict(stats or {})
        self._set_table(table)

    def _set_table(self, table: pa.Table) -> None:
        self.table = table
        # Rows are fetched batch by batch: a ``take`` over the whole chunked table would first
        # concatenate every chunk (a copy of the table) for string and list columns.
        self._batches = table.to_batches()
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches])

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """Rows ``indices`` in that order (the DataLoader calls this for a whole batch)."""
        n = self.table.num_rows
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and not ((idx >= -n) & (idx < n)).all():
            raise IndexError(f"row index out of range for {n} rows: {indices}")
        idx = idx % max(n, 1)
        chunk = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[Optional[dict]] = [None] * len(idx)
        for c in np.unique(chunk):
            where = np.nonzero(chunk == c)[0]
            local = pa.array(idx[where] - self._starts[c], type=pa.int64())
            for j, row in zip(where.tolist(), self._batches[c].take(local).to_pylist()):
                out[j] = row
        return out  # type: ignore[return-value]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path:
            state.update(table=None, _batches=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.table is None:
            self._set_table(open_arrow(self.path))


def build_dataset(config: DataConfig, tokenizer: Any, split: str, dist: DistInfo) -> Dataset:
    """Build the prompt dataset of ``split`` (``"train"`` or ``"val"``); see the module docstring."""
    if split not in ("train", "val"):
        raise DataError(f"unknown data split '{split}' (expected 'train' or 'val')")
    key = f"data.{split}_files"
    spec = as_list(config.train_files if split == "train" else config.val_files)
    if config.custom_cls.path:
        if split == "val" and not spec:
            return RowsDataset([])
        return build_custom_dataset(config.custom_cls, resolve_files(spec, key), config.prompt_key)
    if not spec:
        if split == "train" or not as_list(config.train_files):
            from rlcore.demo import demo_dataset

            return demo_dataset(tokenizer, split)
        return RowsDataset([])
    infos = check_files(spec, config.prompt_key, key)
    unreadable = [i.path for i in infos if i.format is None or "://" in i.path]
    if unreadable:
        raise DataError(f"{key}: the default dataset provider reads local .parquet and .jsonl files; "
                        f"cannot read {', '.join(unreadable[:5])} (select a plugin that reads this format)")
    return load_prompt_table(infos, config, tokenizer, dist, key)


def check_data_files(config: DataConfig) -> list[FileInfo]:
    """Check inputs before any model loads: files exist, parquet footers read, the prompt column exists.

    With ``data.custom_cls`` the class is imported and the files are only checked to exist (the class
    reads them its own way).

    :returns: what was learned about each training file (columns, row counts where the footer says).
    :raises DataError: naming the file and column, with counts.
    """
    if config.custom_cls.path:
        load_custom_class(config.custom_cls)
        for key, spec in (("data.train_files", config.train_files), ("data.val_files", config.val_files)):
            resolve_files(spec, key)
        return []
    problems: list[DataError] = []
    train: list[FileInfo] = []
    for key, spec in (("data.train_files", config.train_files), ("data.val_files", config.val_files)):
        try:
            infos = check_files(spec, config.prompt_key, key)
        except DataError as e:  # both lists are checked, so a missing val file shows with a missing train file
            problems.append(e)
            continue
        if key == "data.train_files":
            train = infos
    if len(problems) > 1:
        raise DataError("\n".join(str(p) for p in problems))
    if problems:
        raise problems[0]
    return train


def check_rows_for_batch(infos: Sequence[FileInfo], batch_size: Any, world_size: int = 1) -> None:
    """Fail early when the training files hold fewer rows (parquet footers) than one batch of
    ``ppo.rollout_batch_size`` prompts per rank; files of unknown length pass."""
    if not infos or any(i.num_rows < 0 for i in infos) or not isinstance(batch_size, int):
        return
    rows = sum(i.num_rows for i in infos)
    if rows // max(world_size, 1) < batch_size:
        raise DataError(f"data.train_files hold {rows} rows in {len(infos)} file(s): fewer than one batch of "
                        f"ppo.rollout_batch_size={batch_size} prompts" + (f" per rank ({world_size} ranks)"
                                                                            if world_size > 1 else ""))


# ------------------------------------------------------------------------------------------------
# Building and caching the table
# ------------------------------------------------------------------------------------------------


def load_prompt_table(infos: Sequence[FileInfo], config: DataConfig, tokenizer: Any, dist: DistInfo,
                      key: str) -> PromptTable:
    """Open the cache entry for these inputs, or build the table (and the entry)."""
    t0 = time.perf_counter()
    if not config.cache_dir:
        table, stats = _build(infos, config, tokenizer, key, path=None)
        _report(key, stats, len(infos), time.perf_counter() - t0, "built")
        return PromptTable(table, stats=stats)
    entry_key = dcache.cache_key([i.path for i in infos], tokenizer, config)
    final, stats_path = dcache.entry_paths(config.cache_dir, entry_key)
    if not os.path.exists(final) and dist.world_size > 1 and dist.local_rank != 0:
        dcache.wait_for_entry(final, CACHE_WAIT_S)  # local rank 0 builds; the others map its file
    table = _open_entry(final)
    from_cache = table is not None
    if table is None:
        _build_entry(infos, config, tokenizer, key, final, stats_path)
        table = open_arrow(final)
    stats = dcache.read_json(stats_path) or {}
    _report(key, stats, len(infos), time.perf_counter() - t0, "read from cache" if from_cache else "built and cached")
    return PromptTable(table, path=final, stats=stats, from_cache=from_cache)


def _open_entry(final: str) -> Optional[pa.Table]:
    """The cached table, or None when there is no entry or it cannot be read (it is then rebuilt)."""
    if not os.path.exists(final):
        return None
    try:
        return open_arrow(final)
    except (OSError, pa.ArrowException) as err:
        log.warning("data cache entry %s is unreadable (%s); rebuilding it", final, err)
        return None


def _build_entry(infos: Sequence[FileInfo], config: DataConfig, tokenizer: Any, key: str,
                 final: str, stats_path: str) -> None:
    marker = dcache.failure_marker(final)
    if os.path.exists(marker):
        os.remove(marker)
    stats: dict = {}

    def build(tmp: str) -> None:
        stats.update(_build(infos, config, tokenizer, key, path=tmp)[1])

    try:
        dcache.atomic_build(final, build)
    except DataError as err:
        dcache.write_json_atomic(marker, {"error": str(err), "time": time.time()})
        raise
    dcache.write_json_atomic(stats_path, stats)


def _build(infos: Sequence[FileInfo], config: DataConfig, tokenizer: Any, key: str,
           path: Optional[str]) -> tuple[Optional[pa.Table], dict]:
    """Read, tokenize and filter every file into ``path`` (or memory); return the table and the counts."""
    per_file = [LengthStats() for _ in infos]
    sink = TableSink(path)
    try:
        for unit, parts, s in iter_processed(plan_units(infos), tokenizer, config, config.preprocess_workers):
            per_file[unit.file_index].add(s)
            for part in parts:
                sink.write(part, unit.path)
    except BaseException:
        sink.abort()
        raise
    table = sink.finish()
    total = LengthStats()
    for s in per_file:
        total.add(s)
    _check_counts(infos, per_file, total, config, key)
    stats = {"rows": total.rows, "kept": total.rows - total.dropped, "dropped": total.dropped,
             "truncated": total.truncated, "longest": total.longest, "files": len(infos)}
    return table, stats


def _check_counts(infos: Sequence[FileInfo], per_file: Sequence[LengthStats], total: LengthStats,
                  config: DataConfig, key: str) -> None:
    if total.rows == 0:
        names = ", ".join(i.path for i in infos[:5]) + (" …" if len(infos) > 5 else "")
        raise DataError(f"{key}: the dataset is empty: {len(infos)} file(s) hold 0 rows ({names})")
    if total.dropped == total.rows:
        lines = [f"{key}: every prompt is longer than data.max_prompt_length={config.max_prompt_length} tokens "
                 f"(column '{config.prompt_key}': {total.dropped} of {total.rows} rows dropped, "
                 f"longest {total.longest}); raise data.max_prompt_length or check data.prompt_key"]
        lines += [f"  {i.path}: {s.dropped} of {s.rows} rows over the limit" for i, s in zip(infos[:10], per_file)]
        raise DataError("\n".join(lines))


def _report(key: str, stats: dict, files: int, seconds: float, how: str) -> None:
    msg = (f"{key}: {stats.get('kept', '?')} prompts from {files} file(s) {how} in {seconds:.2f}s")
    if stats.get("dropped") and "built" in how:  # a cache hit repeats the counts quietly
        log.warning("%s; dropped %d of %d prompt(s) over max_prompt_length (longest %d tokens)", msg,
                    stats["dropped"], stats["rows"], stats.get("longest", 0))
    else:
        extra = [f"{k} {stats[k]}" for k in ("dropped", "truncated") if stats.get(k)]
        log.info(msg + (f" ({', '.join(extra)})" if extra else ""))
